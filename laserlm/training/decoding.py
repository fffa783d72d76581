"""Threshold calibration on real ``propagate`` decoding (not on exact hidden states).

With the ``propagate`` bridge a token that exits leaves projected K/V in the layers it skipped, so later tokens
see a slightly different cache and their hidden states drift from the full model's. Gates and thresholds
calibrated on exact (teacher-forced, full-depth) states then over-promise: a threshold certified for an
agreement on exact states gives less under propagate decoding. CALM (Schuster et al. 2022) therefore calibrates on the decoding it guarantees.

Here every candidate threshold of the fixed-sequence test is evaluated by decoding the calibration chunks
with that threshold through :func:`laserlm.depth.batched.score_batch` (all chunks side by side, per-row exit
decisions, the propagate bridge, the run's patience rule with each chunk's own streak), and the losses are measured against the full model's own
greedy token and NLL at the same positions.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..depth.batched import score_batch
from ..depth.policies import GatePolicy
from ..depth.adaptive import AdaptiveDepth
from .collect import ExitStates

EXIT_FRACTION_GRID = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
                      0.65, 0.8)


def grid_thresholds(gate_probs: torch.Tensor, levels=EXIT_FRACTION_GRID) -> list[float]:
    """Candidate thresholds, strict to loose: 1.0 (never exit), then for each exit-fraction level the
    threshold at which that fraction of positions would exit (first exit point with ``prob > threshold``)
    under exact states. ``gate_probs [E, N]`` must come from data other than the calibration split (the
    order of a fixed-sequence test may not depend on the calibration data)."""
    first = gate_probs.max(0).values.double()  # a position exits somewhere iff its max prob > threshold
    out = [1.0]
    for f in levels:
        lam = float(torch.quantile(first, 1.0 - f))
        if lam < out[-1]:
            out.append(lam)
    return out


def chunk_sequences(tokens: torch.Tensor, data: ExitStates, seq_len: int) -> list[list[int]]:
    """The token sequences (``seq_len + 1`` tokens each) of the chunks in ``data``, in its position order."""
    chunks = torch.unique_consecutive(data.chunk).tolist()
    return [tokens[c * seq_len:(c + 1) * seq_len + 1].tolist() for c in chunks]


class PropagateDecoding:
    """``losses_at(threshold)`` for :func:`laserlm.training.thresholds.fixed_sequence_test` by real decoding.

    Args:
        engine: the model's engine; ``groups``, ``heads`` (exit layer -> ExitHead), ``gates`` (exit layer ->
            ExitGate), ``ats_layer``: the calibrated modules.
        seqs: the calibration chunks (:func:`chunk_sequences`); ``data``: their :class:`ExitStates`
            (full-model greedy tokens: the original model's when ``data.own_top1`` holds an adapted model's own, and
            then full depth itself has a loss); ``full_nll [N]``: the full model's NLL per position.
        kind: ``agreement`` (loss = exit/decoded token differs from the full model's) or ``ppl_increase``
            (loss = NLL increase).
        batch: sequences decoded side by side.
        cache_file: optional path memoising decoded results per threshold (the pipeline's work directory), so
            that another target with the same trained modules re-decodes only thresholds not seen before.
        count: optional ``[N]`` bool, the positions whose losses are returned (and ``last_layers`` kept); the
            others still decode (they are context), e.g. the prompt positions of chat calibration text.
        policy_at: optional ``threshold -> ExitPolicy`` replacing the gate policy, e.g. the complexity predictor's
            :class:`~laserlm.depth.policies.PredictorPolicy` (then ``gates`` may be ``None``).
        patience: ``k`` of the patience rule the guarantee is about (seed 000 §2.1; 0 disables it).
        tag: part of the memo key naming what ``policy_at`` adds (e.g. the compensation veto), so that one cache
            file never mixes decodings of different policies.
    """

    def __init__(self, engine, groups, heads: dict, gates: dict | None, ats_layer, seqs, data: ExitStates,
                 full_nll: torch.Tensor, kind: str, batch: int = 32, progress: bool = True, cache_file=None,
                 count: torch.Tensor | None = None, policy_at=None, patience: int = 0, tag: str = ""):
        self.engine, self.groups, self.heads, self.gates, self.ats_layer = engine, groups, heads, gates, ats_layer
        self.policy_at = policy_at if policy_at is not None else (lambda lam: GatePolicy(self.gates, lam))
        self.seqs, self.full_top1, self.full_nll, self.kind = seqs, data.full_top1, full_nll, kind
        self.own_top1 = data.own_top1  # an adapted model's own full-depth tokens (full_top1: the original's)
        self.batch, self.progress = batch, progress
        self.last_layers = None
        self.cache_file = cache_file
        self.count = count
        self.patience = patience
        self.tag = tag
        self._cache = torch.load(cache_file) if cache_file is not None and cache_file.is_file() else {}

    def mode(self, threshold: float) -> AdaptiveDepth:
        """The adaptive mode the guarantee is about: the policy at ``threshold``, propagate, the patience rule."""
        return AdaptiveDepth(self.engine, self.groups, self.policy_at(threshold), "propagate", patience=self.patience,
                             heads=self.heads, ats_layer=self.ats_layer)

    def decode(self, threshold: float):
        """``(argmax [N], nll [N], layers [N])`` over all chunks at ``threshold`` (memoised in ``cache_file``)."""
        key = f"{float(threshold)!r}|patience={self.patience}|{self.tag}"
        if key in self._cache:
            return self._cache[key]
        mode = self.mode(threshold)
        arg, nll, lay = [], [], []
        starts = range(0, len(self.seqs), self.batch)
        for s in tqdm(starts, desc=f"propagate decoding @ {threshold:.4f}", unit="batch", leave=False,
                      disable=not self.progress):
            for r in score_batch(mode, self.engine, self.seqs[s:s + self.batch]):
                arg.append(r.argmax[:-1])
                nll.append(-r.logprobs)
                lay.append(r.layers[:-1])
        out = torch.cat(arg), torch.cat(nll), torch.cat(lay)
        if self.cache_file is not None:
            self._cache[key] = out
            torch.save(self._cache, self.cache_file)
        return out

    def __call__(self, threshold: float):
        if threshold >= 1.0:  # probabilities never exceed 1: nobody exits, decoding is full depth
            n = self.full_top1.shape[0] if self.count is None else int(self.count.sum())
            self.last_layers = torch.full((n,), float(self.groups.num_layers))
            if self.own_top1 is not None and self.kind == "agreement":  # full depth of an adapted model vs the original
                losses = (self.own_top1 != self.full_top1).double()
                return (losses if self.count is None else losses[self.count]), 0.0
            return torch.zeros(n, dtype=torch.float64), 0.0
        argmax, nll, layers = self.decode(threshold)
        if self.kind == "agreement":
            losses = (argmax != self.full_top1).double()
        else:
            losses = nll - self.full_nll.double()
        if self.count is not None:
            losses, layers = losses[self.count], layers[self.count]
        self.last_layers = layers
        return losses, float((layers < self.groups.num_layers).double().mean())
