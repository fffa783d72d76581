"""The identity of a model's weights: one SHA-256, the same for every weight format of one checkpoint.

Laser files (:mod:`laserlm.depth.laser_file`) record it and refuse to load on a model whose weights hash
differs. Definition: SHA-256 over ``name:shape;`` + bfloat16 bytes of every parameter in
``named_parameters`` order, tied weights once. bfloat16 rounding makes float32 and bfloat16 loads of one
checkpoint hash equal.

Packed formats (``int4`` / ``int8`` / ``native``, :mod:`laserlm.models.packing`) replace the float matrices,
so the hash is taken **before** packing and recorded on the model (:data:`ATTRIBUTE`): a laser file made on
the float model loads on the packed one and vice versa. :func:`laserlm.models.packing.pack_model` records it;
the loader first looks for a digest it stored on disk beside the weights' cache entry (hashing 135M
parameters takes ~0.4 s on one core). The value is memoised on the model object: code that changes a
model's weights in place must call :func:`forget_weights_sha256`.
"""

from __future__ import annotations

import hashlib

import torch

ATTRIBUTE = "laserlm_weights_sha256"
DEFERRED = "laserlm_weights_sha256_fn"  # a callable giving the digest, for models loaded without float weights


def compute_weights_sha256(model: torch.nn.Module) -> str:
    """The digest of ``model``'s parameters as they are now (no memo); see the module docstring.

    A packed model's quantized matrices are buffers (``blocks``): their raw bytes are hashed too, so two
    packed models never collide because their float parameters (norms) agree.
    """
    h = hashlib.sha256()
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:  # tied weights (embedding = LM head) hashed once
            continue
        seen.add(p.data_ptr())
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(p.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    for name, b in model.named_buffers():
        if name.endswith("blocks") and b.data_ptr() not in seen:
            seen.add(b.data_ptr())
            h.update(f"{name}:{tuple(b.shape)}:{b.dtype};".encode())
            h.update(b.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """The recorded digest of ``model`` (taken before packing), else computed now and recorded (hex, 64 chars)."""
    recorded = model.__dict__.get(ATTRIBUTE)
    if recorded is None:
        deferred = model.__dict__.pop(DEFERRED, None)
        recorded = record_weights_sha256(model, deferred() if deferred is not None else compute_weights_sha256(model))
    return recorded


def defer_weights_sha256(model: torch.nn.Module, compute) -> None:
    """Let ``compute()`` give ``model``'s digest when something first asks for it (a model whose float weights were
    never made: :mod:`laserlm.models.gguf_native`)."""
    model.__dict__[DEFERRED] = compute


def has_weights_sha256(model: torch.nn.Module) -> bool:
    """Whether ``model``'s digest is recorded or deferred (then packing need not hash its float weights)."""
    return ATTRIBUTE in model.__dict__ or DEFERRED in model.__dict__


def record_weights_sha256(model: torch.nn.Module, digest: str) -> str:
    """Attach ``digest`` to ``model`` (the loader and the packer call this before replacing float matrices)."""
    model.__dict__[ATTRIBUTE] = digest
    return digest


def forget_weights_sha256(model: torch.nn.Module) -> None:
    """Drop the memoised digest (after changing float weights in place); a packed model cannot be re-hashed
    to its float checkpoint's value, so this is for float models."""
    model.__dict__.pop(ATTRIBUTE, None)
