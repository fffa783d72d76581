"""Batched teacher-forced scoring of adaptive depth with the ``propagate`` bridge (evaluation, calibration).

:meth:`AdaptiveDepth.score <laserlm.depth.adaptive.AdaptiveDepth.score>` with ``bridge=propagate`` decodes one
token at a time, because a token's hidden states depend on the K/V that earlier tokens' *exits* left in the
cache. This module decodes ``B`` sequences side by side instead (one position per step, all rows at once),
each row making its own exit decisions with the same policy objects the adaptive mode calls:

- the rows walk the layer groups together through the adaptive mode's own walk
  (:func:`~laserlm.depth.walk.walk_groups`): at every exit point the policy decides for all rows still running at
  once (the exit head runs once for all those rows, and only if the policy reads it);
- a row that exits is *frozen*: its hidden state stays the exit state, and every later layer still runs on
  that frozen state, so the K/V the layer writes for the row are the layer's own projections of the exit
  state, which is exactly what :class:`~laserlm.depth.bridge.PropagateBridge` writes (input norm -> K/V
  projections -> K norm -> rotary; CALM's state propagation). The layers' outputs for frozen rows are
  discarded; the row's logits come from the exit head at its exit layer.

Every row therefore costs full depth here: this is a faithful *simulation* of the per-token decisions for
scoring many positions quickly, not a fast decoding path. Results equal the one-token-at-a-time adaptive mode
up to float rounding of batched matmuls (tested against it). Position 0 of each sequence runs at full depth
(the adaptive mode's prefill). The patience rule (seed 000: after ``k`` consecutive tokens exit in one group, later
tokens skip the checks before it) couples consecutive tokens of one sequence, so each row keeps its own streak and
lock (:class:`~laserlm.depth.walk.PatienceState`), updated after every position as the adaptive mode updates a
request's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from .bridge import PropagateBridge
from .policies import transition_score
from .walk import PatienceState, update_patience, walk_groups


@dataclass
class BatchScore:
    """Teacher-forced results of one sequence.

    Attributes:
        logprobs: ``[n - 1]`` float64 log-probability of token ``i + 1`` given tokens ``0..i`` (``[n]`` with a
            target: the last entry is the target's log-probability after the whole sequence).
        argmax: ``[n]`` greedy next token after each position.
        layers: ``[n]`` exit layer of each position (L = full depth).
    """

    logprobs: torch.Tensor
    argmax: torch.Tensor
    layers: torch.Tensor


def run_layers_frozen(engine, a: int, b: int, h_in: torch.Tensor, exited: torch.Tensor, state) -> torch.Tensor:
    """Layers ``a .. b-1`` on ``h_in [B, 1, d]`` with the ``exited [B]`` rows frozen at ``h_in``: every layer still
    runs on a frozen row's exit state, so the K/V it writes for that row are its own projections of that state,
    i.e. the ``propagate`` bridge's K/V; the frozen rows' outputs are discarded. Returns ``[B, 1, d]``."""
    if not bool(exited.any()):
        return engine.run_layers(a, b, h_in, state)
    keep = exited.view(-1, 1, 1)
    h = h_in
    for layer in range(a, b):
        h = torch.where(keep, h_in, engine.run_layer(layer, h, state))
    return h


def supports_batched_score(mode) -> bool:
    """Whether :func:`score_batch` reproduces ``mode``'s sequential scoring (adaptive depth, the propagate bridge)."""
    return isinstance(getattr(mode, "bridge", None), PropagateBridge)


@torch.inference_mode()
def score_batch(mode, engine, seqs: list[list[int]], targets: list[int] | None = None) -> list[BatchScore]:
    """Score ``seqs`` (token-id lists, each of length >= 1) under ``mode`` (an
    :class:`~laserlm.depth.adaptive.AdaptiveDepth` with ``bridge=propagate``, any patience), all at
    once.

    Sequences are right-padded; a row's padding comes after its real tokens, so with causal attention it never
    affects them. Memory: one KV cache of ``len(seqs)`` rows x the longest sequence. ``targets``: optional, the
    token that follows each sequence, scored after its last position (so a sequence of context + 1 tokens is scored
    as its first ``context`` tokens plus a target, without running a position past the context).

    With a complexity predictor in the policy (seed 000 §2.1), each row keeps its own predictor state, as the
    adaptive mode keeps it per request: the embeddings of its last ``context`` tokens, the ATS its previous token got
    and that token's exit depth; the prediction is made before the token's first layer.

    Raises:
        InvalidArgumentError: the mode's bridge is not propagate, or an empty sequence.
        ContextLengthError: a sequence longer than the engine's context.
    """
    if not supports_batched_score(mode):
        raise InvalidArgumentError("batched scoring needs adaptive depth with bridge=propagate")
    if not seqs or any(len(s) == 0 for s in seqs):
        raise InvalidArgumentError("batched scoring needs non-empty sequences")
    from ..errors import ContextLengthError  # noqa: PLC0415

    n_rows, t_max = len(seqs), max(len(s) for s in seqs)
    if t_max > engine.max_seq_len:
        raise ContextLengthError(f"sequence of {t_max} tokens exceeds the context size {engine.max_seq_len}")
    if targets is not None and len(targets) != n_rows:
        raise InvalidArgumentError(f"{len(targets)} targets for {n_rows} sequences")
    lens = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(n_rows, t_max + 1, dtype=torch.long)  # one column more: the targets
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
        if targets is not None:
            ids[r, len(s)] = int(targets[r])
    cache = engine.new_cache(t_max, batch_size=n_rows)
    L = engine.num_layers
    ats_layer = mode.ats_layer
    logprobs = torch.zeros(n_rows, t_max, dtype=torch.float64)
    argmax = torch.zeros(n_rows, t_max, dtype=torch.long)
    layers = torch.full((n_rows, t_max), float(L))
    prev = [None]  # the previous position's ATS-layer attention probs [B, H, S]
    patience = [PatienceState() for _ in range(n_rows)]  # per row, as the adaptive mode keeps it per request
    pred = getattr(mode, "predictor", None)
    if pred is not None:  # per-row predictor state (DepthState.recent / last_ats / prev_exit of the adaptive mode)
        from .predictor import predictor_scalars, window_embeddings, window_ids  # noqa: PLC0415

        windows = torch.stack([window_ids(ids[r], pred.context) for r in range(n_rows)])  # [B, T, k + 1]
        last_ats = [torch.full((n_rows,), float("nan"))]
        prev_exit = torch.ones(n_rows)
    for t in range(t_max):
        predicted = None
        if pred is not None:  # before any layer of this position runs
            scal = predictor_scalars(last_ats[0], prev_exit, pred.uses_ats)
            predicted = torch.sigmoid(pred(window_embeddings(engine.adapter.embed, windows[:, t]), scal))
        h0, st = engine.begin(ids[:, t:t + 1], cache=cache)
        if ats_layer is not None:
            st.ctx.want_probs = frozenset({ats_layer})
        run = {"h": h0}

        def run_group(g, a, b, exited):
            h_in = run["h"]  # for an exited row: its exit state (frozen by run_layers_frozen)
            h = run["h"] = run_layers_frozen(engine, a, b, h_in, exited, st)
            ats = None
            if ats_layer is not None and a <= ats_layer < b:
                cur = st.ctx.probs[ats_layer][:, :, -1, :].float()  # [B, H, S]
                ats = transition_score(prev[0], cur) if prev[0] is not None else torch.full((n_rows,), float("nan"))
                prev[0] = cur
                if pred is not None:
                    last_ats[0] = ats.float()
            return h_in[:, 0], h[:, 0], ats

        live = (lens > t) & (t > 0)
        locked = torch.tensor([-1 if p.locked is None else p.locked for p in patience])
        res = walk_groups(mode.groups, mode.policy, lambda b: mode.head_at(engine, b), engine.head, n_rows, run_group,
                          locked=locked, live=live, finish=True, predicted=predicted)
        engine.commit(st)
        if mode.patience:
            for r in torch.nonzero(live).flatten().tolist():
                patience[r] = update_patience(patience[r], mode.patience,
                                              int(res.exit_group[r]) if bool(res.exited[r]) else None,
                                              bool(res.lock_failed[r]))
        if pred is not None:
            prev_exit = res.exit_layer.float() / L
        logits = res.logits  # [B, V]; rows that exited have their exit head's logits
        layers[:, t] = res.exit_layer.float()
        argmax[:, t] = logits.argmax(-1)
        if t + 1 < t_max or targets is not None:
            lp = torch.log_softmax(logits, -1)
            logprobs[:, t] = lp.gather(-1, ids[:, t + 1:t + 2]).squeeze(-1).double()
    scored = 0 if targets is not None else 1  # positions at the end without a next token
    return [BatchScore(logprobs[r, :n - scored], argmax[r, :n], layers[r, :n]) for r, n in enumerate(lens.tolist())]
