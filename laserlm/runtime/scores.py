"""Scores of target tokens: the result type of every scorer (the engine's, :class:`laserlm.evaluation.Scorer`, and
onnxruntime's, :class:`laserlm.export.scoring.OnnxScorer`), so that the evaluator reads them alike.

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
