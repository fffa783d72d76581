"""Exit heads for training: the depth package's :class:`~laserlm.depth.heads.ExitHead` per exit point.

An exit head is the base model's final norm + LM head after an identity-initialised adapter, the
tuned lens of Belrose et al. 2023 ("Eliciting Latent Predictions from Transformers with the Tuned
Lens"): ``affine`` (``h -> W h + b``, ``W = I``) or ``lowrank`` (``h -> h + U D h``, ``U = 0``). Only the
adapter's parameters are trained; the base model's norm and LM head stay frozen and shared.

The vectorised gate features (:func:`gate_scalars_batch`) reproduce
:func:`laserlm.depth.heads.gate_scalars` for many positions at once, so gates trained here see exactly
the features the adaptive scheduler computes at run time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..depth.heads import ADAPTER_KINDS, ExitHead  # noqa: F401  (re-exported)


def make_exit_heads(engine, exit_points: list[int], adapter: str = "affine", rank: int = 16) -> nn.ModuleDict:
    """One identity-initialised :class:`ExitHead` per exit point, keyed ``str(exit_point)``, in float32.

    Raises:
        InvalidArgumentError: unknown adapter kind or bad rank (from :class:`ExitHead`).
    """
    heads = nn.ModuleDict({str(e): ExitHead(engine.adapter, adapter, rank) for e in exit_points})
    return heads.float()


def confidence_scalars(logits: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` -> ``[N, 3]``: top-1 probability, top-2 margin, entropy / ln V (CALM measures)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top = p.topk(2, dim=-1).values
    ent = -(p * logp).sum(-1) / math.log(logits.shape[-1])
    return torch.stack([top[:, 0], top[:, 0] - top[:, 1], ent], dim=-1)


def gate_scalars_batch(logits: torch.Tensor, hidden: torch.Tensor, hidden_in: torch.Tensor,
                       ats: torch.Tensor | None, layer: int, num_layers: int) -> torch.Tensor:
    """Batched :func:`laserlm.depth.heads.gate_scalars`: ``[N, 6]`` float32.

    Args:
        logits: ``[N, V]`` exit-head logits.
        hidden, hidden_in: ``[N, d]`` hidden state leaving / entering the exit point's layer group.
        ats: ``[N]`` attention transition scores (``None``: absent, 0).
        layer: the exit point (layers run); ``num_layers``: L.
    """
    n = logits.shape[0]
    conf = confidence_scalars(logits)
    sat = torch.nn.functional.cosine_similarity(hidden_in.float(), hidden.float(), dim=-1)
    a = ats.float() if ats is not None else torch.zeros(n)
    pos = torch.full((n,), layer / num_layers)
    return torch.cat([conf, sat[:, None], a[:, None], pos[:, None]], dim=-1)
