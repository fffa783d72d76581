"""Batched teacher-forced scoring of adaptive depth with the ``propagate`` bridge (evaluation, calibration).

:meth:`AdaptiveDepth.score <laserlm.depth.scheduler.AdaptiveDepth.score>` with ``bridge=propagate`` decodes one
token at a time, because a token's hidden states depend on the K/V that earlier tokens' *exits* left in the
cache. This module decodes ``B`` sequences side by side instead (one position per step, all rows at once),
each row making its own exit decisions with the same policy objects the scheduler calls:

- at every exit point the policy decides for all rows still running at once
  (:meth:`ExitPolicy.decide_batch <laserlm.depth.policies.ExitPolicy.decide_batch>`, the same rule as its
  per-token ``__call__``; the exit head runs once for all those rows, and only if the policy reads it);
- a row that exits is *frozen*: its hidden state stays the exit state, and every later layer still runs on
  that frozen state, so the K/V the layer writes for the row are the layer's own projections of the exit
  state, which is exactly what :class:`~laserlm.depth.bridge.PropagateBridge` writes (input norm -> K/V
  projections -> K norm -> rotary; CALM's state propagation). The layers' outputs for frozen rows are
  discarded; the row's logits come from the exit head at its exit layer.

Every row therefore costs full depth here: this is a faithful *simulation* of the per-token decisions for
scoring many positions quickly, not a fast decoding path. Results equal the one-token-at-a-time scheduler
up to float rounding of batched matmuls (tested against it). Position 0 of each sequence runs at full depth
(the scheduler's prefill), and patience must be 0 (the patience rule couples consecutive tokens of one
sequence; use the sequential scheduler for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from .bridge import PropagateBridge
from .policies import BatchPoint, transition_score


@dataclass
class BatchScore:
    """Teacher-forced results of one sequence.

    Attributes:
        logprobs: ``[n - 1]`` float64 log-probability of token ``i + 1`` given tokens ``0..i``.
        argmax: ``[n]`` greedy next token after each position.
        layers: ``[n]`` exit layer of each position (L = full depth).
    """

    logprobs: torch.Tensor
    argmax: torch.Tensor
    layers: torch.Tensor


def supports_batched_score(mode) -> bool:
    """Whether :func:`score_batch` reproduces ``mode``'s sequential scoring (propagate bridge, no patience)."""
    return (isinstance(getattr(mode, "bridge", None), PropagateBridge) and getattr(mode, "patience", 1) == 0
            and getattr(mode, "router", None) is None)


def _batch_engine(engine, batch_size: int, seq_len: int):
    """An engine sharing ``engine``'s weights with a KV cache of ``batch_size`` rows (memoised on the engine)."""
    from ..runtime.engine import Engine  # noqa: PLC0415

    memo = engine.__dict__.setdefault("_batched_engines", {})
    key = (batch_size, seq_len)
    if key not in memo:
        memo.clear()  # keep one: caches can be large
        src = engine.loaded if engine.loaded is not None else engine.adapter.model
        eb = Engine(src, max_seq_len=seq_len, batch_size=batch_size)
        eb.fast_layers = engine.fast_layers
        memo[key] = eb
    eb = memo[key]
    eb.kernel = engine.kernel
    return eb


@torch.inference_mode()
def score_batch(mode, engine, seqs: list[list[int]]) -> list[BatchScore]:
    """Score ``seqs`` (token-id lists, each of length >= 1) under ``mode`` (an
    :class:`~laserlm.depth.scheduler.AdaptiveDepth` with ``bridge=propagate``, ``patience=0``), all at once.

    Sequences are right-padded; a row's padding comes after its real tokens, so with causal attention it never
    affects them. Memory: one KV cache of ``len(seqs)`` rows x the longest sequence.

    Raises:
        InvalidArgumentError: the mode is not propagate/patience 0, or an empty sequence.
        ContextLengthError: a sequence longer than the engine's context.
    """
    if not supports_batched_score(mode):
        raise InvalidArgumentError("batched scoring needs bridge=propagate and patience=0 (and no router)")
    if not seqs or any(len(s) == 0 for s in seqs):
        raise InvalidArgumentError("batched scoring needs non-empty sequences")
    from ..errors import ContextLengthError  # noqa: PLC0415

    n_rows, t_max = len(seqs), max(len(s) for s in seqs)
    if t_max > engine.max_seq_len:
        raise ContextLengthError(f"sequence of {t_max} tokens exceeds the context size {engine.max_seq_len}")
    lens = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(n_rows, t_max, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
    eb = _batch_engine(engine, n_rows, t_max)
    eb.reset()
    L = eb.num_layers
    bounds = mode.groups.bounds
    ats_layer = mode.ats_layer
    logprobs = torch.zeros(n_rows, max(t_max - 1, 0), dtype=torch.float64)
    argmax = torch.zeros(n_rows, t_max, dtype=torch.long)
    layers = torch.full((n_rows, t_max), float(L))
    prev_probs = None
    for t in range(t_max):
        h, st = eb.begin(ids[:, t:t + 1])
        if ats_layer is not None:
            st.ctx.want_probs = frozenset({ats_layer})
        live = lens > t  # rows that still have a real token here
        frozen = torch.zeros(n_rows, dtype=torch.bool)
        h_exit = torch.zeros_like(h)
        exit_logits: dict[int, torch.Tensor] = {}  # row -> [V] logits of its exit head
        ats = None
        for g, (a, b) in enumerate(bounds):
            h_in = h
            if frozen.any():
                keep = frozen.view(-1, 1, 1)
                for layer in range(a, b):
                    h = torch.where(keep, h_exit, eb.run_layer(layer, h, st))
            else:
                h = eb.run_layers(a, b, h, st)
            if ats_layer is not None and a <= ats_layer < b:
                cur = st.ctx.probs[ats_layer][:, :, -1, :].float()  # [B, H, S]
                ats = transition_score(prev_probs, cur) if prev_probs is not None else None  # [B]
                prev_probs = cur
            if t == 0 or b == L or not mode.groups.can_exit(g):
                continue
            rows = torch.nonzero(live & ~frozen).flatten()
            if rows.numel() == 0:
                continue
            points = BatchPoint(g, b, L, h[rows, 0], h_in[rows, 0], head=mode._head(eb, b),
                                ats=ats[rows] if ats is not None else None)
            go = mode.policy.decide_batch(points)
            if go.any():
                out = rows[go]
                frozen[out] = True
                h_exit[out] = h[out]  # later layers run on this state (what the propagate bridge projects)
                layers[out, t] = float(b)
                lg = points.logits[go] if points._logits is not None else mode._head(eb, b)(h[out, 0]).float()
                for r, row_logits in zip(out.tolist(), lg):
                    exit_logits[r] = row_logits
        eb.commit(st)
        logits = eb.head(h)[:, 0].float()  # [B, V]; rows that exited get their exit head's logits
        for r, lg in exit_logits.items():
            logits[r] = lg
        argmax[:, t] = logits.argmax(-1)
        if t + 1 < t_max:
            lp = torch.log_softmax(logits, -1)
            logprobs[:, t] = lp.gather(-1, ids[:, t + 1:t + 2]).squeeze(-1).double()
    return [BatchScore(logprobs[r, :n - 1], argmax[r, :n], layers[r, :n]) for r, n in enumerate(lens.tolist())]
