"""Training of exit gates: the depth package's :class:`~laserlm.depth.heads.ExitGate` per exit point.

A gate predicts "the exit head's top-1 equals the full model's top-1" from the (RMS-normalised)
hidden state and six scalars (:func:`laserlm.depth.heads.gate_scalars_batch`: exit-head max prob, top-2
margin, normalised entropy (CALM), saturation (CALM "state"), the attention transition score (seed
004) and the relative depth). Trained with the binary focal loss (Lin et al. 2017), as seed 004 does,
because most positions are easy: the exit is either clearly right or clearly wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..depth.heads import ExitGate
from ..errors import InvalidArgumentError
from .losses import binary_focal_loss


def make_gates(hidden_size: int, exit_points: list[int], uses_ats: bool, features: str = "head") -> nn.ModuleDict:
    """One :class:`ExitGate` per exit point (keyed ``str(exit_point)``), initialised to "do not exit".

    ``features``: ``head`` or ``state`` (:data:`laserlm.depth.heads.GATE_FEATURES`)."""
    return nn.ModuleDict({str(e): ExitGate(hidden_size, None, uses_ats, features) for e in exit_points})


def gate_inputs(gate: ExitGate, scalars: torch.Tensor) -> torch.Tensor:
    """The columns of the ``[N, 6]`` head-feature scalars that ``gate`` reads (``state`` gates: the last 3,
    saturation, ATS and depth, which :func:`~laserlm.training.heads.gate_scalars_batch` puts last)."""
    return scalars if gate.features == "head" else scalars[:, -gate.num_scalars:]


@dataclass
class GateTrainConfig:
    """Gate stage: AdamW LR 1e-2, 400 steps of 512 positions, focal gamma 2 (Lin et al. 2017, seed 004).

    A linear gate on standardised-scale inputs trains quickly; 1e-2 is the usual logistic-regression
    Adam rate (our choice, not the seed's)."""

    steps: int = 400
    batch_tokens: int = 512
    lr: float = 1e-2
    weight_decay: float = 1e-3
    gamma: float = 2.0
    seed: int = 0

    def validate(self) -> GateTrainConfig:
        if self.steps < 0 or self.batch_tokens <= 0 or not self.lr > 0 or self.gamma < 0 or self.weight_decay < 0:
            raise InvalidArgumentError("gate steps must be >= 0, batch size and learning rate > 0, gamma >= 0")
        return self


def train_gate(gate: ExitGate, hidden: torch.Tensor, scalars: torch.Tensor, labels: torch.Tensor,
               cfg: GateTrainConfig, progress: bool = True, desc: str = "train gate") -> list[float]:
    """Fit ``gate`` on ``hidden [N, d]``, ``scalars [N, 6]`` (head features; a ``state`` gate reads its columns),
    ``labels [N]`` (1 = exiting keeps the token)."""
    cfg.validate()
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(gate.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n, losses = hidden.shape[0], []
    for _ in tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress, leave=False):
        idx = torch.randint(0, n, (min(cfg.batch_tokens, n),), generator=g)
        loss = binary_focal_loss(gate(hidden[idx], gate_inputs(gate, scalars[idx])), labels[idx].float(),
                                 gamma=cfg.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def gate_probabilities(gates: nn.ModuleDict, hidden: dict, scalars: dict, exit_points: list[int]) -> torch.Tensor:
    """``[E, N]`` exit probabilities of each exit point's gate (``hidden``/``scalars`` keyed by exit point)."""
    return torch.stack([torch.sigmoid(gates[str(e)](hidden[e], gate_inputs(gates[str(e)], scalars[e])))
                        for e in exit_points])


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks over ties); NaN if a class is absent."""
    labels = labels.bool()
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores.double())
    s = scores.double()[order]
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = ((ends - counts.double() + 1 + ends) / 2)[inverse]
    rank_sum_pos = ranks[labels[order]].sum()
    return float((rank_sum_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
