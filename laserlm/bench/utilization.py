"""Memory-bandwidth utilization of decoding: bytes read per token x tokens/s / the machine's read bandwidth.

Token generation on a CPU is bound by the bytes read per token (DESIGN.md, "Where decode time goes"): every
decode step streams the weights of the layers it runs plus the LM head, and the K/V of the context. The
read bandwidth is measured here (a sum over a float32 array much larger than the caches, best of several
runs, on the threads torch uses), so utilization near 1 means "as fast as this memory allows" and a low value
means time goes elsewhere (dispatch overhead, compute-bound kernels).
"""

from __future__ import annotations

import time

import torch

from ..errors import InvalidArgumentError


def read_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Measured read bandwidth in bytes/s: ``torch.sum`` over a ``mib`` MiB float32 tensor, best of ``reps``
    after one untimed pass (the STREAM-style "read" kernel; the tensor is far larger than the caches).

    Raises:
        InvalidArgumentError: ``mib`` < 64 (the array would fit in cache) or ``reps`` < 1.
    """
    if mib < 64 or reps < 1:
        raise InvalidArgumentError(f"bandwidth probe needs >= 64 MiB and >= 1 rep, got {mib} MiB, {reps}")
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def _nbytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def bytes_per_token(engine, layers_per_token: float, context: float) -> dict:
    """Bytes one decode step reads, in the engine's weight format (the tensors as stored: packed int4 /
    int8 blocks, or float matrices).

    Args:
        layers_per_token: decoder layers run per token (``L`` at full depth; the adaptive mean otherwise).
        context: mean cached positions read by attention.

    Returns ``{"weights", "kv", "total"}`` in bytes: the mean layer's tensors times ``layers_per_token``, the
    LM head (read in full every step; an embedding row is negligible) and K/V of ``context`` positions in
    each layer run.
    """
    a = engine.adapter
    L = a.num_layers
    layer = sum(_nbytes(layer) for layer in a.layers) / L
    head = _nbytes(a.lm_head)
    kv_per_layer = 2 * a.num_kv_heads * a.head_dim * torch.empty((), dtype=engine.dtype).element_size() * context
    weights = layer * layers_per_token + head
    kv = kv_per_layer * layers_per_token
    return {"weights": weights, "kv": kv, "total": weights + kv}


def utilization(bytes_token: float, tokens_per_s: float, bandwidth: float) -> float:
    """Fraction of the measured read bandwidth a decode at ``tokens_per_s`` uses: bytes/token x tokens/s /
    bandwidth (bytes/s)."""
    return bytes_token * tokens_per_s / bandwidth
