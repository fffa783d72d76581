"""Quality evaluation of decoding modes: perplexity, zero-shot tasks (lm-eval conventions), agreement
with the full-depth model, and an lm-evaluation-harness adapter (:mod:`.lmeval_adapter`)."""

from .scoring import Scorer, SequenceScore, encode_pair
from .tasks import TASKS, EvalSettings, Evaluator

__all__ = ["TASKS", "EvalSettings", "Evaluator", "Scorer", "SequenceScore", "encode_pair"]
