"""Decoding modes: the one interface every engine configuration implements.

A *mode* is how tokens are computed on top of the engine: full depth here; adaptive depth, static
pruning, naive early exit (``laserlm.depth``) and self-speculative decoding (``laserlm.speculative``)
implement the same interface, and the table of named modes is built above them, in :mod:`laserlm.mode_table`
(``make_mode``). Generation, evaluation and benchmarks only talk to this interface, so every metric
runs for every configuration.

Every mode subclasses :class:`Mode`, which states the whole contract with its defaults. A mode is a stateless, validated config: what changes while a request runs (patience streak, pending
token, draft statistics) lives in the request's ``state`` (:mod:`laserlm.runtime.request`), which the mode
creates in ``new_state``. Generation drives every mode through the one loop of :mod:`laserlm.runtime.loop`.

A mode is written as a spec string ``NAME[:key=value,key=value...]``, e.g. ``full``,
``adaptive:policy=confidence,threshold=0.9`` or ``speculative:draft_layers=12,k=4``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from ..errors import InvalidArgumentError
from .runner import Emitted


@dataclass
class ScoreOutput:
    """Teacher-forced scoring of a sequence: ``logits [T, V]`` float32 predicting positions 1..T,
    ``layers [T]`` decoder layers run per position, and the per-position step details (``infos``,
    when the mode reports them)."""

    logits: torch.Tensor
    layers: torch.Tensor
    infos: list[dict] = field(default_factory=list)


class Mode:
    """The contract every decoding mode implements, with its defaults.

    A mode subclasses this and overrides :meth:`prefill`, :meth:`step` and :meth:`score`; everything else has a
    default that is right for a mode that produces one token per forward, one request at a time. ``engine`` is a
    :class:`~laserlm.runtime.engine.Engine`, ``request`` a :class:`~laserlm.runtime.request.Request`;
    ``prefill``/``step`` return :class:`~laserlm.runtime.runner.Emitted` tokens.

    Capabilities the scheduler, loop and server read (class attributes, never probed by name):

    - ``prefill_key``: ``"full"`` when the mode's prefill runs every layer on every prompt token, so the prompt's
      K/V depend only on its tokens. The scheduler may then prefill in full-depth chunks and share prompt pages
      between requests (:mod:`laserlm.runtime.kv_pool`). ``None``: the whole prompt goes through :meth:`prefill`.
    - ``samples_each_token``: every emitted token is drawn by ``request.sample`` (so penalties and grammar
      constraints apply). ``False`` for modes that accept drafted tokens against an unchanged target.
    - ``rolls_back``: a step may write K/V positions and then discard them (a speculative verify). Such a mode
      cannot run under KV eviction, which may drop the pages a rollback returns to.
    """

    name: str = "mode"
    prefill_key: str | None = None
    samples_each_token: bool = True
    rolls_back: bool = False

    def new_state(self, engine, request):
        """The per-request state this mode keeps in ``request.state`` (default ``None``)."""
        return None

    def prefill(self, engine, request) -> list:
        """Run the prompt into ``request.cache`` from position ``request.prefilled`` (the positions before it are
        already there); return the first generated token(s)."""
        raise NotImplementedError(f"{type(self).__name__}.prefill")

    def step(self, engine, request) -> list:
        """Feed ``request.last_token``; return the next token(s) (at most ``request.remaining`` are kept)."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def score(self, engine, input_ids: torch.Tensor) -> ScoreOutput:
        """Teacher-forced logits of every position of ``input_ids [T]`` under this mode."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def batchable(self, engine) -> bool:
        """Whether :meth:`step_batch` applies on ``engine`` (default: no; the scheduler then steps each request
        alone)."""
        return False

    def step_batch(self, engine, requests) -> list[list]:
        """One step of several requests (paged caches) in one forward, each as its own :meth:`step` would give
        it up to float rounding. Called only when :meth:`batchable` is true."""
        raise NotImplementedError(f"{type(self).__name__}.step_batch")

    def summary(self, request) -> dict:
        """The mode's statistics for a finished ``request`` (merged into ``GenerationResult.extra``); default
        none."""
        return {}


class FullDepth(Mode):
    """The unmodified model: every token runs every decoder layer."""

    name = "full"
    prefill_key = "full"  # the prompt's K/V depend only on its tokens: prefix pages may be shared

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
        from .kv_pool import batch_of  # noqa: PLC0415

        ids = torch.tensor([[r.last_token] for r in requests], dtype=torch.long)
        h, st = engine.begin(ids, cache=batch_of([r.cache for r in requests]))
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
