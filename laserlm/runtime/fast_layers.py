"""Low-overhead decoder layers for the Llama family (Llama/SmolLM2, Mistral, Qwen2).

A decode step on a small model is dominated by per-op Python overhead, not by arithmetic (DESIGN.md:
transformers' eager decode reaches half the memory-bandwidth floor). About a sixth of a Llama layer's
overhead is ``nn.Module.__call__`` dispatch of its 13 submodules and transformers' wrappers. This module
runs *the same tensor operations in the same order* as transformers 5.24's ``LlamaDecoderLayer`` /
``MistralDecoderLayer`` / ``Qwen2DecoderLayer`` (RMSNorm in float32, q/k/v projections, rotary
embedding with ``rotate_half``, laserlm's attention function, o-projection, residual, SwiGLU MLP,
residual) calling the layer's own parameters directly, so its output is bit-identical to calling the
layer (checked by ``tests/test_engine_parity.py::test_fast_layers_bit_identical``).

The fast path is used only for stock modules: exact class names above, ``nn.Linear`` projections, no
forward hooks or pre-hooks (module-level or global), no instance-patched ``forward``, eval mode. Anything
else falls back to calling the transformers layer. Gemma3 and Qwen3 (q/k norms) always use the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from . import attention as attn

# layer class -> how its attention module gets the sliding window it passes to the attention function
_SLIDING = {
    "LlamaDecoderLayer": lambda a: None,
    "MistralDecoderLayer": lambda a: getattr(a.config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda a: a.sliding_window,
}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def _stock(mod: nn.Module) -> bool:
    return not (mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__)


def supports_fast_path(layer: nn.Module) -> bool:
    """True when :func:`fast_layer` reproduces ``layer(...)`` exactly (see module docstring)."""
    if type(layer).__name__ not in _SLIDING:
        return False
    try:
        a, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    except AttributeError:
        return False
    if any(type(n).__name__ not in _NORMS for n in norms) or any(type(m) is not nn.Linear for m in linears):
        return False
    return all(_stock(m) for m in (layer, a, mlp, mlp.act_fn, *norms, *linears))


def hooks_active() -> bool:
    """Global module hooks (``register_module_forward_hook``) exist: use the transformers layers."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def fast_layer(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
    """``layer(hidden, cache=cache, position_embeddings=(cos, sin))`` without module dispatch.

    ``hidden [B, T, d]``; ``cos/sin [1, T, head_dim]``; ``cache`` the forward's
    :class:`~laserlm.runtime.kv_cache.CacheWindow` or ``None``.
    Must run inside an :func:`~laserlm.runtime.attention.attention_context`. Returns ``[B, T, d]``.
    """
    a, mlp = layer.self_attn, layer.mlp
    input_shape = hidden.shape[:-1]
    hidden_shape = (*input_shape, -1, a.head_dim)

    residual = hidden
    x = _rms_norm(layer.input_layernorm, hidden)
    q = F.linear(x, a.q_proj.weight, a.q_proj.bias).view(hidden_shape).transpose(1, 2)
    k = F.linear(x, a.k_proj.weight, a.k_proj.bias).view(hidden_shape).transpose(1, 2)
    v = F.linear(x, a.v_proj.weight, a.v_proj.bias).view(hidden_shape).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    if cache is not None:
        k, v = cache.update(k, v, a.layer_idx)
    out, _ = attn.laser_attention_forward(a, q, k, v, None, dropout=0.0, scaling=a.scaling,
                                          sliding_window=_SLIDING[type(layer).__name__](a))
    out = out.reshape(*input_shape, -1).contiguous()
    hidden = residual + F.linear(out, a.o_proj.weight, a.o_proj.bias)

    residual = hidden
    x = _rms_norm(layer.post_attention_layernorm, hidden)
    x = F.linear(mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
                 * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight, mlp.down_proj.bias)
    return residual + x
