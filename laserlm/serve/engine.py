"""The serving engine: one background thread owns the continuous-batching scheduler; HTTP handlers talk to it
through a command queue and get their tokens back on asyncio queues.

This is vLLM's split of an ``AsyncLLMEngine`` (the async front the API server awaits) from the engine loop
(scheduling and model steps): the :class:`~laserlm.runtime.scheduler.Scheduler` is not thread-safe, so only
the engine thread calls it. A handler :meth:`ServingEngine.submit` s a request and awaits the scheduler's
answer (its id, or the error it raised: a prompt longer than the context, a full queue ...), then reads
:class:`TokenBatch` items and one final :class:`Finished` from its queue. :meth:`ServingEngine.cancel` (a
client that disconnected, a stop string found by the handler) frees the request's pages at the engine's next
iteration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..runtime.generate import TokenEvent
from ..runtime.loop import summarize
from ..runtime.scheduler import Scheduler

log = logging.getLogger("laserlm.serve")


@dataclass
class TokenBatch:
    """Tokens one engine step produced for one request (a speculative step may produce several)."""

    request_id: str
    events: list[TokenEvent]


@dataclass
class Finished:
    """The end of a request.

    Attributes:
        request_id: the request.
        reason: the scheduler's finish reason: ``eos`` | ``length`` | ``stop`` | ``cancelled``, or ``error``.
        summary: the decoding mode's statistics for the request (e.g. ``{"speculative": {...}}``).
        error: the exception of a failed engine step (``reason == "error"``).
        seconds: submit to finish, in seconds.
    """

    request_id: str
    reason: str
    summary: dict = field(default_factory=dict)
    error: BaseException | None = None
    seconds: float = 0.0


class ServingEngine:
    """Runs a :class:`~laserlm.runtime.scheduler.Scheduler` in a daemon thread (see the module docstring).

    Args:
        scheduler: the scheduler (its engine, pool and batch settings).
        on_step: optional ``fn(scheduler)`` called by the engine thread after every step and when idle (the
            metrics' gauges).
    """

    def __init__(self, scheduler: Scheduler, on_step=None):
        self.scheduler = scheduler
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="laserlm-engine", daemon=True)
        self.steps = 0
        self.error: BaseException | None = None  # the last failed step's error

    # -- the handlers' side (any thread / the event loop) --------------------------------------------
    def start(self) -> ServingEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    async def submit(self, prompt_ids, params, mode, max_tokens: int | None = None,
                     out: asyncio.Queue | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns ``(request id, queue)``. The queue (``out``, or a new one) receives the
        request's :class:`TokenBatch` items, then one :class:`Finished` (several requests may share a queue: the
        items name their request).

        Raises:
            what :meth:`Scheduler.submit` raises (ContextLengthError, InvalidArgumentError, PoolFullError,
            QueueFullError), and RuntimeError when the engine thread has stopped.
        """
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        out = out if out is not None else asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("submit", (prompt_ids, params, mode, max_tokens, loop, out), fut))
        self._wake.set()
        rid = await asyncio.wrap_future(fut)
        return rid, out

    async def call(self, fn):
        """Run ``fn()`` in the engine thread between two steps (the model is not thread-safe) and return its result
        (a scoring pass, for example; running requests wait for it as for a prefill chunk).

        Raises:
            what ``fn`` raises, and RuntimeError when the engine thread has stopped.
        """
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the engine's next iteration and free its pages (no-op when it has finished)."""
        self._commands.put(("cancel", request_id, None))
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------------
    def _deliver(self, rid: str, item, last: bool = False) -> None:
        sub = self._subscribers.pop(rid, None) if last else self._subscribers.get(rid)
        if sub is None:
            return
        loop, out = sub
        try:
            loop.call_soon_threadsafe(out.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed
            pass

    def _finished(self, rid: str, error: BaseException | None = None) -> None:
        sched = self.scheduler
        seq = sched.sequences.get(rid)
        if seq is None:
            return
        summary = {}
        if seq.request.started:
            try:
                summary = summarize(seq.mode, seq.request)
            except Exception:  # noqa: BLE001 - statistics never fail a request
                log.exception("mode summary failed")
        reason = "error" if error is not None else (seq.finish_reason or "cancelled")
        self._deliver(rid, Finished(rid, reason, summary, error, (seq.t_finish or time.perf_counter()) - seq.t_submit),
                      last=True)
        sched.pop(rid)

    def _drain(self) -> None:
        sched = self.scheduler
        while True:
            try:
                kind, payload, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "cancel":
                if payload in sched.sequences:
                    sched.cancel(payload)
                    self._finished(payload)
                continue
            if kind == "call":
                if not fut.set_running_or_notify_cancel():  # the caller went away (shutdown, a closed client)
                    continue
                try:
                    fut.set_result(payload())
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(exc)
                continue
            ids, params, mode, max_tokens, loop, out = payload
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                rid = sched.submit(ids, params, mode, max_tokens)
            except BaseException as exc:  # noqa: BLE001 - the handler turns it into an HTTP error
                fut.set_exception(exc)
                continue
            self._subscribers[rid] = (loop, out)
            fut.set_result(rid)
            if sched.get(rid).status == "finished":  # nothing to generate
                self._finished(rid)

    def _fail_all(self, exc: BaseException) -> None:
        """A step raised: the batch's state is unknown, so every unfinished request ends with the error."""
        sched = self.scheduler
        for rid, seq in list(sched.sequences.items()):
            if seq.status != "finished":
                sched.cancel(rid)
            self._finished(rid, exc)

    def _run(self) -> None:
        sched = self.scheduler
        while not self._stop.is_set():
            self._drain()
            if not sched.has_unfinished:
                if self.on_step is not None:
                    self.on_step(sched)
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = sched.step()
            except Exception as exc:  # noqa: BLE001 - the server stays up; the requests get a 500
                log.exception("engine step failed")
                self.error = exc
                self._fail_all(exc)
                continue
            self.steps += 1
            for out in outputs:
                if out.events:
                    self._deliver(out.request_id, TokenBatch(out.request_id, out.events))
                if out.finished:
                    self._finished(out.request_id)
            if self.on_step is not None:
                self.on_step(sched)
        for rid in list(self._subscribers):  # shutting down: nobody waits forever
            self._deliver(rid, Finished(rid, "error", error=RuntimeError("the server is shutting down")), last=True)
