"""Continuous batching over the paged KV pool: ``submit`` / ``step`` / ``cancel`` (vLLM's scheduler + engine step).

Source: Orca (Yu et al., OSDI 2022: iteration-level scheduling, requests join and leave the running batch at
every step) and vLLM (Kwon et al., SOSP 2023: paged KV, admission by free blocks, chunked prefill).

Each :meth:`Scheduler.step`

1. **admits** waiting requests in arrival order while fewer than ``max_batch`` run and the pool can *reserve*
   every page the request may ever hold (prompt + ``max_tokens`` positions, or the eviction policy's cap, for
   every layer). Reserving up front means an admitted request never runs out of pages, so nothing admitted is
   lost; a request that does not fit waits in a queue of at most ``max_queue`` requests. Past that bound, or
   when a request could never fit the budget, :meth:`submit` raises :class:`~laserlm.errors.PoolFullError`
   naming the budget. On admission the request takes any cached prefix pages (:mod:`laserlm.runtime.kv_pool`);
2. **prefills** at most ``prefill_chunk`` prompt tokens per step, oldest prompts first, at full depth (a long
   prompt is spread over several steps, so running decodes are not stalled; several short prompts share one
   step). A prompt's last part goes through the request's mode (``mode.prefill``), which gives the first
   token. Modes whose prefill is not full depth (``prefill_key`` unset: static pruning) run their whole prompt
   in one step, through the mode;
3. **decodes** one step of every request past its prompt: requests of one batchable mode (full depth with dense
   attention; adaptive depth with the ``propagate`` bridge and no ATS, each row with its own exits and patience,
   ``AdaptiveDepth.step_batch``) run as **one** batched forward, each row at its own position, with its own
   sampling parameters and RNG; the others (other bridges, speculative, pruning, sparse attention) take their
   mode's own step one request after another in the same iteration. Per-row exits inside one batched forward
   save little wall-clock time on a memory-bound CPU (every layer still streams its weights for the rows that
   continue);
4. **finishes** requests on EOS (unless ``ignore_eos``), ``max_tokens`` or their ``stop_check``, and frees their
   pages at once (prompt pages stay in the prefix cache when registered).

Every request's tokens are the tokens it gives when run alone (same mode, same seed), up to float rounding of
batched matmuls (tested on the real model) — without eviction. Under eviction a token sees the kept pages plus the
earlier tokens of its own forward, so the output depends on how the prompt was chunked (and the prefix cache is
off). Eviction is refused with speculative decoding (a verify rolls back over pages the policy may have dropped),
and the scheduler refuses block-sparse attention (its decode kernel expects a contiguous cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import InvalidArgumentError, PoolFullError, QueueFullError
from .eviction import parse_eviction
from .generate import TokenEvent
from .kv_pool import DEFAULT_PAGE_SIZE, PREALLOC, KVPool, PagedCache, budget_amount, parse_kv_groups
from .runner import Emitted, advance, advance_batch, prefill_chunk, start, token_events
from .modes import FullDepth
from .options import is_int, is_number
from .request import Request, check_prompt_ids
from .sampling import SamplingParams, check_mode_sampling, make_generator


@dataclass
class BatchConfig:
    """Scheduler settings.

    Attributes:
        kv_budget: pool size: MiB (``512``, ``"512MiB"``, ``"2GiB"``) or tokens (``"8192t"``); default 512 MiB.
        page_size: positions per page (default 16).
        max_batch: requests running at once (default 16).
        max_queue: requests waiting at most (default 256); more raise :class:`~laserlm.errors.PoolFullError`.
        prefill_chunk: prompt tokens prefilled per step, over all prompts (default 256).
        eviction: ``None`` / ``"streaming:..."`` / ``"depth_lru:..."`` (:mod:`laserlm.runtime.eviction`).
        prefix_cache: share full prompt pages between requests (default True).
        compact_every: finished requests between fragmentation checks (the seed's every-N rule; default 100).
        compact_threshold: external fragmentation above which the check compacts the pool (default 0.25).
        kv_prealloc: ``full`` (the arena holds the budget from the start), ``staged`` (it grows with the load up
            to the budget; :class:`~laserlm.runtime.kv_pool.KVPool`) or ``request`` (no pool: each admitted request
            allocates its own contiguous KV cache of prompt + ``max_tokens`` positions and frees it when it
            finishes; the baseline seed 004 §3.2 measures the pool against; admission still counts the budget; no
            prefix cache, no eviction).
        kv_groups: one block of the pool per layer group (seed 004 §3.2; :func:`~laserlm.runtime.kv_pool.parse_kv_groups`:
            ``N`` for groups of N layers, or end boundaries ``"8/16/30"``); default ``None``, one block. Needs
            ``kv_prealloc="full"``. Admission is the same as one block's, except that pages the ``none`` bridge
            frees for skipped layers stay reserved (they lie in the deep layers' block).
    """

    kv_budget: object = None
    page_size: int = DEFAULT_PAGE_SIZE
    max_batch: int = 16
    max_queue: int = 256
    prefill_chunk: int = 256
    eviction: object = None
    prefix_cache: bool = True
    compact_every: int = 100
    compact_threshold: float = 0.25
    kv_prealloc: str = "full"
    kv_groups: object = None

    def validate(self) -> BatchConfig:
        """Check every setting that needs no model (the budget's syntax, the eviction spec); returns self.

        Raises:
            InvalidArgumentError: a bad value.
        """
        for name in ("page_size", "max_batch", "max_queue", "prefill_chunk", "compact_every"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
        t = self.compact_threshold
        if not is_number(t) or not 0.0 <= float(t) <= 1.0:
            raise InvalidArgumentError(f"compact_threshold must be a number in [0, 1], got {t!r}")
        if not isinstance(self.prefix_cache, bool):
            raise InvalidArgumentError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        if self.eviction is not None and not isinstance(self.eviction, str) and not hasattr(self.eviction, "apply"):
            raise InvalidArgumentError(f"eviction must be a policy spec such as 'streaming:window=256', got "
                                       f"{self.eviction!r}")
        if self.kv_prealloc not in PREALLOC:
            raise InvalidArgumentError(f"kv_prealloc must be one of {', '.join(PREALLOC)}, got {self.kv_prealloc!r}")
        if self.kv_groups is not None and self.kv_prealloc != "full":
            raise InvalidArgumentError(f"KV blocks per layer group (kv_groups) need kv_prealloc full, not "
                                       f"{self.kv_prealloc}")
        budget_amount(self.kv_budget)  # syntax (the page count needs the model)
        parse_eviction(self.eviction)
        parse_kv_groups(self.kv_groups)  # syntax (the tiling needs the layer count)
        return self


@dataclass(eq=False)  # compared by identity
class Sequence:
    """A request under the scheduler.

    Attributes:
        request: the :class:`~laserlm.runtime.request.Request` (tokens, cache, sampling, mode state).
        mode: its decoding mode.
        status: ``waiting`` | ``prefill`` | ``decode`` | ``finished``.
        events: the :class:`~laserlm.runtime.generate.TokenEvent` s so far (``seconds``: since the request's
            previous token; the first: since ``submit``, i.e. TTFT including the wait in the queue).
        finish_reason: ``eos`` | ``length`` | ``stop`` | ``cancelled`` (``None`` while running).
        reserved: pages reserved for it in the pool (lowered as its cache returns pages it will never need again:
            skipped layers under the ``none`` bridge).
    """

    request: Request
    mode: object
    eos_ids: frozenset
    stop_check: Callable | None
    reserved: int
    status: str = "waiting"
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_last: float = 0.0
    t_finish: float | None = None
    returned: int = 0  # pages given back from the reservation (see Scheduler._return_skipped)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class StepOutput:
    """What one step produced for one request: its new tokens, and whether it finished."""

    request_id: str
    events: list[TokenEvent]
    finished: bool
    finish_reason: str | None


class Scheduler:
    """Continuous batching on one engine (see the module docstring).

    Args:
        engine: the :class:`~laserlm.runtime.engine.Engine`.
        config: :class:`BatchConfig`.
        eos_ids: tokens that end a request (unless its ``params.ignore_eos``).

    Raises:
        InvalidArgumentError: bad settings; eviction together with a block-sparse attention kernel.
    """

    def __init__(self, engine, config: BatchConfig | None = None, eos_ids=()):
        self.engine = engine
        self.config = (config or BatchConfig()).validate()
        self.pool = KVPool.for_engine(engine, self.config.kv_budget, self.config.page_size, self.config.kv_prealloc,
                                      self.config.kv_groups)
        self.eviction = parse_eviction(self.config.eviction)
        self._per_request = self.config.kv_prealloc == "request"
        if self.eviction is not None and self._per_request:
            raise InvalidArgumentError("KV eviction drops pages of the paged pool; per-request allocation "
                                       "(kv_prealloc request) has none: use kv_prealloc full or staged")
        if self.eviction is not None and engine.kernel is not None:
            raise InvalidArgumentError("KV eviction does not combine with block-sparse attention (use dense)")
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        # under eviction a prompt's kept pages depend on how it was chunked, so a shared prefix would not give the
        # cold run's logits: the prefix cache is off then
        # (per-request caches share nothing: no prefix cache either)
        self._prefix_cache = self.config.prefix_cache and self.eviction is None and not self._per_request
        self._full = FullDepth()  # the mode of requests submitted without one: one object, so that they batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.finished_count = 0
        self.stats = {"steps": 0, "batched_rows": 0, "batched_forwards": 0, "single_steps": 0,
                      "prefill_chunks": 0, "prefix_hit_tokens": 0}

    # -- submission ------------------------------------------------------------------------------
    def reservation(self, positions: int, prompt_tokens: int | None = None, mode=None) -> int:
        """Pages a request of ``positions`` positions may hold (its admission reservation). Under eviction: the
        policy's cap plus the pages one write can add before the policy runs at its commit (a prefill chunk, or
        the whole prompt for a mode that cannot be chunked)."""
        pages = self.pool.pages_for(positions)
        if self.eviction is not None:
            prompt = prompt_tokens or positions
            write = min(self.config.prefill_chunk, prompt) if mode.prefill_key is not None else prompt
            burst = self.pool.pages_for(write) + self.pool.num_layers  # + a page boundary
            cap = self.eviction.max_pages_per_request(self.pool.num_layers, self.pool.page_size)
            pages = min(pages, cap + burst)
        return pages

    def _check_supported(self, mode) -> None:
        if self.engine.kernel is not None:
            where = ("per-request KV allocation (--kv-prealloc request)" if self._per_request
                     else "the paged KV pool")
            raise InvalidArgumentError(f"block-sparse attention does not run with {where} yet; use dense "
                                       "attention with the scheduler (or LaserLM.generate for sparse attention)")
        if self.eviction is not None and mode.rolls_back:
            raise InvalidArgumentError("KV eviction does not combine with speculative decoding (a verify rolls "
                                       "positions back over pages the policy may have dropped); use eviction none")

    def check(self, prompt_ids, params: SamplingParams | None = None, mode=None,
              max_tokens: int | None = None) -> tuple[torch.Tensor, SamplingParams, object, int, int]:
        """Everything :meth:`submit` checks about one request except the queue: returns ``(ids [T], params, mode,
        max_tokens, pages to reserve)``. ``LaserLM.generate_batch`` calls it on every prompt before running any.

        Raises:
            ContextLengthError, InvalidArgumentError, PoolFullError: as :meth:`submit`, except a full queue.
        """
        params = (params or SamplingParams()).validate()
        mode = mode if mode is not None else self._full
        self._check_supported(mode)
        check_mode_sampling(params, mode)
        ids = check_prompt_ids(prompt_ids, int(getattr(self.engine.config, "vocab_size", 0) or 0),
                               self.engine.max_seq_len)
        if max_tokens is not None and int(max_tokens) < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        room = self.engine.max_seq_len - ids.numel()
        max_tokens = min(params.max_new_tokens, room) if max_tokens is None else min(int(max_tokens), room)
        need = self.reservation(ids.numel() + max_tokens, ids.numel(), mode)
        if need > self.pool.num_pages:
            raise PoolFullError(
                f"request needs up to {need} KV pages ({ids.numel()} prompt + {max_tokens} new positions x "
                f"{self.pool.num_layers} layers) but the KV budget is {self.pool.describe()}: raise --kv-budget"
                + (" or lower max_tokens" if self._per_request else
                   ", lower max_tokens, or enable eviction (--eviction streaming)"))
        return ids, params, mode, max_tokens, need

    def submit(self, prompt_ids: torch.Tensor, params: SamplingParams | None = None, mode=None,
               max_tokens: int | None = None, request_id: str | None = None,
               stop_check: Callable | None = None) -> str:
        """Queue a request; returns its id.

        Args:
            prompt_ids: ``[T]`` int64 prompt tokens.
            params: sampling parameters (validated here; default greedy, 64 tokens).
            mode: a decoding mode object (default full depth).
            max_tokens: tokens to generate at most (default ``min(params.max_new_tokens, context - T)``).
            stop_check: ``fn(request) -> bool`` called after every step (e.g. stop strings); True finishes it.

        Raises:
            ContextLengthError: the prompt fills the context.
            InvalidArgumentError: an empty prompt, bad token ids or sampling values, a duplicate id.
            PoolFullError: the request could never fit the budget; its subclass QueueFullError when the waiting
                queue is full.
        """
        ids, params, mode, max_tokens, need = self.check(prompt_ids, params, mode, max_tokens)
        self._admit()  # what can run now leaves the queue first
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(
                f"waiting queue full: it holds its maximum of {self.config.max_queue} requests (--max-queue) while "
                f"{len(self.running)} running requests (--max-batch {self.config.max_batch}) hold {self.pool.reserved} "
                f"of {self.pool.num_pages} pages (KV budget {self.pool.describe()}); retry later, or raise "
                "--max-queue, --max-batch or --kv-budget")
        if request_id is not None and request_id in self.sequences:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        gen = None if params.greedy else make_generator(params.seed)
        req = Request(ids, params, max_tokens, cache=None, generator=gen)
        if request_id is not None:
            req.request_id = request_id
        seq = Sequence(req, mode, frozenset() if params.ignore_eos else self.eos_ids, stop_check, need)
        self.sequences[req.request_id] = seq
        if max_tokens <= 0:
            self._finish(seq, "length")
        else:
            self.waiting.append(seq)
            self._admit()
        return req.request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False when it is unknown or already finished."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status == "finished":
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "cancelled")
        return True

    def get(self, request_id: str) -> Sequence:
        """The :class:`Sequence` of a submitted request (until :meth:`pop`).

        Raises:
            InvalidArgumentError: an unknown id.
        """
        seq = self.sequences.get(request_id)
        if seq is None:
            raise InvalidArgumentError(f"unknown request id {request_id!r}")
        return seq

    def pop(self, request_id: str) -> Sequence:
        """Forget a finished request (a long-running server calls this once it has sent the result).

        Raises:
            InvalidArgumentError: an unknown id, or a request still running (cancel it first).
        """
        seq = self.get(request_id)
        if seq.status != "finished":
            raise InvalidArgumentError(f"request {request_id!r} is still {seq.status}; cancel it first")
        return self.sequences.pop(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step --------------------------------------------------------------------------------
    def _admit(self) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            if pool.reserved + seq.reserved > pool.num_pages:
                return
            self.waiting.popleft()
            pool.reserved += seq.reserved
            req = seq.request
            positions = req.prompt_ids.numel() + req.max_tokens
            req.cache = (self.engine.new_cache(positions) if self._per_request
                         else PagedCache(pool, positions, self.eviction))
            key = seq.mode.prefill_key
            if self._prefix_cache and key is not None:
                req.prefilled = req.cache.attach_prefix(req.prompt_ids.tolist(), key)
                self.stats["prefix_hit_tokens"] += req.prefilled
            seq.status = "prefill"
            self.running.append(seq)

    def _prefill(self, seq: Sequence, budget: int) -> int:
        """Prefill up to ``budget`` prompt tokens of ``seq`` (its last part through the mode, which emits the
        first token); returns the tokens used."""
        eng, req = self.engine, seq.request
        key = seq.mode.prefill_key
        left = req.prompt_ids.numel() - req.prefilled
        if key is not None and left > budget:
            prefill_chunk(eng, req, budget)
            self.stats["prefill_chunks"] += 1
            return budget
        emitted = start(eng, seq.mode, req)
        self.stats["prefill_chunks"] += 1
        if self._prefix_cache and key is not None:
            req.cache.register_prefix(req.prompt_ids.tolist(), key)
        seq.status = "decode"
        self._emit(seq, emitted)
        return left

    def _groups(self, decoding: list[Sequence]) -> tuple[list[list[Sequence]], list[Sequence]]:
        """Decoding requests split into batches (same mode object, which can batch) and the rest."""
        by_mode: dict[int, list[Sequence]] = {}
        single = []
        for s in decoding:
            if s.mode.batchable(self.engine):
                by_mode.setdefault(id(s.mode), []).append(s)
            else:
                single.append(s)
        batches = [g for g in by_mode.values() if len(g) > 1]
        single += [g[0] for g in by_mode.values() if len(g) == 1]
        return batches, single

    def step(self) -> list[StepOutput]:
        """Admit, prefill one chunk, decode one token of every running request, finish; returns what each
        touched request produced (see the module docstring)."""
        self.stats["steps"] += 1
        if self.engine.kernel is not None:
            self._check_supported(None)
        self._admit()
        before = {s.request_id: len(s.events) for s in self.running}
        decoding = [s for s in self.running if s.status == "decode"]
        budget = self.config.prefill_chunk  # prompt tokens this step, shared by the oldest prompts first
        for s in [s for s in self.running if s.status == "prefill"]:
            if budget <= 0:
                break
            left = s.request.prompt_ids.numel() - s.request.prefilled
            if s.mode.prefill_key is None and left > budget and budget < self.config.prefill_chunk:
                break  # a prompt that cannot be chunked waits for a step of its own
            budget -= self._prefill(s, budget)
        batches, single = self._groups(decoding)
        for rows in batches:
            emitted = advance_batch(self.engine, rows[0].mode, [s.request for s in rows])
            self.stats["batched_forwards"] += 1
            self.stats["batched_rows"] += len(rows)
            for s, e in zip(rows, emitted):
                self._emit(s, e)
        for s in sorted(single, key=decoding.index):
            emitted = advance(self.engine, s.mode, s.request)
            self.stats["single_steps"] += 1
            self._emit(s, emitted)
            self._return_skipped(s)
        outputs = []
        for s in list(self.running):
            new = s.events[before.get(s.request_id, 0):]
            if s.status != "finished":
                reason = self._stop_reason(s)
                if reason is not None:
                    self._finish(s, reason)
            if new or s.status == "finished":
                outputs.append(StepOutput(s.request_id, new, s.status == "finished", s.finish_reason))
        return outputs

    def run(self, on_output: Callable | None = None) -> None:
        """Step until every submitted request has finished (``on_output(StepOutput)`` after each step)."""
        while self.has_unfinished:
            for out in self.step():
                if on_output is not None:
                    on_output(out)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _emit(self, seq: Sequence, emitted: list[Emitted]) -> None:
        now = time.perf_counter()
        prev = seq.t_last if seq.events else seq.t_submit
        for ev in token_events(emitted, now - prev):
            seq.events.append(ev)
            if ev.token_id in seq.eos_ids:
                seq.finish_reason = "eos"
                break
        seq.t_last = now

    def _return_skipped(self, seq: Sequence) -> None:
        """Lower ``seq``'s reservation by the pages its cache released for good (a page of skipped layers, under
        the ``none`` bridge, is never taken again by that request), so they can admit other requests. Not under
        eviction: there the reservation is the policy's cap, which the request may still fill with later pages.
        Not with blocks per layer group either: the returned pages are the deep layers' (in their group's block)
        and cannot serve a newcomer's shallow layers, so admitting on them could fail a running request."""
        cache = seq.request.cache
        gone = getattr(cache, "skipped", 0) - seq.returned
        if (gone > 0 and seq in self.running and getattr(cache, "eviction", None) is None
                and len(self.pool.blocks) == 1):
            seq.reserved -= gone
            self.pool.reserved -= gone
            seq.returned += gone

    def _stop_reason(self, seq: Sequence) -> str | None:
        if seq.finish_reason == "eos":
            return "eos"
        if seq.status == "decode" and seq.request.remaining <= 0:
            return "length"
        if seq.stop_check is not None and seq.events and seq.stop_check(seq.request):
            return "stop"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason, seq.t_finish = "finished", reason, time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
            self.pool.reserved -= seq.reserved
        cache = seq.request.cache
        if cache is not None:
            cache.free()
        self.finished_count += 1
        if self.finished_count % self.config.compact_every == 0:
            self.maybe_compact()

    def maybe_compact(self) -> int:
        """Compact the pool when its external fragmentation exceeds ``compact_threshold``; returns pages moved.
        Safe between steps only (the scheduler calls it when a request finishes, after its step)."""
        if self.pool.fragmentation()["external"] > self.config.compact_threshold:
            return self.pool.compact()
        return 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV memory held now: the pool's allocated pages (not its null page), plus every running request's
        own cache under per-request allocation."""
        own = sum(s.request.cache.nbytes for s in self.running if self._per_request and s.request.cache is not None)
        return self.pool.capacity * self.pool.page_bytes + own

    def summary(self) -> dict:
        """Pool and scheduler counters (pages, reservations, prefix hits, evictions, fragmentation)."""
        p = self.pool
        return {"kv_prealloc": p.prealloc, "kv_bytes": self.kv_bytes, "kv_groups": [list(g) for g in p.groups],
                "pages_total": p.num_pages, "pages_allocated": p.capacity, "pages_used": p.used_pages,
                "pages_cached": p.cached_pages,
                "pages_reserved": p.reserved, "page_size": p.page_size, "running": len(self.running),
                "waiting": len(self.waiting), "finished": self.finished_count, **self.stats, **p.stats,
                "fragmentation": p.fragmentation()}
