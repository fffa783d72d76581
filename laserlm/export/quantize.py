"""Block-quantized weights in the exported graphs: onnxruntime's ``MatMulNBits`` from laserlm's own blocks.

``laserlm export onnx --weights native|int4|int8`` first exports the float32 graphs, then replaces every
``MatMul`` whose constant matrix is one of the model's projections (q/k/v/o, gate/up/down, the LM head) by
onnxruntime's contrib operator ``com.microsoft.MatMulNBits`` holding *the same blocks* the PyTorch engine runs
with that ``--weights`` (:mod:`laserlm.models.packing`): the GGUF file's own ``Q4_1`` / ``Q8_0`` tensors for
``native``, laserlm's round-to-nearest ones for ``int4`` / ``int8``. Nothing is re-quantized but what ``MatMulNBits``
cannot hold: a GGUF's ``Q4_K`` and ``Q6_K`` matrices kept by ``LASERLM_KQUANTS=native`` become ``Q4_1`` blocks (the
same 4-bit values, each 32-weight block's scale and min rounded to fp16) and ``Q8_0`` of their dequantized values.
(onnxruntime's own
``MatMulNBitsQuantizer`` re-quantizes every dequantized float weight, a second rounding that raises perplexity
noticeably.)

Mapping (``W [N, K]``, blocks of 32 along K, ``nb = K / 32``):

- ``Q8_0`` (``w = d * q``, q int8): ``MatMulNBits`` with ``bits=8``, ``B = q + 128`` (its default zero point is
  128), ``scales = d``: exact.
- ``Q4_1`` (``w = d * q + m``, q in 0..15): ``MatMulNBits`` has integer zero points only on its fast path, so
  ``w = d * (q - 8) + c`` with ``c = m + 8 d``: ``bits=4`` with the default zero point 8 and ``scales = d``, plus
  the per-block sums of the input times ``c``: ``Y = MatMulNBits(A) + ReduceSum(A [.., nb, 32]) @ C [nb, N]``.
  Exact in real arithmetic (float32 rounding apart).

``accuracy_level`` is ``MatMulNBits``' attribute: 4 (default) quantizes the activations to int8 per block and uses
integer dot products (llama.cpp's scheme for these formats; relative error ~4e-3 per matrix product), 0 computes in
float32 (exact, about 2.5x slower for 4 bits and unusably slow for 8 bits in onnxruntime 1.32).
Where nothing fits (a float matrix in a mixed file, a trained exit-head adapter) the float32 ``MatMul`` stays.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import InvalidArgumentError

ACCURACY_LEVELS = (0, 4)
MS_DOMAIN = "com.microsoft"


def _digest(a: np.ndarray) -> bytes:
    return hashlib.sha1(np.ascontiguousarray(a, dtype=np.float32).tobytes()).digest()


def _projections(model):
    """``(name, module)`` of every projection of a transformers causal LM (same names in a float and a packed
    load)."""
    for j, layer in enumerate(model.model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                if hasattr(owner, p):
                    yield f"layers.{j}.{p}", getattr(owner, p)
    yield "lm_head", model.lm_head


def weight_index(float_model) -> dict[bytes, str]:
    """``{sha1 of W^T float32 bytes: projection name}``: how a graph's constant ``MatMul`` input (``W^T [K, N]``,
    the exporter folds the transpose) is recognised."""
    return {_digest(m.weight.detach().float().T.numpy()): name for name, m in _projections(float_model)}


def _blocks_of(mod):
    """``(blocks uint8 [N, nb * bytes], fmt)`` of a packed projection, or ``None`` for a float matrix."""
    from ..models.packing import _Concat  # noqa: PLC0415
    from ..models.quant import (Q4_1, Q4_K, Q6_K, Q8_0, QuantLinear, RowSlice, q4_k_as_q4_1,  # noqa: PLC0415
                                q6_k_as_q8_0)

    start, stop = 0, mod.out_features
    if isinstance(mod, RowSlice):
        start, stop, mod = mod.start, mod.stop, mod.fused
    if isinstance(mod, _Concat):
        row = 0
        for part in mod.parts:
            if row <= start and stop <= row + part.out_features:
                start, stop, mod = start - row, stop - row, part
                break
            row += part.out_features
        else:
            return None
    if not isinstance(mod, QuantLinear):
        return None
    if mod.fmt == Q6_K:  # MatMulNBits has no 6-bit form: Q8_0 of the dequantized rows (a second rounding)
        return q6_k_as_q8_0(mod.blocks[start:stop]), Q8_0
    if mod.fmt == Q4_K:  # as Q4_1 blocks: the same 4-bit values, scales and mins rounded to fp16
        return q4_k_as_q4_1(mod.blocks[start:stop]), Q4_1
    return mod.blocks[start:stop], mod.fmt


def packed_blocks(packed_model) -> dict[str, tuple]:
    """``{projection name: (blocks, fmt)}`` of a model loaded with ``--weights native|int4|int8``."""
    out = {}
    for name, mod in _projections(packed_model):
        b = _blocks_of(mod)
        if b is not None:
            out[name] = b
    return out


def nbits_arrays(blocks: torch.Tensor, fmt: int, k: int) -> dict:
    """``MatMulNBits`` initializers for laserlm blocks ``[N, nb * bytes]``: ``B uint8 [N, nb, 32 * bits / 8]``,
    ``scales float32 [N * nb]``, and for Q4_1 the correction ``C float32 [nb, N]`` (see the module docstring).

    Raises:
        InvalidArgumentError: a format other than Q4_1 / Q8_0.
    """
    from ..models.quant import Q4_1, Q8_0, QK  # noqa: PLC0415

    n, nb = blocks.shape[0], k // QK
    raw = blocks.numpy()
    qb = 32 if fmt == Q8_0 else 16
    d = raw[:, nb * qb: nb * qb + 2 * nb].copy().view(np.float16).astype(np.float32)  # [N, nb]
    if fmt == Q8_0:
        q = raw[:, : nb * 32].reshape(n, nb, 32).view(np.int8).astype(np.int16) + 128
        return {"bits": 8, "B": q.astype(np.uint8), "scales": d.reshape(-1)}
    if fmt != Q4_1:
        raise InvalidArgumentError(f"no MatMulNBits mapping for block format {fmt}")
    m = raw[:, nb * qb + 2 * nb: nb * qb + 4 * nb].copy().view(np.float16).astype(np.float32)
    nib = raw[:, : nb * 16].reshape(n, nb, 16)
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)  # [N, nb, 32]: weight j of the block
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # MatMulNBits: weight 2i low, 2i+1 high nibble
    c = (m + np.float32(8) * d).astype(np.float32)
    return {"bits": 4, "B": packed, "scales": d.reshape(-1), "C": np.ascontiguousarray(c.T)}


def check_accuracy_level(accuracy_level) -> None:
    """Raises InvalidArgumentError: ``accuracy_level`` not in :data:`ACCURACY_LEVELS`."""
    if accuracy_level not in ACCURACY_LEVELS:
        raise InvalidArgumentError(f"--accuracy-level must be one of {ACCURACY_LEVELS}, got {accuracy_level}")


def quantize_graph(path, index: dict, blocks: dict, accuracy_level: int = 4) -> dict:
    """Rewrite the graph file ``path`` in place: each ``MatMul`` whose constant input is a projection with blocks
    becomes ``MatMulNBits`` (+ the Q4_1 correction). Returns ``{"quantized": {name: format}, "float": count}``.

    Raises:
        InvalidArgumentError: ``accuracy_level`` not in :data:`ACCURACY_LEVELS`.
    """
    import onnx  # noqa: PLC0415
    from onnx import helper, numpy_helper  # noqa: PLC0415

    from ..models.quant import FORMAT_NAMES, QK  # noqa: PLC0415

    check_accuracy_level(accuracy_level)
    model = onnx.load(str(path))
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    users: dict[str, int] = {}
    for node in g.node:
        for i in node.input:
            users[i] = users.get(i, 0) + 1
    nodes, new_inits, drop, done, kept, sums = [], [], set(), {}, 0, {}
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        name = None
        if w is not None and len(w.dims) == 2:
            name = index.get(_digest(numpy_helper.to_array(w)))
        if name is None or name not in blocks:
            kept += w is not None
            nodes.append(node)
            continue
        blk, fmt = blocks[name]
        k, n = (int(x) for x in w.dims)
        arr = nbits_arrays(blk, fmt, k)
        tag = node.name.strip("/").replace("/", "_") or f"mm{len(done)}"
        b_name, s_name = f"{tag}.nbits_B", f"{tag}.nbits_scales"
        new_inits += [numpy_helper.from_array(arr["B"], b_name), numpy_helper.from_array(arr["scales"], s_name)]
        a, y = node.input[0], node.output[0]
        attrs = {"K": k, "N": n, "bits": arr["bits"], "block_size": QK, "accuracy_level": accuracy_level}
        if "C" not in arr:
            nodes.append(helper.make_node("MatMulNBits", [a, b_name, s_name], [y], name=f"{node.name}_nbits",
                                          domain=MS_DOMAIN, **attrs))
        else:  # Y = MatMulNBits(A) + ReduceSum(A [B, T, nb, 32], -1) @ C; the graphs' activations are [B, T, K]
            nb = k // QK
            c_name, y0, y1 = f"{tag}.nbits_C", f"{tag}.nbits_y0", f"{tag}.nbits_y1"
            new_inits.append(numpy_helper.from_array(arr["C"], c_name))
            nodes.append(helper.make_node("MatMulNBits", [a, b_name, s_name], [y0], name=f"{node.name}_nbits",
                                          domain=MS_DOMAIN, **attrs))
            if a not in sums:  # q/k/v (and gate/up) read the same input: its block sums are computed once
                shape, axes, blk_t = f"{tag}.nbits_shape", f"{tag}.nbits_axes", f"{tag}.nbits_blocks"
                sums[a] = f"{tag}.nbits_sums"
                new_inits += [numpy_helper.from_array(np.array([0, 0, nb, QK], dtype=np.int64), shape),
                              numpy_helper.from_array(np.array([-1], dtype=np.int64), axes)]
                nodes += [helper.make_node("Reshape", [a, shape], [blk_t], name=f"{node.name}_blocks"),
                          helper.make_node("ReduceSum", [blk_t, axes], [sums[a]], name=f"{node.name}_sums",
                                           keepdims=0)]
            nodes += [helper.make_node("MatMul", [sums[a], c_name], [y1], name=f"{node.name}_offset"),
                      helper.make_node("Add", [y0, y1], [y], name=f"{node.name}_add")]
        users[w.name] -= 1
        if users[w.name] == 0:
            drop.add(w.name)
        done[name] = FORMAT_NAMES[fmt]
    if not done:
        return {"quantized": {}, "float": kept}
    del g.node[:]
    g.node.extend(nodes)
    keep = [t for t in g.initializer if t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(keep + new_inits)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    onnx.save(model, str(path))
    return {"quantized": done, "float": kept}
