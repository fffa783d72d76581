"""A request: everything one generation carries (vLLM's ``Request``; gpt-fast's explicit positions).

Tokens, its own KV cache (so positions are the request's, never an engine cursor), sampling parameters and
RNG, the decoding mode's per-request state (patience streak, pending deferred token, draft statistics ...),
the length limit and the per-token details. Modes are stateless configs: everything that changes while a
request runs lives here, so two requests with different modes can be stepped in turn on one engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..errors import ContextLengthError, InvalidArgumentError
from .kv_cache import KVCache
from .sampling import SamplingParams, apply_penalties, make_generator, sample

_ids = itertools.count()


@dataclass
class Request:
    """One generation.

    Attributes:
        prompt_ids: ``[T]`` int64 prompt tokens.
        params: validated sampling parameters.
        max_tokens: tokens to generate at most (already limited by the context).
        cache: the request's KV cache (positions ``0 .. cache.length-1`` are computed).
        generator: the sampling RNG (``None`` for greedy decoding).
        output_ids: generated tokens so far.
        state: the decoding mode's per-request state (``mode.new_state``).
        infos: the per-token ``info`` dicts the mode reported (for its ``summary``).
        request_id: a process-unique id.
        prefilled: prompt positions already in ``cache`` before the mode's ``prefill`` runs (a shared prefix,
            earlier prefill chunks; :mod:`laserlm.runtime.scheduler`); the mode computes the rest.
        started: the mode has given the request its state (:func:`laserlm.runtime.runner.start`).
    """

    prompt_ids: torch.Tensor
    params: SamplingParams
    max_tokens: int
    cache: KVCache
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    state: object = None
    infos: list[dict] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    prefilled: int = 0
    started: bool = False

    @property
    def last_token(self) -> int:
        """The newest generated token (the next one fed to the model)."""
        return self.output_ids[-1]

    @property
    def remaining(self) -> int:
        """Tokens still allowed."""
        return self.max_tokens - len(self.output_ids)

    def sample(self, logits: torch.Tensor) -> int:
        """A token from ``logits [V]`` under this request's sampling parameters, penalties, grammar constraint and
        RNG (penalties first, then the grammar's mask, then temperature / top-k / top-p)."""
        if self.params.penalized:
            logits = apply_penalties(logits.reshape(-1), self.params, self.prompt_ids, self.output_ids)
        constraint = self.params.constraint
        if constraint is not None:
            logits = constraint.mask(logits.reshape(-1))
        tok = int(sample(logits.reshape(1, -1), self.params, self.generator)[0])
        if constraint is not None:
            constraint.accept(tok)
        return tok


def check_prompt_ids(prompt_ids, vocab_size: int, max_seq_len: int) -> torch.Tensor:
    """The one check of a tokenized prompt, shared by ``generate``, the scheduler and the server: ``[T]`` int64.

    Args:
        prompt_ids: ``[T]`` or ``[1, T]`` integer token ids (tensor or list).
        vocab_size: the model's vocabulary (0: unknown, not checked).
        max_seq_len: the context size; the prompt must leave at least one position to generate.

    Raises:
        InvalidArgumentError: more than one prompt, non-integer ids, an empty prompt, ids outside the vocabulary.
        ContextLengthError: the prompt leaves no position to generate.
    """
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() > 1 and not (ids.dim() == 2 and ids.shape[0] == 1):
        raise InvalidArgumentError(f"one prompt per request: token ids of shape [T] expected, got {list(ids.shape)}")
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
        raise InvalidArgumentError(f"token ids must be integers, got {ids.dtype}")
    ids = ids.to(torch.long).reshape(-1)
    if ids.numel() == 0:
        raise InvalidArgumentError("empty prompt: at least one token is required")
    if vocab_size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidArgumentError(f"token ids must lie in [0, {vocab_size}) for this model's vocabulary, got "
                                   f"{int(ids.min())} .. {int(ids.max())}")
    if ids.numel() >= max_seq_len:
        raise ContextLengthError(f"prompt has {ids.numel()} tokens but the context size is {max_seq_len} (and at "
                                 "least one position is needed to generate); shorten the prompt or raise the context "
                                 "size (--ctx-size; an ONNX export's is set by `laserlm export onnx --max-len`)")
    return ids


def new_request(engine, prompt_ids: torch.Tensor, params: SamplingParams, max_tokens: int) -> Request:
    """A request with a fresh KV cache of ``len(prompt) + max_tokens`` positions on ``engine``.

    Raises:
        ContextLengthError: the prompt plus ``max_tokens`` exceed the engine's context.
    """
    ids = prompt_ids.reshape(-1)
    cache = engine.new_cache(ids.shape[0] + max(int(max_tokens), 0))
    gen = None if params.greedy else make_generator(params.seed)
    return Request(ids, params, int(max_tokens), cache, gen)
