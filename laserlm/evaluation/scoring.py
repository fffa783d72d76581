"""Log-likelihood scoring of continuations under a decoding mode (lm-evaluation-harness conventions).

Everything here goes through the decoding-mode interface (:mod:`laserlm.runtime.modes`):
``mode.score(engine, ids[T]) -> ScoreOutput(logits[T, V], layers[T])``, so every configuration that
registers a mode is scored the same way. For the full-depth mode the scorer takes a faster, exactly
equivalent path: the choices of an item are right-padded into one batch (padding after the last real
token cannot change causal attention of earlier positions) and the LM head runs only on the
positions that are scored. Adaptive depth with the ``propagate`` bridge (any patience) is scored for many
sequences at once by :func:`laserlm.depth.batched.score_batch` (per-row exit decisions, equal to the
token-by-token scheduler up to float rounding).
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, LaserLMError
from ..mode_table import config_kernel, make_mode, split_config
from ..runtime.modes import FullDepth
from ..runtime.ort_engine import OnnxEngine
from ..runtime.scores import SequenceScore, check_score_length, target_scores


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """Tokenize ``context + continuation`` like lm-eval's ``HFLM._encode_pair``, with the fallback of
    lm-eval PR #4055 where a token spans the join.

    Trailing spaces of the context move to the continuation; the whole string is encoded once and the
    continuation is what follows the context's own encoding. When the joined encoding does not start with
    the context's encoding (a token spans the join: SmolLM2 encodes ``"Answer"`` as one token, so
    ``("Ans", "wer")`` would leave the continuation no token; Gemma3 encodes ``"foobar"`` as ``fo|obar``, so
    ``("foo", "bar")`` would score ``"obar"`` given ``"fo"``), the continuation is encoded on its own
    (without special tokens) after the context's encoding. Special tokens follow the tokenizer's default
    (SmolLM2 adds none, Gemma adds ``<bos>``, as lm-eval does for Gemma), with a leading BOS written in the
    text not doubled (:func:`laserlm.runtime.generate.encode_text`).

    Returns ``(ids, start)``: the token ids and the index of the first continuation token (``start >= 1``,
    ``len(ids) > start``).

    Raises:
        LaserLMError: the continuation encodes to no tokens even on its own (e.g. an empty string).
    """
    from ..runtime.generate import encode_text  # noqa: PLC0415

    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode_text(tokenizer, context + continuation)
    ctx = encode_text(tokenizer, context)
    if whole[:len(ctx)] != ctx or len(whole) <= len(ctx):  # a token spans the join: encode the continuation alone
        whole = ctx + tokenizer(continuation, add_special_tokens=False)["input_ids"]
    start = len(ctx)
    if start == 0:  # empty context: condition on the BOS / EOS token, as lm-eval does
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        whole, start = [prefix] + whole, 1
    if start >= len(whole):
        raise LaserLMError(f"continuation {continuation!r} encodes to no tokens")
    return whole, start


class Scorer:
    """Scores token sequences with one configuration (decoding mode + attention kernel) on one engine.

    Args:
        engine: a :class:`~laserlm.runtime.engine.Engine`.
        mode: a decoding-mode object, or a configuration string ``MODE_SPEC[@ATTENTION]``.
        batch: right-pad and batch sequences for the full-depth mode (exact; False = one call each).
    """

    def __init__(self, engine, mode, batch: bool = True):
        self.engine = engine
        whole_groups = isinstance(engine, OnnxEngine)  # exported graphs: dense attention, whole layer groups
        if whole_groups and isinstance(mode, str) and split_config(mode)[1] is not None:
            raise InvalidArgumentError(f"the onnxruntime backend has dense attention only: drop "
                                       f"'@{split_config(mode)[1]}' from configuration '{mode}'")
        self.kernel = config_kernel(engine, mode) if isinstance(mode, str) and not whole_groups else engine.kernel
        self.mode = make_mode(split_config(mode)[0] if isinstance(mode, str) else mode, engine)
        self.fast = batch and isinstance(self.mode, FullDepth)
        from ..depth.batched import supports_batched_score  # noqa: PLC0415

        # the batched adaptive scorer freezes exited rows layer by layer, which whole-group graphs cannot do
        self.batched = batch and not whole_groups and supports_batched_score(self.mode)
        # sequences worth scoring per call: the full-depth path holds [B, T, V] logits, the batched adaptive
        # path only [B, V] per step
        self.batch_rows = 4 if self.fast else (32 if self.batched else 1)
        # the most sequences one forward may hold: an export's declared batch range (laserlm's engine: any)
        self.max_rows = engine.max_batch if whole_groups else None
        if whole_groups:
            self.batch_rows = min(self.batch_rows, engine.max_batch)

    def activate(self) -> None:
        """Install this configuration's attention kernel on the engine (call before generating with it)."""
        self.engine.kernel = self.kernel

    @property
    def max_seq_len(self) -> int:
        """The longest input (in tokens) that :meth:`score` feeds: the engine's context."""
        return self.engine.max_seq_len

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [T]`` -> ``(logits [T, V] float32, layers [T])`` through the mode."""
        self.activate()
        out = self.mode.score(self.engine, input_ids)
        return out.logits.float(), out.layers

    @torch.inference_mode()
    def score(self, seqs: list[list[int]], starts: list[int]) -> list[SequenceScore]:
        """Score the tokens ``seq[start:]`` of each sequence given ``seq[:start]`` (``start >= 1``).

        Raises:
            ContextLengthError: a sequence longer than the engine's context.
        """
        for s in seqs:
            check_score_length(s, self.max_seq_len)
        self.activate()
        if self.batched:
            return self._score_adaptive_batched(seqs, starts)
        if self.fast and len(seqs) > 1:
            n = self.max_rows or len(seqs)
            return [r for i in range(0, len(seqs), n) for r in self._score_batched(seqs[i:i + n], starts[i:i + n])]
        out = []
        for ids, start in zip(seqs, starts):
            if self.fast:
                out.extend(self._score_batched([ids], [start]))
                continue
            logits, layers = self.logits(torch.tensor(ids[:-1], dtype=torch.long))
            out.append(target_scores(logits[start - 1:], torch.tensor(ids[start:]), layers[start - 1:]))
        return out

    def _score_batched(self, seqs, starts) -> list[SequenceScore]:
        eng = self.engine
        lens = [len(s) - 1 for s in seqs]
        t = max(lens)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :lens[i]] = torch.tensor(s[:-1])
        first = min(starts) - 1
        hidden, state = eng.begin(ids, use_cache=False)
        hidden = eng.run_layers(0, eng.num_layers, hidden, state)
        logits = eng.head(hidden[:, first:])
        out = []
        for i, (s, start) in enumerate(zip(seqs, starts)):
            lg = logits[i, start - 1 - first:lens[i] - first]
            out.append(target_scores(lg, torch.tensor(s[start:]), torch.full((lg.shape[0],), float(eng.num_layers))))
        return out

    def _score_adaptive_batched(self, seqs, starts) -> list[SequenceScore]:
        from ..depth.batched import score_batch  # noqa: PLC0415

        out = []
        for i in range(0, len(seqs), self.batch_rows):
            part = seqs[i:i + self.batch_rows]
            # the last token is only a target (the positions run are the context at most, as the sequential path's)
            scores = score_batch(self.mode, self.engine, [s[:-1] for s in part], targets=[s[-1] for s in part])
            for s, start, r in zip(part, starts[i:i + self.batch_rows], scores):
                argmax = r.argmax[start - 1:]
                out.append(SequenceScore(r.logprobs[start - 1:], bool((argmax == torch.tensor(s[start:])).all()),
                                         argmax, r.layers[start - 1:].float()))
        return out
