"""The one generation loop: prefill, then step until the request has its tokens.

Every decoding mode plugs into it through three calls (:class:`~laserlm.runtime.modes.Mode`):
``new_state(engine, request)``, ``prefill(engine, request)`` and ``step(engine, request)``; the last two
return the tokens they emitted as :class:`~laserlm.runtime.runner.Emitted` (one for full depth and adaptive
depth, several for a speculative cycle). The loop decides (one request, every step until it has its tokens); the
runner (:mod:`laserlm.runtime.runner`) runs the step, appends the tokens to the request and makes the timed
:class:`~laserlm.runtime.generate.TokenEvent` s; :class:`~laserlm.runtime.generate.Generation` turns those into
text. The scheduler that interleaves requests calls the same runner.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from .generate import TokenEvent
from .request import Request, new_request
from .runner import advance, start, token_events
from .sampling import SamplingParams, check_mode_sampling


def summarize(mode, request: Request) -> dict:
    """``mode.summary(request)`` for a started request; ``{}`` for one whose mode never ran (no state)."""
    return mode.summary(request) if request.started else {}


class RequestRun:
    """Iterator of :class:`TokenEvent` for one request under one mode; ``summary()`` gives the mode's
    aggregate statistics (merged into ``GenerationResult.extra``). ``TokenEvent.seconds`` of the first token
    of a step is the step's wall time (the first: TTFT), of the others 0."""

    def __init__(self, engine, mode, request: Request):
        check_mode_sampling(request.params, mode)
        self.engine, self.mode, self.request = engine, mode, request
        self._it = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        return next(self._it)

    def summary(self) -> dict:
        return summarize(self.mode, self.request)

    def _run(self) -> Iterator[TokenEvent]:
        req = self.request
        if req.max_tokens <= 0:
            return
        t0 = time.perf_counter()
        emitted = start(self.engine, self.mode, req)
        while True:
            now = time.perf_counter()
            yield from token_events(emitted, now - t0)
            if req.remaining <= 0:
                return
            t0 = now
            emitted = advance(self.engine, self.mode, req)


def generate_tokens(engine, mode, prompt_ids: torch.Tensor, params: SamplingParams, max_tokens: int) -> RequestRun:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids [T]`` with ``mode``, in a new request."""
    return RequestRun(engine, mode, new_request(engine, prompt_ids, params, max_tokens))


def greedy_ids(engine, mode, prompt_ids: torch.Tensor, n: int) -> list[int]:
    """The ``n`` greedy tokens ``mode`` generates after ``prompt_ids [T]`` (no EOS stop)."""
    params = SamplingParams(max_new_tokens=max(n, 1), ignore_eos=True)
    return [ev.token_id for ev in generate_tokens(engine, mode, prompt_ids, params, n)]
