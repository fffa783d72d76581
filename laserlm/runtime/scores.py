"""Scores of target tokens: the result type of every scorer (the engine's, :class:`laserlm.evaluation.Scorer`, and
the onnxruntime engine's), so that the evaluator reads them alike.

It sits in the runtime layer because the tools that score (``evaluation``, ``export``) may not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ContextLengthError


@dataclass
class SequenceScore:
    """Scores of the target tokens ``ids[start:]`` of one sequence.

    Attributes:
        token_logprobs: ``[n]`` natural-log probabilities of the target tokens.
        greedy: whether every target token is the argmax of its distribution (lm-eval ``is_greedy``).
        argmax: ``[n]`` the argmax token at each target position.
        layers: ``[n]`` decoder layers the mode ran for the positions that predicted the targets.
    """

    token_logprobs: torch.Tensor
    greedy: bool
    argmax: torch.Tensor
    layers: torch.Tensor

    @property
    def logprob(self) -> float:
        return float(self.token_logprobs.sum())


def target_scores(logits: torch.Tensor, targets: torch.Tensor, layers: torch.Tensor) -> SequenceScore:
    """``logits [n, V]`` predicting ``targets [n]`` (``layers [n]`` per position) -> a :class:`SequenceScore`
    (log-probs by a float32 logsumexp, returned as float64)."""
    logits = logits.float()
    tok = (logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)).double()
    argmax = logits.argmax(-1)
    return SequenceScore(tok, bool((argmax == targets).all()), argmax, layers.float())


def check_score_length(ids, max_seq_len: int) -> None:
    """A sequence of ``len(ids)`` tokens is scored by feeding all but its last token.

    Raises:
        ContextLengthError: that is more than ``max_seq_len`` tokens.
    """
    if len(ids) - 1 > max_seq_len:
        raise ContextLengthError(f"sequence of {len(ids)} tokens exceeds the context size {max_seq_len}")


@dataclass
class TokenLogprobs:
    """Full-depth log-probabilities of the tokens of one sequence, with the most likely alternatives.

    Attributes:
        token_logprobs: ``[T - 1]`` float64: log p(ids[i] | ids[:i]) for i = 1 .. T-1 (the first token has none).
        top_ids: ``[T - 1, n]`` int64: the ``n`` most likely tokens at each of those positions (most likely first).
        top_logprobs: ``[T - 1, n]`` float64: their log-probabilities.
    """

    token_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@torch.inference_mode()
def full_depth_logprobs(engine, ids: list[int], top_n: int = 0, chunk: int = 256) -> TokenLogprobs:
    """Score every token of ``ids`` given the tokens before it, at full depth (the model the adaptive modes are
    certified against), as :class:`laserlm.evaluation.Scorer` scores full depth: one forward of ``ids[:-1]`` without
    a cache, then the final norm + LM head and a float32 log-softmax, ``chunk`` positions at a time (so a long
    prompt never holds ``[T, vocab]`` logits at once).

    Args:
        engine: the :class:`~laserlm.runtime.engine.Engine`.
        ids: ``T >= 1`` token ids.
        top_n: alternatives per position (0: none).

    Raises:
        ContextLengthError: ``T - 1`` longer than the engine's context.
    """
    check_score_length(ids, engine.max_seq_len)
    n = len(ids) - 1
    if n <= 0:
        empty = torch.zeros(0, dtype=torch.float64)
        return TokenLogprobs(empty, torch.zeros(0, top_n, dtype=torch.long), torch.zeros(0, top_n, dtype=torch.float64))
    x = torch.tensor([ids[:-1]], dtype=torch.long)
    hidden, state = engine.begin(x, use_cache=False)
    hidden = engine.run_layers(0, engine.num_layers, hidden, state)
    targets = torch.tensor(ids[1:], dtype=torch.long)
    lps, tids, tlps = [], [], []
    for i in range(0, n, chunk):
        logits = engine.head(hidden[:, i:i + chunk])[0].float()  # [c, V]
        logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        lps.append(logp.gather(-1, targets[i:i + chunk].unsqueeze(-1)).squeeze(-1).double())
        if top_n:
            v, ix = logp.topk(top_n, dim=-1)
            tids.append(ix)
            tlps.append(v.double())
    top_ids = torch.cat(tids) if top_n else torch.zeros(n, 0, dtype=torch.long)
    top_lp = torch.cat(tlps) if top_n else torch.zeros(n, 0, dtype=torch.float64)
    return TokenLogprobs(torch.cat(lps), top_ids, top_lp)
