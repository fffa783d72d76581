"""Per-architecture adapters: the pieces of a transformers causal LM the engine drives itself.

An adapter exposes the embedding, the decoder layers, the final norm, the LM head, the rotary
embeddings and the attention layout (layer types, sliding window) so that the engine can run the
decoder layers one by one. The transformers decoder layers are called unchanged; attention goes
through laserlm's attention function (see :mod:`laserlm.runtime.attention`).

Families:
- ``llama`` (SmolLM2, Llama), ``mistral``, ``qwen2``, ``qwen3``: pre-norm blocks, one rotary table
  shared by all layers; Mistral/Qwen may use a sliding window (passed to attention per layer).
- ``gemma3_text``: embedding scaled by sqrt(hidden) (inside its embedding module), sliding-window
  ("local") and global layers with separate rotary tables, optional final logit soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedArchitectureError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GEMMA3 = ("gemma3_text",)


@dataclass
class ModelAdapter:
    """Uniform view of a supported causal LM.

    Attributes:
        family: ``"llama"`` for Llama-like models, ``"gemma3"`` for Gemma3 text.
        model: the ``*ForCausalLM`` module.
        embed_tokens: token embedding module, ``[B, T] -> [B, T, d]`` (Gemma3's applies its scale).
        layers: the decoder layers, in order.
        norm: final RMSNorm.
        lm_head: ``[.., d] -> [.., vocab]`` linear layer (often tied to the embedding).
        rotary_emb: the model's rotary embedding module.
        layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer.
        final_logit_softcapping: Gemma's ``tanh`` soft cap of the logits, or ``None``.
    """

    family: str
    model: nn.Module
    embed_tokens: nn.Module
    layers: list
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module
    layer_types: list[str]
    final_logit_softcapping: float | None

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]`` (int64) -> hidden states ``[B, T, d]``."""
        return self.embed_tokens(input_ids)

    def rope(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Rotary ``(cos, sin)``, each ``[1, T, head_dim]``, keyed by layer type."""
        if self.family == "gemma3":
            return {t: self.rotary_emb(hidden, position_ids, t) for t in set(self.layer_types)}
        cos_sin = self.rotary_emb(hidden, position_ids)
        return {t: cos_sin for t in set(self.layer_types)}

    def logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """Final norm (unless ``normed``) + LM head (+ soft cap): ``[.., d] -> [.., vocab]``."""
        if not normed:
            hidden = self.norm(hidden)
        out = self.lm_head(hidden)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            out = torch.tanh(out / cap) * cap
        return out


def get_adapter(model: nn.Module) -> ModelAdapter:
    """Build the adapter of a loaded transformers causal LM.

    Raises:
        UnsupportedArchitectureError: for any ``model_type`` outside Llama, Mistral, Qwen2, Qwen3 and
            Gemma3 text.
    """
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in LLAMA_LIKE + GEMMA3:
        raise UnsupportedArchitectureError(
            f"architecture '{model_type}' is not supported; supported: Llama-family "
            f"({', '.join(LLAMA_LIKE)}) and Gemma3 text (gemma3_text)"
        )
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitectureError(f"{model_type} with attention logit soft-capping is not supported")
    base = model.model
    n = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    return ModelAdapter(
        family="gemma3" if model_type in GEMMA3 else "llama",
        model=model,
        embed_tokens=base.embed_tokens,
        layers=list(base.layers[:n]),
        norm=base.norm,
        lm_head=model.lm_head,
        rotary_emb=base.rotary_emb,
        layer_types=layer_types,
        final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
    )
