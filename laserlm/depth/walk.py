"""The walk over layer groups: the one exit rule that every adaptive-depth path runs.

A *walk* takes ``n`` rows (tokens) through the layer groups. After each group it asks the policy, for all
rows still running at once, whether they may stop (:meth:`ExitPolicy.decide_batch
<laserlm.depth.policies.ExitPolicy.decide_batch>`), applying the schedule rules of the seed's Laser layer
scheduler on the way:

- **min depth**: only groups at or above it are exit points (:meth:`LayerGroups.can_exit`);
- **patience lock**: a row locked at group ``g`` skips the checks before ``g`` and is checked only there; if it
  fails there it runs to full depth without further checks (``WalkResult.lock_failed``).

How the layers run is the caller's: a callback ``run_group(g, a, b, exited) -> (hidden_in, hidden, ats)`` runs
(or looks up) decoder layers ``a .. b-1`` for the rows. Decoding calls the walk with one row per token
(:mod:`laserlm.depth.adaptive`, a single token is a batch of one), replayed scoring with one row per position
over precomputed states, and batched scoring (:mod:`laserlm.depth.batched`) with one row per sequence. The
patience streak across tokens is :func:`update_patience`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .policies import BatchPoint

# run_group(g, a, b, exited [n] bool) -> (hidden_in [n, d], hidden [n, d], ats [n] or None)
RunGroup = Callable[[int, int, int, torch.Tensor], tuple]


@dataclass
class WalkResult:
    """Per row: ``exit_group`` / ``exit_layer`` ``[n]`` long (the last group / L at full depth), ``exited``
    ``[n]`` bool (stopped before full depth), ``logits [n, V]`` float32 (the exit head's, or the final head's),
    ``head_evals [n]`` exit-head evaluations, ``lock_failed [n]`` bool (the patience lock's check failed)."""

    exit_group: torch.Tensor
    exit_layer: torch.Tensor
    exited: torch.Tensor
    logits: torch.Tensor
    head_evals: torch.Tensor
    lock_failed: torch.Tensor


def walk_groups(groups, policy, head_at: Callable[[int], Callable], final_head: Callable, n: int,
                run_group: RunGroup, *, locked: torch.Tensor | None = None,
                live: torch.Tensor | None = None, finish: bool = False,
                predicted: torch.Tensor | None = None) -> WalkResult:
    """Walk ``n`` rows through ``groups`` (:class:`~laserlm.depth.groups.LayerGroups`) under ``policy``.

    Args:
        head_at: ``layer -> fn(hidden [m, d]) -> logits [m, V]``, the exit head at an exit point.
        final_head: the head after the last layer (rows that never exit).
        run_group: see the module docstring; called for every group in order until every row has exited
            (to the last group when ``finish``: batched scoring keeps running layers on exited rows).
        locked: ``[n]`` long, the patience lock's group per row (-1: none).
        live: ``[n]`` bool, rows that may exit at all (default: all).
        predicted: ``[n, E]`` the complexity predictor's exit probabilities (computed before the first layer),
            handed to the policy at every exit point (:attr:`BatchPoint.predicted`).
    """
    if n == 1 and not finish:
        return _walk_one(groups, policy, head_at, final_head, run_group, locked, live, predicted)
    bounds = groups.bounds
    L = groups.num_layers
    locked = torch.full((n,), -1, dtype=torch.long) if locked is None else locked
    live = torch.ones(n, dtype=torch.bool) if live is None else live
    exit_group = torch.full((n,), -1, dtype=torch.long)
    checks_on = torch.ones(n, dtype=torch.bool)
    lock_failed = torch.zeros(n, dtype=torch.bool)
    head_evals = torch.zeros(n, dtype=torch.long)
    logits = None
    ats = None
    h = None
    for g, (a, b) in enumerate(bounds):
        exited = exit_group >= 0
        if not finish and bool(exited.all()):
            break
        h_in, h, ats_g = run_group(g, a, b, exited)
        ats = ats_g if ats_g is not None else ats
        if b == L:
            break
        running = live & ~exited
        eligible = running & checks_on & (locked <= g) if groups.can_exit(g) else torch.zeros_like(running)
        point = BatchPoint(g, b, L, h, h_in, head_at(b), ats, head_evals=head_evals, predicted=predicted)
        go = torch.zeros(n, dtype=torch.bool)
        rows = torch.nonzero(eligible).flatten()
        if rows.numel():
            sub = point if rows.numel() == n else point.select(rows)
            go[rows] = policy.decide_batch(sub)
            if sub is not point and sub._logits is not None:
                point._logits = torch.zeros(n, sub._logits.shape[-1])
                point._logits[rows] = sub._logits
        fail = eligible & ~go & (locked == g)  # the patience lock fails: full depth, checks resume next token
        checks_on &= ~fail
        lock_failed |= fail
        if bool(go.any()):
            idx = torch.nonzero(go).flatten()
            if point._logits is not None:
                lg = point._logits[idx]
            else:
                lg = point.head(h[idx]).float()
                head_evals[idx] += 1
            if logits is None:
                logits = torch.empty(n, lg.shape[-1])
            logits[idx] = lg
            exit_group[idx] = g
    exited = exit_group >= 0
    rest = torch.nonzero(~exited).flatten()
    if rest.numel():
        lg = final_head(h[rest]).float()
        if logits is None:
            logits = torch.empty(n, lg.shape[-1])
        logits[rest] = lg
    exit_layer = torch.tensor([bounds[int(e)][1] if e >= 0 else L for e in exit_group], dtype=torch.long)
    exit_group = torch.where(exited, exit_group, torch.full_like(exit_group, len(bounds) - 1))
    return WalkResult(exit_group, exit_layer, exited, logits, head_evals, lock_failed)


_NOT_EXITED = torch.zeros(1, dtype=torch.bool)


def _walk_one(groups, policy, head_at, final_head, run_group, locked, live, predicted) -> WalkResult:
    """:func:`walk_groups` for one row (a decoding step), with the bookkeeping in Python scalars: the same rules and
    the same calls to ``run_group``, the policy and the heads, without the dozen one-element tensor operations per
    group that cost about 0.1 ms each group on the fast decode path."""
    bounds, L = groups.bounds, groups.num_layers
    lock = -1 if locked is None else int(locked[0])
    may_exit = True if live is None else bool(live[0])
    head_evals = torch.zeros(1, dtype=torch.long)
    exit_group, checks_on, lock_failed = -1, True, False
    logits, ats, h = None, None, None
    for g, (a, b) in enumerate(bounds):
        h_in, h, ats_g = run_group(g, a, b, _NOT_EXITED)
        ats = ats_g if ats_g is not None else ats
        if b == L:
            break
        eligible = may_exit and checks_on and lock <= g and groups.can_exit(g)
        point = BatchPoint(g, b, L, h, h_in, head_at(b), ats, head_evals=head_evals, predicted=predicted)
        go = bool(policy.decide_batch(point)[0]) if eligible else False
        if eligible and not go and lock == g:  # the patience lock fails: full depth, checks resume next token
            checks_on, lock_failed = False, True
        if go:
            if point._logits is not None:
                logits = point._logits
            else:
                logits = point.head(h).float()
                head_evals += 1
            exit_group = g
            break
    if exit_group < 0:
        logits = final_head(h).float()
    exited = exit_group >= 0
    return WalkResult(torch.tensor([exit_group if exited else len(bounds) - 1]),
                      torch.tensor([bounds[exit_group][1] if exited else L]), torch.tensor([exited]), logits,
                      head_evals, torch.tensor([lock_failed]))


@dataclass
class PatienceState:
    """Streak of consecutive tokens exiting at ``group``; ``locked`` is the group being skipped to."""

    group: int | None = None
    streak: int = 0
    locked: int | None = None


def update_patience(state: PatienceState, patience: int, exit_group: int | None, lock_failed: bool) -> PatienceState:
    """The seed's patience rule after one token (``exit_group`` ``None`` = full depth): after ``patience``
    consecutive tokens exit at the same group, later tokens are locked to it; a failed lock check resets the
    streak. Returns the new state."""
    locked = state.locked
    if lock_failed:
        return PatienceState()
    if exit_group is None:
        return PatienceState() if locked is None else state
    if locked is None:
        if state.group == exit_group:
            state.streak += 1
        else:
            state.group, state.streak = exit_group, 1
        if patience and state.streak >= patience:
            state.locked = exit_group
    return state
