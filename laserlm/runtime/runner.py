"""The runner: executes what the scheduler (or a lone request's loop) decided, and is the one place a token is
produced and timed.

As in vLLM v1, where ``Scheduler.schedule`` decides and the model runner executes, deciding *which* requests run
this step lives in :mod:`laserlm.runtime.scheduler` (admission, prefill budget, batches) and in
:class:`~laserlm.runtime.loop.RequestRun` (one request, every step); *running* them lives here:

- :func:`prefill_chunk`: a full-depth chunk of a prompt into the request's KV cache (no token);
- :func:`start`: the mode's prefill of the rest of the prompt, which emits the first token(s);
- :func:`advance` / :func:`advance_batch`: one step of one request, or of several in one batched forward;
- :func:`record`: the emitted tokens appended to the request (cut to its length limit);
- :func:`token_events`: emitted tokens as :class:`~laserlm.runtime.generate.TokenEvent` s with their timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .generate import TokenEvent
from .request import Request


@dataclass
class Emitted:
    """A token a mode produced: ``layers`` = decoder layers its forward ran (fractional when one forward
    produced several tokens), ``info`` = mode-specific details."""

    token_id: int
    layers: float
    info: dict = field(default_factory=dict)


@torch.inference_mode()
def prefill_chunk(engine, request: Request, n: int) -> None:
    """Run prompt tokens ``request.prefilled .. + n`` through every layer into ``request.cache`` (a chunk of a
    mode whose ``prefill_key`` is set: the prompt's K/V depend only on its tokens) and advance
    ``request.prefilled``."""
    p = request.prefilled
    h, st = engine.begin(request.prompt_ids[p:p + n].unsqueeze(0), start=p, cache=request.cache)
    engine.run_layers(0, engine.num_layers, h, st)
    engine.commit(st)
    request.prefilled = p + n


@torch.inference_mode()
def start(engine, mode, request: Request) -> list[Emitted]:
    """Give ``request`` its mode state and run the rest of its prompt; returns the first token(s) kept."""
    request.state = mode.new_state(engine, request)
    request.started = True
    emitted = mode.prefill(engine, request)
    request.prefilled = request.prompt_ids.numel()
    return record(request, emitted)


@torch.inference_mode()
def advance(engine, mode, request: Request) -> list[Emitted]:
    """One step of ``request`` (it must have been started and have ``remaining > 0``); the tokens kept."""
    return record(request, mode.step(engine, request))


@torch.inference_mode()
def advance_batch(engine, mode, requests: list[Request]) -> list[list[Emitted]]:
    """One step of every request of ``requests`` in one batched forward (``mode.batchable(engine)`` must hold);
    the tokens each kept."""
    return [record(r, e) for r, e in zip(requests, mode.step_batch(engine, requests))]


def record(request: Request, emitted: list[Emitted]) -> list[Emitted]:
    """Append ``emitted`` (cut to ``request.remaining``) to the request's tokens; returns what was kept."""
    emitted = emitted[:max(request.remaining, 0)]
    for e in emitted:
        request.output_ids.append(int(e.token_id))
        request.infos.append(e.info)
    return emitted


def token_events(emitted: list[Emitted], seconds: float) -> list[TokenEvent]:
    """The events of one step's tokens: the first carries the step's wall time ``seconds`` (for the first step:
    the TTFT), the others 0 (they came out of the same forward)."""
    return [TokenEvent(int(e.token_id), e.layers, seconds if i == 0 else 0.0, e.info) for i, e in enumerate(emitted)]
