"""Structured output: a grammar's token mask applied in the sampler, so the text parses (JSON object, JSON schema).

The grammar engine is llguidance (Microsoft's guidance library): it compiles a JSON schema lazily and fills a
vocabulary bitmask per token. It was chosen over xgrammar, which was faster per mask but needs Triton (a GPU
compiler) on a CPU install.

A :class:`GrammarConstraint` is per-request state (the matcher's position in the grammar): each request, and each
of ``n`` choices, gets its own (:meth:`GrammarConstraint.fork`). :meth:`~laserlm.runtime.request.Request.sample`
masks the logits before temperature / top-k / top-p and feeds the chosen token back, so greedy picks the most likely
*allowed* token. Modes that accept tokens without sampling each one (speculative decoding) refuse constraints, as
they refuse penalties.
"""

from __future__ import annotations

import functools
import json

import torch

from ..errors import InvalidArgumentError


def _llguidance():
    try:
        import llguidance  # noqa: PLC0415
        import llguidance.hf  # noqa: PLC0415, F401
        import llguidance.torch  # noqa: PLC0415, F401
    except ImportError as exc:
        raise InvalidArgumentError("structured output needs llguidance: pip install 'laserlm[serve]'") from exc
    return llguidance


@functools.lru_cache(maxsize=4)
def _tokenizer_info(tokenizer, vocab_size: int):
    return _llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def json_schema_grammar(schema: dict | bool | None) -> str:
    """The llguidance grammar of a JSON schema (``None``: any JSON object, OpenAI's ``json_object``), with compact
    separators (no free whitespace, which a small model can fill forever).

    Raises:
        InvalidArgumentError: a schema that is not JSON.
    """
    if schema is None:
        schema = {"type": "object"}
    if schema is True:  # JSON Schema's "anything"
        schema = {}
    if schema is False:
        raise InvalidArgumentError("the JSON schema false matches nothing")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"the JSON schema is not JSON: {exc}") from None
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    except (ValueError, RuntimeError) as exc:  # llguidance's refusals (a recursion limit, options on a non-object)
        raise InvalidArgumentError(f"unsupported JSON schema: {exc}") from None


class GrammarConstraint:
    """Which tokens may come next under a grammar, for one request.

    Args:
        tokenizer: the model's (Hugging Face) tokenizer.
        vocab_size: rows of the LM head ``V`` (may exceed the tokenizer's vocabulary: the extra ids are never allowed).
        grammar: an llguidance grammar (:func:`json_schema_grammar`).

    Raises:
        InvalidArgumentError: a grammar llguidance refuses, naming the feature (an unsupported schema keyword, a
            dangling ``$ref`` ...).
    """

    def __init__(self, tokenizer, vocab_size: int, grammar: str):
        llg = _llguidance()
        self.tokenizer, self.vocab_size, self.grammar = tokenizer, int(vocab_size), grammar
        info = _tokenizer_info(tokenizer, self.vocab_size)
        err = llg.LLMatcher.validate_grammar(grammar, info)
        if err:
            raise InvalidArgumentError(f"unsupported JSON schema: {err}")
        self.matcher = llg.LLMatcher(info, grammar)
        self.bitmask = llg.torch.allocate_token_bitmask(1, self.vocab_size)

    def fork(self) -> GrammarConstraint:
        """A fresh constraint on the same grammar (for another request or choice)."""
        return GrammarConstraint(self.tokenizer, self.vocab_size, self.grammar)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [V]`` with every token the grammar forbids at ``-inf`` (a new float32 tensor)."""
        llg = _llguidance()
        out = logits.float().reshape(1, -1).clone()
        llg.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        llg.torch.apply_token_bitmask_inplace(out, self.bitmask)
        return out[0]

    def accept(self, token_id: int) -> None:
        """Advance the grammar by the chosen token.

        Raises:
            InvalidArgumentError: the token breaks the grammar (only when a caller bypassed :meth:`mask`).
        """
        if not self.matcher.consume_token(int(token_id)):
            raise InvalidArgumentError(f"token {token_id} does not fit the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The text so far is complete under the grammar and nothing more may follow but end of sequence."""
        return self.matcher.is_stopped()


def json_constraint(tokenizer, vocab_size: int, schema: dict | bool | None = None) -> GrammarConstraint:
    """A :class:`GrammarConstraint` for a JSON schema (``None``: any JSON object)."""
    return GrammarConstraint(tokenizer, vocab_size, json_schema_grammar(schema))
