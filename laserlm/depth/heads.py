"""Exit heads and exit gates (stored in the laser file, :mod:`laserlm.depth.laser_file`).

- :class:`ExitHead`: the base model's final norm + LM head applied at an exit point, optionally after a
  small trainable adapter initialised to the identity (an affine or low-rank "tuned lens", Belrose et al.
  2023; the seed trains such heads on a frozen backbone). Without an adapter it is the untrained "logit
  lens" head.
- :class:`ExitGate`: a tiny classifier predicting "stopping here keeps the full model's token" from the
  normalised hidden state and a few scalars (:func:`gate_scalars_batch`); the seed (004) trains it with focal loss.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import InvalidArgumentError

ADAPTER_KINDS = ("none", "affine", "lowrank")
NUM_GATE_SCALARS = 6  # see gate_scalars_batch
# Gate feature sets: "head" reads the exit head's distribution (one LM-head evaluation per check: on SmolLM2-135M
# that costs about as much as 8 decoder layers); "state" uses only the hidden state, saturation, ATS and depth,
# so a check is one d-vector dot product and the exit head runs only for tokens that exit.
GATE_FEATURES = {"head": 6, "state": 3}


class ExitHead(nn.Module):
    """Exit head = [adapter] + the base model's final norm + LM head (+ Gemma soft cap).

    Args:
        model_adapter: the engine's :class:`~laserlm.models.adapters.ModelAdapter` (norm and LM head are shared
            with the base model and are not part of this module's parameters).
        adapter: ``"none"``, ``"affine"`` (``h -> W h + b``, W = I, b = 0 at init) or ``"lowrank"``
            (``h -> h + U (D h)``, U = 0 at init, rank ``rank``).

    ``forward(hidden [.., d]) -> logits [.., V]`` float32. At initialisation every adapter is the identity,
    so the head equals the base model's head exactly.

    Raises:
        InvalidArgumentError: unknown adapter kind or bad rank.
    """

    def __init__(self, model_adapter, adapter: str = "none", rank: int = 16):
        super().__init__()
        if adapter not in ADAPTER_KINDS:
            raise InvalidArgumentError(f"unknown exit-head adapter '{adapter}'; use one of {', '.join(ADAPTER_KINDS)}")
        object.__setattr__(self, "_base", model_adapter)  # not a submodule: its weights belong to the model
        d = model_adapter.config.hidden_size
        dtype = next(model_adapter.model.parameters()).dtype
        self.kind = adapter
        self.rank = rank
        if adapter == "affine":
            self.proj = nn.Linear(d, d, bias=True, dtype=dtype)
            with torch.no_grad():
                self.proj.weight.copy_(torch.eye(d, dtype=dtype))
                self.proj.bias.zero_()
        elif adapter == "lowrank":
            if not isinstance(rank, int) or not 1 <= rank <= d:
                raise InvalidArgumentError(f"low-rank adapter rank must be in 1-{d}, got {rank!r}")
            self.down = nn.Linear(d, rank, bias=False, dtype=dtype)
            self.up = nn.Linear(rank, d, bias=False, dtype=dtype)
            with torch.no_grad():
                nn.init.normal_(self.down.weight, std=d ** -0.5)
                self.up.weight.zero_()

    def adapt(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the adapter only: ``[.., d] -> [.., d]``. A hidden state in another dtype than the adapter's (a
        float16 engine's float32 residual stream, :mod:`laserlm.runtime.ranges`) is adapted in float32."""
        if self.kind != "none" and hidden.dtype != next(self.parameters()).dtype:
            return self._adapt_fp32(hidden.float())
        if self.kind == "affine":
            return self.proj(hidden)
        if self.kind == "lowrank":
            return hidden + self.up(self.down(hidden))
        return hidden

    def _adapt_fp32(self, h: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        if self.kind == "affine":
            return f.linear(h, self.proj.weight.float(), self.proj.bias.float())
        return h + f.linear(f.linear(h, self.down.weight.float()), self.up.weight.float())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._base.logits(self.adapt(hidden)).float()

    def config_dict(self) -> dict:
        return {"adapter": self.kind, "rank": self.rank}


def confidence_scalars(logits: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` -> ``[N, 3]``: top-1 probability, top-2 margin, entropy / ln V (CALM measures)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top = p.topk(2, dim=-1).values
    ent = -(p * logp).sum(-1) / math.log(logits.shape[-1])
    return torch.stack([top[:, 0], top[:, 0] - top[:, 1], ent], dim=-1)


def gate_scalars_batch(logits: torch.Tensor | None, hidden: torch.Tensor, hidden_in: torch.Tensor,
                       ats: torch.Tensor | None, layer: int, num_layers: int, features: str = "head") -> torch.Tensor:
    """Scalar features of ``N`` tokens at an exit point for exit gates, float32: ``head`` ``[N, 6]``: top-1
    probability, top-2 margin, entropy / ln V, saturation, ATS (0 when absent), layer / L; ``state`` ``[N, 3]``:
    saturation, ATS, layer / L (no exit-head evaluation).

    Args:
        logits: ``[N, V]`` exit-head logits (unused, may be ``None``, for ``state`` features).
        hidden, hidden_in: ``[N, d]`` hidden state leaving / entering the exit point's layer group.
        ats: ``[N]`` attention transition scores (``None``: absent, 0).
        layer: the exit point (layers run); ``num_layers``: L.
        features: ``head`` or ``state`` (see :data:`GATE_FEATURES`).
    """
    n = hidden.shape[0]
    sat = torch.nn.functional.cosine_similarity(hidden_in.float(), hidden.float(), dim=-1)
    a = torch.nan_to_num(ats.float(), nan=0.0) if ats is not None else torch.zeros(n)  # NaN: no previous token
    pos = torch.full((n,), layer / num_layers)
    state = torch.stack([sat, a, pos], dim=-1)
    if features == "state":
        return state
    return torch.cat([confidence_scalars(logits), state], dim=-1)


class ExitGate(nn.Module):
    """Linear exit gate: ``logit = w . [rmsnorm(h), scalars] + b``; ``sigmoid(logit)`` = P(exit keeps the token).

    Args:
        hidden_size: d.
        num_scalars: length of :func:`gate_scalars_batch` for ``features`` (6 for ``head``, 3 for ``state``).
        uses_ats: whether the gate was trained with the ATS feature (the adaptive mode then measures it).
        features: ``"head"`` (exit-head confidence features; every check evaluates the exit head) or ``"state"``
            (hidden-state features only; cheap checks). See :data:`GATE_FEATURES`.

    ``forward(hidden [N, d], scalars [N, S]) -> logits [N]`` float32 (train with focal loss on these).
    """

    def __init__(self, hidden_size: int, num_scalars: int | None = None, uses_ats: bool = False,
                 features: str = "head"):
        super().__init__()
        if features not in GATE_FEATURES:
            raise InvalidArgumentError(f"unknown gate features '{features}'; use one of {', '.join(GATE_FEATURES)}")
        self.hidden_size = hidden_size
        self.num_scalars = GATE_FEATURES[features] if num_scalars is None else num_scalars
        self.uses_ats = uses_ats
        self.features = features
        self.linear = nn.Linear(hidden_size + self.num_scalars, 1)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.fill_(-4.0)  # starts as "do not exit"

    def forward(self, hidden: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.linear(torch.cat([h, scalars.float()], dim=-1)).squeeze(-1)

    def config_dict(self) -> dict:
        return {"kind": "linear", "num_scalars": self.num_scalars, "uses_ats": self.uses_ats,
                "features": self.features}
