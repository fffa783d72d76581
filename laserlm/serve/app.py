"""The OpenAI-compatible HTTP app (FastAPI): ``/v1/completions``, ``/v1/chat/completions`` (with server-sent
events when ``stream`` is true), ``/v1/models``, ``/health`` and ``/metrics``.

Requests go to the continuous-batching scheduler through :class:`~laserlm.serve.engine.ServingEngine`; text is
assembled by the same :class:`~laserlm.runtime.generate.Detokenizer` as offline ``generate``, so greedy output
over HTTP is the offline output. Every response carries a ``timings`` object with llama.cpp's server names
(``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``predicted_per_second``, ``draft_n``,
``draft_n_accepted``) plus ``layers_per_token`` and the ``exit_layer_histogram``. ``prompt_ms`` is the time
from arrival to the first token (the queue wait included: the scheduler admits and prefills in steps);
``predicted_ms`` is the time from the first token to the last.

Limits that protect the other streams: a body over ``max_body_bytes`` is refused with 413 before it is read (by its
``Content-Length``) or as soon as the bytes read pass the limit; a text prompt longer than the context could hold
even at the tokenizer's longest piece per token is refused before it is tokenized. On SIGTERM/SIGINT the server
drains (:meth:`ServerState.drain`): new requests get 503, running ones go on for ``shutdown_timeout`` seconds, then
each unfinished one ends with an error (an error event and ``[DONE]`` for a stream) before the engine stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..depth.stats import summarize_events
from ..errors import (ContextLengthError, InvalidArgumentError, LaserLMError, NonFiniteLogitsError, PoolFullError,
                      QueueFullError)
from ..runtime.generate import Detokenizer, IncrementalDecoder, encode_prompt
from ..runtime.request import check_prompt_ids
from ..runtime.scores import full_depth_logprobs
from ..runtime.structured import json_constraint
from .engine import Finished, ServingEngine, TokenBatch
from .metrics import ServerMetrics
from .protocol import APIError, ParsedRequest, bad, parse_chat, parse_completion, parse_json

log = logging.getLogger("laserlm.serve")
DISCONNECT_POLL_S = 0.25  # how often a running request checks that its client is still connected


@dataclass
class ServerSettings:
    """What ``laserlm serve`` runs (the CLI's flags; also what each Ray Serve replica builds).

    Attributes:
        model: bundled name, .gguf file or model directory.
        served_model_name: the name clients send as ``model`` (default: ``model``).
        mode: the default mode spec; ``laser`` adds a laser file to it as ``laserlm generate --laser`` does.
        allowed_modes: further mode specs a request may name in its ``mode`` field (all built at startup).
        lora: a LoRA delta file merged into the weights at load (``--lora``; the CLI fills it from the laser file).
        weights, prefill_dtype, dtype, ctx_size, threads: as ``laserlm generate``.
        kv_budget, max_batch, max_queue, page_size, prefill_chunk, eviction, prefix_cache, kv_prealloc, kv_groups: the
            KV pool and scheduler (:class:`~laserlm.runtime.scheduler.BatchConfig`).
        api_key: when set, ``/v1`` requests need ``Authorization: Bearer <api_key>``.
        default_max_tokens: chat requests without ``max_tokens`` generate at most this many tokens (and the room
            left in the context); completions default to OpenAI's 16.
        max_body_bytes: the largest request body read (bytes); larger gets 413.
        shutdown_timeout: seconds running requests may go on after SIGTERM before they end with an error.
        docs: serve FastAPI's ``/docs`` and ``/openapi.json`` (off by default: they describe no OpenAI route).
    """

    model: str = "smollm2-135m"
    served_model_name: str | None = None
    mode: str = "full"
    allowed_modes: list[str] = field(default_factory=list)
    laser: str | None = None
    lora: str | None = None
    weights: str = "auto"
    prefill_dtype: str = "auto"
    dtype: str | None = None
    ctx_size: int | None = None
    threads: int | None = None
    kv_budget: object = None
    max_batch: int = 16
    max_queue: int = 256
    page_size: int = 16
    prefill_chunk: int = 256
    eviction: str | None = None
    prefix_cache: bool = True
    kv_prealloc: str = "full"
    kv_groups: str | None = None
    api_key: str | None = None
    default_max_tokens: int = 512
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 30.0
    docs: bool = False

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def batch_options(self) -> dict:
        return {"max_batch": self.max_batch, "max_queue": self.max_queue, "page_size": self.page_size,
                "prefill_chunk": self.prefill_chunk, "eviction": self.eviction, "prefix_cache": self.prefix_cache,
                "kv_prealloc": self.kv_prealloc, "kv_groups": self.kv_groups}

    def mode_specs(self) -> list[str]:
        """The default mode spec first, then the other allowed specs (duplicates dropped)."""
        from ..cli_common import laser_mode_spec  # noqa: PLC0415

        default = laser_mode_spec(self.mode, self.laser) if self.laser else self.mode
        specs = [default.strip()]
        for s in self.allowed_modes:
            if s.strip() and s.strip() not in specs:
                specs.append(s.strip())
        return specs


@dataclass
class ServerState:
    """What the routes share: the model, its modes, the engine thread and the metrics.

    Attributes:
        replica_id: a random id of this server process (``/health`` reports it, so Ray Serve replicas can be told
            apart without exposing a pid).
        drain_deadline: ``time.monotonic()`` after which running requests are ended (None: not draining).
    """

    settings: ServerSettings
    lm: object
    modes: dict
    engine: ServingEngine
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    drain_deadline: float | None = None

    def drain(self) -> None:
        """Stop admitting requests; let running ones go on for ``settings.shutdown_timeout`` seconds (called from
        the signal handler of ``laserlm serve``)."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.settings.shutdown_timeout

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    @property
    def drain_expired(self) -> bool:
        """Draining, and the time running requests were given has passed: end them."""
        return self.drain_deadline is not None and time.monotonic() > self.drain_deadline

    def close(self) -> None:
        self.engine.shutdown()


def load_state(settings: ServerSettings, lm=None) -> ServerState:
    """Load the model (unless ``lm`` is given), build every allowed mode, start the engine thread.

    Raises:
        LaserLMError: an unknown model, a bad mode spec or batch setting (before anything is served).
    """
    from ..api import load  # noqa: PLC0415
    from ..runtime.scheduler import BatchConfig  # noqa: PLC0415

    BatchConfig(kv_budget=settings.kv_budget, **settings.batch_options()).validate()
    if lm is None:
        if settings.threads is not None:
            if settings.threads < 1:
                raise InvalidArgumentError(f"--threads must be >= 1, got {settings.threads}")
            torch.set_num_threads(settings.threads)
        lm = load(settings.model, dtype=settings.dtype, max_seq_len=settings.ctx_size, weights=settings.weights,
                  prefill_dtype=settings.prefill_dtype, lora=settings.lora)
    modes = {spec: lm.mode(spec) for spec in settings.mode_specs()}
    scheduler = lm.scheduler(kv_budget=settings.kv_budget, **settings.batch_options())
    for m in modes.values():  # the scheduler's own refusals (eviction + speculative, sparse attention) at startup
        scheduler.check([0], None, m, 1)
    metrics = ServerMetrics(lm.engine.num_layers)
    engine = ServingEngine(scheduler, on_step=metrics.update_pool).start()
    return ServerState(settings, lm, modes, engine, metrics)


# -- per-request work -----------------------------------------------------------------------------------
@dataclass(eq=False)
class Choice:
    """One prompt of a request under the engine."""

    index: int
    request_id: str
    prompt_n: int
    det: Detokenizer
    t_submit: float
    done: bool = False  # no more text for this choice
    finished: Finished | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_index: int = 0
    logprobs: object = None  # a TokenLogprobs of prompt + completion, when the request asked for them


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the byte each vocabulary character stands for."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):  # printable bytes stand for themselves, the rest for 256, 257, ... (GPT-2's encoder.py)
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ClientGone(Exception):
    """The HTTP client disconnected."""


def _error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None  # RFC 9110 §10.2.3: seconds
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or after it restarts",
                    "server_error", None, "server_shutting_down")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read no further than ``limit`` bytes.

    Raises:
        APIError: 413 (``request_too_large``) when ``Content-Length`` says more than ``limit`` (nothing is read) or
            the bytes received pass it (reading stops there); 400 for a malformed ``Content-Length``.
    """
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise bad(f"Content-Length must be a number of bytes, got {length[:40]!r}")
        if int(length) > limit:
            raise APIError(413, f"the request body has {int(length)} bytes; this server reads at most {limit} "
                                "(--max-body-bytes)", "invalid_request_error", None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body passed {limit} bytes, the most this server reads "
                                "(--max-body-bytes)", "invalid_request_error", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def max_piece_chars(tokenizer) -> int:
    """The most characters one vocabulary entry spells (byte-level BPE spells a text character as 1-4 entry
    characters, SentencePiece as one): a text of ``c`` characters needs at least ``c / max_piece_chars`` tokens."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def text_chars(prompt) -> int:
    """Characters of a text prompt or of a chat's message contents (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m["content"]) for m in prompt)
    return 0


def text_lengths(tokenizer, ids: list[int], skip_special_tokens: bool = False, window: int = 4) -> list[int]:
    """``len(tokenizer.decode(ids[:i]).rstrip("\ufffd"))`` for ``i = 0 .. len(ids)``: where each token's text starts
    in the decoded text (a token inside a character: that character's start), for ``text_offset``.

    Decoding every prefix costs O(n²); the :class:`~laserlm.runtime.generate.IncrementalDecoder` of generation
    gives the same texts in linear time.
    """
    dec = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens, window=window)
    out = [0]
    for t in ids:
        text = dec.push(t)
        out.append(max(len(dec.text), len(text.rstrip("\ufffd"))))
    return out


def _map_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", None, "queue_full")
    if isinstance(exc, ContextLengthError):
        return bad(str(exc), "prompt", "context_length_exceeded")
    if isinstance(exc, PoolFullError):  # a request that could never fit the KV budget
        return bad(str(exc), "max_tokens", "kv_budget_exceeded")
    if isinstance(exc, InvalidArgumentError):
        return bad(str(exc))
    if isinstance(exc, NonFiniteLogitsError):
        return APIError(500, str(exc), "server_error", None, "non_finite_logits")
    if isinstance(exc, LaserLMError):
        return bad(str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


class Server:
    """The routes' logic over a :class:`ServerState` (kept apart from FastAPI so it reads top to bottom)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.tokenizer = state.lm.tokenizer
        self.eos_ids = state.lm.eos_ids
        self.max_seq_len = state.lm.engine.max_seq_len
        self.max_piece_chars = max_piece_chars(self.tokenizer)

    # -- checks ---------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.state.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer <key>' with the server's --api-key",
                           "authentication_error", None, "invalid_api_key")

    def check_model(self, name: str) -> None:
        if name != self.state.settings.name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.state.settings.name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def pick_mode(self, spec: str | None):
        modes = self.state.modes
        if spec is None:
            return next(iter(modes.values()))
        if spec not in modes:
            raise bad(f"mode {spec!r} is not allowed on this server; allowed: {', '.join(modes)} (start the server "
                      "with --allow-mode SPEC to add one)", "mode", "mode_not_allowed")
        return modes[spec]

    def encode(self, req: ParsedRequest) -> list[torch.Tensor]:
        out = []
        for p in req.prompts:
            chars = text_chars(p)
            if chars > self.max_seq_len * self.max_piece_chars:  # too long for certain: do not tokenize it
                raise bad(f"the prompt has {chars} characters, so at least {chars // self.max_piece_chars} tokens "
                          f"(no token of this tokenizer spells more than {self.max_piece_chars} characters), but the "
                          f"context size is {self.max_seq_len}", "prompt", "context_length_exceeded")
            try:
                if req.kind == "chat":
                    ids = encode_prompt(self.tokenizer, p, True, self.max_seq_len)
                elif isinstance(p, str):
                    ids = encode_prompt(self.tokenizer, p, False, self.max_seq_len)
                else:
                    vocab = int(getattr(self.state.lm.engine.config, "vocab_size", 0) or 0)
                    try:
                        ids = check_prompt_ids(p, vocab, self.max_seq_len)
                    except InvalidArgumentError as exc:
                        raise bad(f"'prompt': {exc}", "prompt") from None
            except LaserLMError as exc:
                raise _map_error(exc) from None
            except (TypeError, ValueError) as exc:  # text the tokenizer refuses
                raise bad(f"cannot tokenize the prompt: {exc}", "prompt") from None
            room = self.max_seq_len - ids.numel()
            if req.max_tokens_given and req.params.max_new_tokens > room:
                raise bad(f"prompt ({ids.numel()} tokens) plus max_tokens ({req.params.max_new_tokens}) exceeds the "
                          f"context size of {self.max_seq_len} tokens; lower max_tokens or shorten the prompt",
                          "max_tokens", "context_length_exceeded")
            out.append(ids)
        return out

    async def prepare(self, req: ParsedRequest):
        self.check_model(req.model)
        mode = self.pick_mode(req.mode)
        cfg = self.state.engine.scheduler.config
        if len(req.prompts) * req.n > cfg.max_batch + cfg.max_queue:
            raise bad(f"{len(req.prompts)} prompts x n = {req.n} choices in one request, but this server runs at most "
                      f"{cfg.max_batch} and queues {cfg.max_queue} (--max-batch, --max-queue); split the request",
                      "prompt")
        ids = await asyncio.to_thread(self.encode, req)  # a long prompt must not stall the other streams
        params = req.params
        if not req.max_tokens_given and req.kind == "chat":
            room = min(self.max_seq_len - i.numel() for i in ids)
            pool = self.state.engine.scheduler.pool
            if self.state.engine.scheduler.eviction is None:  # what the KV pool can ever hold for one request
                room = min(room, pool.num_pages // pool.num_layers * pool.page_size - max(i.numel() for i in ids))
            params = dataclasses.replace(params, max_new_tokens=max(1, min(self.state.settings.default_max_tokens,
                                                                            room)))
        if req.response_format is not None:  # compile the schema off the event loop
            try:
                vocab = self.state.lm.engine.config.vocab_size
                constraint = await asyncio.to_thread(json_constraint, self.tokenizer, vocab,
                                                     req.response_format["schema"])
            except InvalidArgumentError as exc:
                raise bad(str(exc), "response_format") from None
            params = dataclasses.replace(params, constraint=constraint)
        try:  # max_new_tokens 0 (echo, scoring only) is valid here; the rest is the sampler's check
            dataclasses.replace(params, max_new_tokens=max(params.max_new_tokens, 1)).validate()
        except InvalidArgumentError as exc:
            raise bad(str(exc)) from None
        return mode, ids, params

    # -- running ----------------------------------------------------------------------------------------
    @staticmethod
    def choice_params(params, j: int):
        """Sampling parameters of choice ``j`` of a prompt: a seeded request's choice ``j`` uses ``seed + j``
        (modulo 2**64), so each choice equals the same request with ``n = 1`` and that seed."""
        if j == 0 or params.seed is None:
            return params
        return dataclasses.replace(params, seed=(params.seed + j) % 2**64)

    async def submit(self, mode, ids: list[torch.Tensor], params, n: int = 1) -> tuple[list[Choice], asyncio.Queue]:
        """Submit ``n`` choices of every prompt (choice index ``prompt * n + j``, OpenAI's order); all or none."""
        engine = self.state.engine
        choices: list[Choice] = []
        out: asyncio.Queue | None = None
        try:
            for i, p in enumerate(ids):
                for j in range(n):
                    t0 = time.perf_counter()
                    pj = self.choice_params(params, j)
                    if params.constraint is not None and (i, j) != (0, 0):  # grammar state is per choice
                        pj = dataclasses.replace(pj, constraint=params.constraint.fork())
                    rid, q = await engine.submit(p, pj, mode, out=out)
                    out = q
                    choices.append(Choice(i * n + j, rid, int(p.numel()), Detokenizer(self.tokenizer, pj, self.eos_ids),
                                          t0, prompt_ids=p.tolist(), prompt_index=i))
        except BaseException as exc:
            for c in choices:  # all prompts or none
                engine.cancel(c.request_id)
            if isinstance(exc, RuntimeError) and not engine.alive:
                raise APIError(503, "the engine is not running", "server_error", None, "engine_stopped") from None
            raise _map_error(exc) from None
        return choices, out

    async def events(self, choices: list[Choice], out: asyncio.Queue, request: Request):
        """Yield ``(choice, piece)`` as text arrives and ``(choice, None)`` when a choice ends; cancels what is
        left when the client disconnects or the consumer stops."""
        by_rid = {c.request_id: c for c in choices}
        engine = self.state.engine
        getter = None
        checked = time.monotonic()
        try:
            while not all(c.finished for c in choices):
                if self.state.drain_expired:
                    raise shutting_down()
                if getter is None:
                    getter = asyncio.ensure_future(out.get())
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if time.monotonic() - checked >= DISCONNECT_POLL_S:  # also while tokens flow
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone()
                if not done:
                    continue
                item, getter = getter.result(), None
                c = by_rid[item.request_id]
                if isinstance(item, TokenBatch):
                    if c.done:
                        continue
                    for ev in item.events:
                        piece, stop = c.det.push(ev)
                        if piece:
                            yield c, piece
                        if stop:  # EOS or a stop string: the engine may still be running it
                            c.done = True
                            engine.cancel(c.request_id)
                            break
                    continue
                c.finished = item
                if item.reason == "error":
                    raise _map_error(item.error)
                if not c.done:
                    tail = c.det.flush()
                    c.done = True
                    if tail:
                        yield c, tail
                self.record(c)
                yield c, None
        finally:
            if getter is not None:
                getter.cancel()
            for c in choices:
                if c.finished is None:
                    engine.cancel(c.request_id)
                    self.state.metrics.success.labels(finished_reason="abort").inc()

    @staticmethod
    def finish_reason(c: Choice) -> str:
        if c.det.finish in ("eos", "stop"):
            return "stop"
        return "length"

    def record(self, c: Choice) -> None:
        t = self.timings([c])
        self.state.metrics.observe_request(
            c.prompt_n, len(c.det.ids), self.finish_reason(c), c.det.ttft if c.det.layers else None, c.det.itl,
            time.perf_counter() - c.t_submit, c.det.layers[:len(c.det.ids)], t["draft_n"], t["draft_n_accepted"])

    @staticmethod
    def timings(choices: list[Choice]) -> dict:
        prompt_n = sum({c.prompt_index: c.prompt_n for c in choices}.values())
        predicted_n = sum(len(c.det.ids) for c in choices)
        ttfts = [c.det.ttft for c in choices if c.det.layers]
        itl = [s for c in choices for s in c.det.itl]
        predicted_s = max((sum(c.det.itl) for c in choices), default=0.0)
        draft_n = accepted = 0
        for c in choices:
            spec = (c.finished.summary if c.finished else {}).get("speculative", {})
            draft_n += int(spec.get("drafted", 0))
            accepted += int(spec.get("accepted", 0))
        layers = [n for c in choices for n in c.det.layers]
        infos = [i for c in choices for i in c.det.events]
        out = {
            "prompt_n": prompt_n,
            "prompt_ms": round(max(ttfts) * 1e3, 3) if ttfts else None,
            "predicted_n": predicted_n,
            "predicted_ms": round(predicted_s * 1e3, 3),
            "predicted_per_second": round(len(itl) / sum(itl), 3) if itl and sum(itl) > 0 else None,
            "draft_n": draft_n,
            "draft_n_accepted": accepted,
            "layers_per_token": round(sum(layers) / len(layers), 3) if layers else None,
        }
        hist = summarize_events(infos).get("exit_layer_histogram")
        if hist:
            out["exit_layer_histogram"] = hist
        return out

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        p = sum({c.prompt_index: c.prompt_n for c in choices}.values())  # once per prompt, not per choice (OpenAI)
        g = sum(len(c.det.ids) for c in choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    # -- endpoints ----------------------------------------------------------------------------------------
    async def complete(self, request: Request, kind: str):
        self.check_auth(request)
        if self.state.draining:
            raise shutting_down()
        body = parse_json(await read_body(request, self.state.settings.max_body_bytes))
        req = parse_completion(body) if kind == "completion" else parse_chat(body)
        mode, ids, params = await self.prepare(req)
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if params.max_new_tokens == 0:  # echo with max_tokens 0: score the prompt, generate nothing
            choices = [Choice(i * req.n + j, f"{rid}-{i}-{j}", int(p.numel()),
                              Detokenizer(self.tokenizer, params, self.eos_ids), time.perf_counter(), done=True,
                              finished=Finished(f"{rid}-{i}-{j}", "length"), prompt_ids=p.tolist(), prompt_index=i)
                       for i, p in enumerate(ids) for j in range(req.n)]
            try:
                await self.score(req, choices, request)
            except ClientGone:
                return Response(status_code=499)
            return JSONResponse(await self.build_body(req, rid, created, choices))
        choices, out = await self.submit(mode, ids, params, req.n)
        if req.stream:
            return StreamingResponse(self.sse(req, rid, created, choices, out, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _c, _piece in self.events(choices, out, request):
                pass
            await self.score(req, choices, request)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(await self.build_body(req, rid, created, choices))

    # -- log-probabilities ----------------------------------------------------------------------------------
    async def score(self, req: ParsedRequest, choices: list[Choice], request: Request | None = None) -> None:
        """Fill each choice's ``logprobs`` when the request asked for them: one full-depth scoring pass of prompt +
        completion in the engine thread (:func:`~laserlm.runtime.scores.full_depth_logprobs`), whatever mode
        generated the tokens, so the values are the served model's own and match ``laserlm eval``'s scorer. Equal
        sequences (``n`` echoes of one prompt) are scored once; a client gone or a server draining stops it between
        passes (a pass itself is not split: a long prompt's pass holds the other requests, as a prefill chunk of
        its length would)."""
        if req.logprobs is None:
            return
        engine = self.state.lm.engine
        done: dict[tuple, object] = {}
        for c in choices:
            seq = c.prompt_ids + c.det.ids + self._eos(c)
            key = tuple(seq)
            if key not in done:
                if self.state.drain_expired:
                    raise shutting_down()
                if request is not None and await request.is_disconnected():
                    raise ClientGone()
                try:
                    done[key] = await self.state.engine.call(functools.partial(full_depth_logprobs, engine, seq,
                                                                               req.logprobs))
                except LaserLMError as exc:
                    raise _map_error(exc) from None
            c.logprobs = done[key]

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes a token spells: its text when it decodes alone to whole characters, else its byte-level
        (GPT-2 ``bytes_to_unicode``) or SentencePiece ``<0xNN>`` form."""
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens([token_id])[0] or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        table = _byte_decoder()
        if piece and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return text.encode("utf-8")

    def _piece(self, token_id: int) -> str:
        """A token's label: its text, or ``bytes:\\xNN...`` for a token that is part of a character (as vLLM)."""
        b = self._token_bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def completion_logprobs(self, req: ParsedRequest, c: Choice) -> dict:
        """OpenAI's legacy completions ``logprobs`` object: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
        ``logprobs`` most likely tokens plus the chosen one, by text) and ``text_offset`` (characters into the
        returned text); with ``echo`` the prompt's tokens come first (the very first has no log-probability)."""
        lp = c.logprobs
        gen = self._kept_ids(c) + self._eos(c)
        seq = c.prompt_ids + gen
        start = 0 if req.echo else len(c.prompt_ids)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        base = len(self.prompt_text(req, c)) if req.echo else 0
        # where each token's text starts in the returned text (a token inside a character: that character's start)
        prompt_at = text_lengths(self.tokenizer, c.prompt_ids) if req.echo else []
        gen_at = text_lengths(self.tokenizer, gen, skip_special_tokens=True)
        for i in range(start, len(seq)):
            piece = self._piece(seq[i])
            out["tokens"].append(piece)
            n = len(c.prompt_ids)
            out["text_offset"].append(prompt_at[i] if i < n else base + gen_at[i - n])
            if i == 0:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            v = float(lp.token_logprobs[i - 1])
            top = {self._piece(int(t)): float(x) for t, x in zip(lp.top_ids[i - 1], lp.top_logprobs[i - 1])}
            top.setdefault(piece, v)
            out["token_logprobs"].append(v)
            out["top_logprobs"].append(top)
        return out

    @staticmethod
    def _eos(c: Choice) -> list[int]:
        """``[the EOS token]`` when it ended the choice, else ``[]``. Completions report it among the generated
        tokens with its log-probability, as vLLM does: lm-eval's ``local-completions`` reads a continuation's
        log-likelihood as ``token_logprobs[ctxlen:-1]`` of an ``echo`` + ``max_tokens: 1`` answer, which assumes one
        generated token even when that token is EOS."""
        return [c.det.last_event.token_id] if c.det.finish == "eos" and c.det.last_event is not None else []

    def _kept_ids(self, c: Choice) -> list[int]:
        """The generated ids whose text lies wholly inside the returned text (a stop string cuts the text inside a
        token: that token and the rest are not reported)."""
        ids = c.det.ids
        if c.det.finish != "stop":
            return ids
        k = len(ids)
        while k and len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) > len(c.det.text):
            k -= 1
        return ids[:k]

    def chat_logprobs(self, c: Choice) -> dict:
        """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` for the
        generated tokens."""
        lp, n = c.logprobs, len(c.prompt_ids)

        def entry(token_id: int, value: float) -> dict:
            return {"token": self._piece(token_id), "logprob": value, "bytes": list(self._token_bytes(token_id))}

        content = []
        for k, t in enumerate(self._kept_ids(c)):
            i = n + k - 1  # the position whose distribution predicted token n + k
            e = entry(t, float(lp.token_logprobs[i]))
            e["top_logprobs"] = [entry(int(a), float(x)) for a, x in zip(lp.top_ids[i], lp.top_logprobs[i])]
            content.append(e)
        return {"content": content}

    async def build_body(self, req: ParsedRequest, rid: str, created: int, choices: list[Choice]) -> dict:
        """:meth:`body`, in a worker thread when it holds log-probabilities (detokenizing thousands of tokens and
        their alternatives must not hold up the event loop: ``/health`` and every other stream)."""
        if any(c.logprobs is not None for c in choices):
            return await asyncio.to_thread(self.body, req, rid, created, choices)
        return self.body(req, rid, created, choices)

    def body(self, req: ParsedRequest, rid: str, created: int, choices: list[Choice]) -> dict:
        model = self.state.settings.name
        if req.kind == "completion":
            items = [{"index": c.index, "text": (self.prompt_text(req, c) if req.echo else "") + c.det.text,
                      "logprobs": None if c.logprobs is None else self.completion_logprobs(req, c),
                      "finish_reason": self.finish_reason(c)} for c in choices]
            obj = "text_completion"
        else:
            items = [{"index": c.index, "message": {"role": "assistant", "content": c.det.text},
                      "logprobs": None if c.logprobs is None else self.chat_logprobs(c),
                      "finish_reason": self.finish_reason(c)} for c in choices]
            obj = "chat.completion"
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": items,
                "usage": self.usage(choices), "timings": self.timings(choices)}

    def prompt_text(self, req: ParsedRequest, c: Choice) -> str:
        """The prompt as ``echo`` returns it: the text sent, or the decoded token ids."""
        p = req.prompts[c.prompt_index]
        return p if isinstance(p, str) else self.tokenizer.decode(c.prompt_ids)

    async def sse(self, req: ParsedRequest, rid: str, created: int, choices: list[Choice], out, request: Request):
        model = self.state.settings.name
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(items: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                          "choices": items, **extra}) + "\n\n"

        def item(c: Choice, piece: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if piece is None else {"content": piece}
                return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": c.index, "text": piece or "", "logprobs": None, "finish_reason": finish}

        try:
            if chat:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async for c, piece in self.events(choices, out, request):
                if piece is not None:
                    yield chunk([item(c, piece, None)])
                else:
                    yield chunk([item(c, None, self.finish_reason(c))], timings=self.timings([c]))
            if req.include_usage:
                yield chunk([], usage=self.usage(choices))
            yield "data: [DONE]\n\n"
        except APIError as err:  # the stream has started: the error goes in the stream (as vLLM does)
            self.state.metrics.count_error(err)
            yield "data: " + json.dumps(err.body()) + "\n\n"
            yield "data: [DONE]\n\n"
        except ClientGone:
            return

    def models(self, request: Request) -> dict:
        self.check_auth(request)
        s = self.state
        return {"object": "list", "data": [{"id": s.settings.name, "object": "model", "created": s.created,
                                            "owned_by": "laserlm", "max_model_len": self.max_seq_len,
                                            "modes": list(s.modes)}]}


def build_app(settings: ServerSettings | None = None, lm=None, state: ServerState | None = None) -> FastAPI:
    """The FastAPI app of ``laserlm serve`` (loads the model and starts the engine thread unless ``state`` is
    given). Used by uvicorn in ``laserlm serve`` and by each Ray Serve replica (:mod:`laserlm.serve.ray_serve`).

    Raises:
        LaserLMError: as :func:`load_state`.
    """
    state = state or load_state(settings or ServerSettings(), lm)
    server = Server(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        state.close()

    docs = state.settings.docs
    app = FastAPI(title="laserlm", description="OpenAI-compatible server of laserlm (adaptive-compute inference)",
                  lifespan=lifespan, docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.laserlm = state

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        if exc.status >= 400:
            state.metrics.count_error(exc)
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), kind, None, str(exc.status_code))
        state.metrics.count_error(err)
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return _error_response(bad(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("request failed")
        err = _map_error(exc)
        state.metrics.count_error(err)
        return _error_response(err)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.complete(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.complete(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        return server.models(request)

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "error", "detail": "engine thread stopped"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", "replica": state.replica_id}, status_code=503)
        return {"status": "ok", "replica": state.replica_id}  # tells Ray Serve replicas apart

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
