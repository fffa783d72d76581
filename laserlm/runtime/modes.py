"""Decoding modes: the one interface every engine configuration implements.

A *mode* is how tokens are computed on top of the engine: full depth here; adaptive depth, static
pruning, naive early exit (``laserlm.depth``) and self-speculative decoding (``laserlm.speculative``)
implement the same interface, and the table of named modes is built above them, in :mod:`laserlm.modes`
(``make_mode``). Generation, evaluation and benchmarks only talk to this interface, so every metric
runs for every configuration.

A mode is a stateless, validated config: what changes while a request runs (patience streak, pending
token, draft statistics) lives in the request's ``state`` (:mod:`laserlm.runtime.request`), which the mode
creates in ``new_state``. Generation drives every mode through the one loop of :mod:`laserlm.runtime.loop`.

A mode is written as a spec string ``NAME[:key=value,key=value...]``, e.g. ``full``,
``adaptive:policy=confidence,threshold=0.9`` or ``speculative:draft_layers=12,k=4``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import InvalidArgumentError
from .loop import Emitted


@dataclass
class ScoreOutput:
    """Teacher-forced scoring of a sequence: ``logits [T, V]`` float32 predicting positions 1..T,
    ``layers [T]`` decoder layers run per position, and the per-position step details (``infos``,
    when the mode reports them)."""

    logits: torch.Tensor
    layers: torch.Tensor
    infos: list[dict] = field(default_factory=list)


class DecodingMode(Protocol):
    """What a decoding mode provides. ``engine`` is a :class:`~laserlm.runtime.engine.Engine`, ``request`` a
    :class:`~laserlm.runtime.request.Request`; ``prefill`` and ``step`` return
    :class:`~laserlm.runtime.loop.Emitted` tokens."""

    name: str

    def new_state(self, engine, request):
        """The per-request state this mode keeps in ``request.state`` (or ``None``)."""

    def prefill(self, engine, request) -> list:
        """Run the prompt into ``request.cache`` (from position ``request.prefilled``: the positions before it
        are already there); return the first generated token(s).

        A mode whose prefill runs every layer on every prompt token sets ``prefill_key = "full"``: the scheduler
        may then prefill its prompts in full-depth chunks and share prompt pages between requests
        (:mod:`laserlm.runtime.kv_pool`). Without it the scheduler runs the whole prompt through ``prefill``."""

    def step(self, engine, request) -> list:
        """Feed ``request.last_token``; return the next token(s) (at most ``request.remaining``)."""

    def score(self, engine, input_ids: torch.Tensor) -> ScoreOutput:
        """Teacher-forced logits of every position of ``input_ids [T]`` under this mode."""

    # optional, for continuous batching (laserlm.runtime.scheduler): ``batchable(engine) -> bool`` and
    # ``step_batch(engine, requests) -> list[list[Emitted]]`` (one step of several requests in one forward, each
    # as its own ``step`` would give it up to float rounding). Modes without them are stepped one request at a time.


class FullDepth:
    """The unmodified model: every token runs every decoder layer."""

    name = "full"
    prefill_key = "full"  # the prompt's K/V depend only on its tokens: prefix pages may be shared

    def new_state(self, engine, request):
        return None

    def prefill(self, engine, request):
        p = request.prefilled
        out = engine.prefill(request.prompt_ids[p:].unsqueeze(0), cache=request.cache, start=p)
        return [Emitted(request.sample(out.logits[0, -1]), engine.num_layers)]

    def step(self, engine, request):
        out = engine.decode_step(torch.tensor([request.last_token]), cache=request.cache)
        return [Emitted(request.sample(out.logits[0, -1]), out.stats.layers_run[-1])]

    def batchable(self, engine) -> bool:
        """Whether :meth:`step_batch` applies (dense attention: the sparse decode kernel reads one request)."""
        return engine.kernel is None

    @torch.inference_mode()
    def step_batch(self, engine, requests) -> list[list[Emitted]]:
        """One token for each of ``requests`` (paged caches) in one batched forward, each row at its own position
        with its own sampling parameters and RNG."""
        from .kv_pool import PagedBatch  # noqa: PLC0415

        ids = torch.tensor([[r.last_token] for r in requests], dtype=torch.long)
        h, st = engine.begin(ids, cache=PagedBatch([r.cache for r in requests]))
        h = engine.run_layers(0, engine.num_layers, h, st)
        engine.commit(st)
        logits = engine.head(h)[:, -1]  # [B, V]
        return [[Emitted(r.sample(logits[i]), engine.num_layers)] for i, r in enumerate(requests)]

    @torch.inference_mode()
    def score(self, engine, input_ids):
        out = engine.forward(input_ids.unsqueeze(0), logits="all", use_cache=False)
        t = input_ids.shape[0]
        return ScoreOutput(out.logits[0], torch.full((t,), float(engine.num_layers)))


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"adaptive:policy=confidence,threshold=0.9"`` -> ``("adaptive", {"policy": "confidence", ...})``."""
    name, _, rest = spec.strip().partition(":")
    opts: dict[str, str] = {}
    if spec.strip().endswith(":"):
        raise InvalidArgumentError(f"mode spec '{spec}' has ':' but no options (write '{name}' or '{name}:key=value')")
    if rest:
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                raise InvalidArgumentError(f"bad option '{part}' in mode spec '{spec}' (expected key=value)")
            key = key.strip().replace("-", "_")
            if key in opts:
                raise InvalidArgumentError(f"option '{key}' given twice in mode spec '{spec}'")
            opts[key] = value.strip()
    return name, opts
