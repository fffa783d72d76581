"""K/V projections of a hidden state: what a decoder layer would write to its cache for a token, without running it.

Used by the ``propagate`` bridge (:meth:`laserlm.runtime.engine.Engine.propagate`, CALM's state propagation) and by
the ONNX export's bridge graphs (:mod:`laserlm.export.graphs`).
"""

from __future__ import annotations

import sys

import torch

from ..errors import InvalidArgumentError


def _rotary_fn(attn_module):
    """The ``apply_rotary_pos_emb`` of the transformers module that defines ``attn_module``."""
    fn = getattr(sys.modules[type(attn_module).__module__], "apply_rotary_pos_emb", None)
    if fn is None:  # pragma: no cover - every supported family defines it
        raise InvalidArgumentError(f"cannot find the rotary function of {type(attn_module).__name__}")
    return fn


def project_kv(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """K/V that decoder ``layer`` would compute from ``hidden [B, T, d]`` entering it.

    Input norm -> k/v projections -> K norm (and V norm) when the layer has them -> rotary on K.
    ``cos/sin [1, T, head_dim]`` are the layer type's rotary tables at the tokens' positions.
    Returns ``(k, v)`` each ``[B, n_kv, T, head_dim]`` (what the attention module writes to the cache).
    """
    attn = layer.self_attn
    # a float16 engine's guard may hand over a float32 hidden state (laserlm.runtime.ranges); the norm's output is
    # bounded, so it is cast to the projections' dtype (a no-op otherwise)
    x = layer.input_layernorm(hidden).to(attn.k_proj.weight.dtype)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    if getattr(attn, "v_norm", None) is not None:
        v = attn.v_norm(v)
    _, k = _rotary_fn(attn)(k, k, cos, sin)
    return k, v
