"""The Residual Bridge's compensation threshold, chosen for the gates it vetoes (seed 000 §2.1).

Seed 000 §2.1: when the feature difference across skipped computation exceeds a threshold, compensating computation
of the adjacent layers is triggered. In laserlm that is :class:`~laserlm.depth.policies.Compensation`, a veto on an
exit: a token may leave after a layer group only if the relative change of its residual stream across that group,
``||h_out - h_in|| / ||h_in||``, is ``<= c``; otherwise the next group runs first (and the exit is asked again
there). A large change means the group is still rewriting the token's representation, which is when an exit (and
the K/V the ``propagate`` bridge projects from the exit state for the skipped layers) is least safe.

The threshold ``c`` is chosen here on the *gate* split, which the certificate does not use (so the choice cannot bias
it): for every candidate ``c`` (quantiles of the change over the split's exit points, and "off"), the loosest gate
threshold whose empirical loss on the split meets the target is found, and the ``c`` with the fewest layers per
token at that point wins ("off" on ties: a veto must earn its place). The loss is measured on the decoding the
certificate is about: the calibration pipeline decodes the gate split with the ``propagate`` bridge for every pair
it tries (exact states would miss what the bridge's projected K/V do to later tokens, which on SmolLM2 is most of the
loss), and replays exact states for ``deferred`` (:func:`exact_state_measure`). The gate threshold is then certified
on the calibration split with the chosen veto in the policy (:mod:`laserlm.training.decoding`), exactly as without
it.
"""

from __future__ import annotations

import math

import torch

from .decoding import grid_thresholds
from .thresholds import exit_decisions

QUANTILE_LEVELS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)


def relative_change(states, exits: list[int]) -> torch.Tensor:
    """``[E, N]`` float64: the relative change ``||h_e - h_s|| / ||h_s||`` of the residual stream across the layer
    group that ends at each exit point ``e`` (``h_s``: the group's input, ``states.group_start``) for every position
    of ``states`` (:class:`~laserlm.training.collect.ExitStates`): the quantity the compensation veto reads."""
    rows = []
    for e in exits:
        a, b = states.hidden[states.group_start[e]].double(), states.hidden[e].double()
        rows.append((b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12))
    return torch.stack(rows)


def vetoed(gate_probs: torch.Tensor, change: torch.Tensor, c: float) -> torch.Tensor:
    """``gate_probs [E, N]`` with the exits the veto forbids (``change > c``) set to 0, so that
    :func:`~laserlm.training.thresholds.exit_decisions` at any threshold ``>= 0`` never takes them."""
    return torch.where(change <= c, gate_probs, torch.zeros_like(gate_probs))


def compensation_candidates(change: torch.Tensor) -> list[float]:
    """The candidate thresholds, loosest first: ``inf`` (off), then quantiles :data:`QUANTILE_LEVELS` of
    ``change [E, N]`` (the relative change at every exit point and position of a split), descending."""
    flat = change.flatten().double()
    return [math.inf] + sorted({float(torch.quantile(flat, q)) for q in QUANTILE_LEVELS}, reverse=True)


def choose_compensation(candidates: list[float], grid, measure, alpha: float, num_layers: int) -> dict:
    """Pick the compensation threshold on a split the certificate does not use.

    For every candidate ``c`` the gate thresholds of ``grid(c)`` (strict to loose, ``1.0`` = never exit first) are
    walked in order, as the fixed-sequence test walks them, while ``measure(c, thr)`` (``(mean loss, mean layers)``
    on the split with the veto at ``c`` and the gates at ``thr``) stays ``<= alpha``; the candidate whose last
    passing threshold runs the fewest layers per token wins, "off" on ties.

    Args:
        candidates: :func:`compensation_candidates` (``inf`` = off).
        grid: ``c -> [thresholds]``.
        measure: ``(c, thr) -> (mean loss, mean layers)``: on exact states (:func:`exact_state_measure`) or by
            decoding the split with the bridge the certificate is about (the calibration pipeline).
        alpha: the target's allowed mean loss (``1 - target agreement``, or ``log1p(max perplexity increase)``).

    Returns:
        ``{"threshold": c or None (off), "candidates": [{"threshold", "gate_threshold", "mean_layers"}, ...]}``.
    """
    rows = []
    for c in candidates:
        best_thr, best_layers = 1.0, float(num_layers)
        for thr in grid(c)[1:]:
            loss, layers = measure(c, thr)
            if loss > alpha:
                break
            best_thr, best_layers = thr, layers
        rows.append({"threshold": c if math.isfinite(c) else None, "gate_threshold": best_thr,
                     "mean_layers": round(best_layers, 4)})
    best = min(rows, key=lambda r: (r["mean_layers"], r["threshold"] is not None))  # "off" wins ties
    return {"threshold": best["threshold"], "candidates": rows}


def exact_state_measure(gate_probs: torch.Tensor, change: torch.Tensor, losses: torch.Tensor, exits: list[int],
                        num_layers: int):
    """``(grid, measure)`` for :func:`choose_compensation` on exact (teacher-forced, full-depth) states: the first
    exit point where the vetoed gate probability ``> thr`` is taken.

    Args:
        gate_probs, change, losses: ``[E, N]``: the gates' probabilities, :func:`relative_change`, and the loss of
            exiting at each exit point.
    """
    depth = torch.tensor(list(exits) + [num_layers], dtype=torch.float64)
    n = gate_probs.shape[1]

    def probs(c):
        return vetoed(gate_probs, change, c) if math.isfinite(c) else gate_probs

    def measure(c, thr):
        dec = exit_decisions(probs(c), thr)
        loss = torch.where(dec < len(exits), losses[dec.clamp_max(len(exits) - 1), torch.arange(n)].double(),
                           torch.zeros(n, dtype=torch.float64))
        return float(loss.mean()), float(depth[dec].mean())

    return (lambda c: grid_thresholds(probs(c))), measure
