"""OpenAI request bodies -> laserlm requests, laserlm results -> OpenAI response bodies, and OpenAI's error JSON.

The fields follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``) as vLLM and
llama.cpp's server accept them: ``max_tokens`` (``max_completion_tokens`` for chat), ``temperature`` (default
1.0, in 0-2, as OpenAI), ``top_p``, ``top_k`` (vLLM's extension; 0 or -1 = off), ``stop`` (at most
:data:`MAX_STOP_STRINGS` strings of at most :data:`MAX_STOP_CHARS` characters), ``seed``, ``stream``,
``stream_options.include_usage``, plus laserlm's ``mode`` (a mode spec the server allows). Log-probabilities:
completions take ``logprobs`` (alternatives per token, 0-:data:`MAX_LOGPROBS`) and ``echo`` (the prompt's tokens
scored too; ``max_tokens: 0`` then only scores the prompt), chat takes ``logprobs: true`` and ``top_logprobs``.
Penalties: ``presence_penalty`` and ``frequency_penalty`` (OpenAI, -2..2) and ``repetition_penalty`` (vLLM's
extension, 0.01-100), as :func:`~laserlm.runtime.sampling.apply_penalties` defines them.
``n`` (at most :data:`MAX_N`) choices per prompt. ``response_format`` ``json_object`` or ``json_schema``: decoding
under the schema's grammar (:mod:`laserlm.runtime.structured`); a schema feature the grammar engine does not
support is a 400 naming it.
Fields laserlm does not implement (``best_of``, ``logit_bias``, tools, logprobs on a stream) are refused
with a 400 naming the field rather than silently ignored; unknown fields are ignored, as OpenAI-compatible
servers do.

Every error is an :class:`APIError`, rendered as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..runtime.sampling import SamplingParams
from ..runtime.options import is_int, is_number

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_STOP_STRINGS = 16              # OpenAI allows 4; vLLM and llama.cpp no limit: room for client-side templates
MAX_STOP_CHARS = 256               # per stop string: the detokenizer's stop search is windowed to the longest one
MAX_TEMPERATURE = 2.0              # OpenAI's documented range is 0-2
MAX_N = 16                         # choices per prompt (``n``)
MAX_LOGPROBS = 20                  # alternatives per token (OpenAI's top_logprobs limit, vLLM's default max)


class APIError(Exception):
    """An error answered with OpenAI's error JSON and an HTTP status.

    Args:
        status: HTTP status (400 invalid request, 401 bad key, 404 unknown model or route, 429 queue full,
            500 engine failure, 503 not ready).
        message: what went wrong and what to change.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, if any.
        code: a short machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class ParsedRequest:
    """A validated request.

    Attributes:
        kind: ``"completion"`` or ``"chat"``.
        model: the ``model`` field.
        prompts: texts or token-id lists (completions: one or more; chat: one list of messages).
        params: sampling parameters (``max_new_tokens`` is the request's ``max_tokens``).
        max_tokens_given: whether the body set ``max_tokens`` (chat defaults to the room left in the context).
        mode: the requested mode spec (``None``: the server's default).
        stream, include_usage: streaming and its usage chunk.
        n: choices per prompt (choice ``j`` of a seeded request samples with ``seed + j``).
        response_format: ``None`` (text) or ``{"schema": dict | None}``: decode under that JSON schema (None: any
            JSON object).
        logprobs: alternatives per token to report (``None``: no log-probabilities).
        echo: completions only: return the prompt before the completion, with its tokens' log-probabilities.
    """

    kind: str
    model: str
    prompts: list
    params: SamplingParams
    max_tokens_given: bool
    mode: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    n: int = 1
    response_format: dict | None = None
    extra: dict = field(default_factory=dict)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 400 for a body that is not JSON or not an object.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise bad(f"the request body holds a number too large to read: {exc}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(body: dict, name: str, lo: int | None = None, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not is_int(v):
        raise bad(f"'{name}' must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if not is_number(v):
        raise bad(f"'{name}' must be a finite number, got {v!r}", name)
    try:
        v = float(v)
    except OverflowError:  # an integer too large for a float
        raise bad(f"'{name}' must be a finite number, got an integer of {len(str(v))} digits", name) from None
    if math.isnan(v) or math.isinf(v):
        raise bad(f"'{name}' must be a finite number, got {v!r}", name)
    return v


def _text(s: str, param: str) -> str:
    """``s`` if it encodes as UTF-8 (JSON allows lone surrogates such as ``"\\ud800"``, which no tokenizer takes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{param}' contains a lone UTF-16 surrogate (invalid Unicode text)", param) from None
    return s


def _unsupported(body: dict) -> None:
    if body.get("best_of") not in (None, 1):
        raise bad("'best_of' is not supported (use 1)", "best_of")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by laserlm's server", "logit_bias")
    if body.get("tools") or body.get("functions"):
        raise bad("tool calling is not supported by laserlm's server", "tools")
    if body.get("suffix"):
        raise bad("'suffix' is not supported by laserlm's server", "suffix")


def _response_format(body: dict) -> dict | None:
    """``response_format`` -> ``None`` (text) or ``{"schema": dict | None}`` (``json_object``: any JSON object)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("'response_format' must be an object with a 'type' (text, json_object, json_schema)",
                  "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema": None}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad("'response_format.json_schema' must be an object with a 'schema' object", "response_format")
        return {"schema": spec.get("schema", {})}
    raise bad(f"'response_format.type' {kind!r} is not supported (text, json_object, json_schema)", "response_format")


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    temperature = _num(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise bad(f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "temperature")
    top_p = _num(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", default=0)
    if top_k < -1 or top_k > 2**31 - 1:
        raise bad(f"'top_k' must be in [0, 2147483647] (0 or -1 = off), got {top_k}", "top_k")
    seed = _int(body, "seed", lo=0)
    if seed is not None and seed >= 2**64:
        raise bad(f"'seed' must be below 2**64, got {seed}", "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' has {len(stop)} strings; this server takes at most {MAX_STOP_STRINGS}", "stop")
    if (longest := max((len(s) for s in stop), default=0)) > MAX_STOP_CHARS:
        raise bad(f"a 'stop' string has {longest} characters; this server takes at most {MAX_STOP_CHARS}", "stop")
    stop = [_text(s, "stop") for s in stop]
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("'ignore_eos' must be true or false", "ignore_eos")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _num(body, name, 0.0)
        if not -2 <= v <= 2:
            raise bad(f"'{name}' must be in [-2, 2], got {v}", name)
        penalties[name] = v
    rep = _num(body, "repetition_penalty", 1.0)
    if not 0.01 <= rep <= 100:
        raise bad(f"'repetition_penalty' must be in [0.01, 100] (1 = off), got {rep}", "repetition_penalty")
    return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                          seed=seed, stop=stop, ignore_eos=ignore_eos, repetition_penalty=rep, **penalties)


def _common(body: dict) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (see GET /v1/models)", "model")
    _unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = (opts or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be true or false", "stream_options")
    if opts and not stream:
        raise bad("'stream_options' needs 'stream': true", "stream_options")
    mode = body.get("mode")
    if mode is not None and (not isinstance(mode, str) or not mode.strip()):
        raise bad("'mode' must be a mode spec string such as 'full'", "mode")
    n = _int(body, "n", lo=1, default=1)
    if n > MAX_N:
        raise bad(f"'n' must be at most {MAX_N}, got {n}", "n")
    return {"model": model, "stream": stream, "include_usage": include_usage,
            "mode": mode.strip() if mode else None, "n": n, "response_format": _response_format(body)}


def parse_completion(body: dict) -> ParsedRequest:
    """Validate a ``/v1/completions`` body. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists.

    Raises:
        APIError: 400 naming the bad field.
    """
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
          and all(is_int(t) for p in prompt for t in p)):
        prompts = [list(p) for p in prompt]
    else:
        raise bad("'prompt' must be a string, a list of strings, or token ids", "prompt")
    if any(isinstance(p, str) and not p.strip() for p in prompts):
        raise bad("'prompt' is empty: give some text to continue", "prompt")
    for p in prompts:
        if isinstance(p, str):
            _text(p, "prompt")
        elif any(not 0 <= t < 2**63 for t in p):
            raise bad("token ids in 'prompt' must be non-negative integers of the model's vocabulary", "prompt")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise bad("'echo' must be true or false", "echo")
    logprobs = _int(body, "logprobs", lo=0)
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise bad(f"'logprobs' must be at most {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    given = body.get("max_tokens") is not None
    max_tokens = _int(body, "max_tokens", lo=0, default=COMPLETION_DEFAULT_MAX_TOKENS)
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' must be >= 1 (0 only with 'echo', to score the prompt)", "max_tokens")
    if echo and common["stream"]:
        raise bad("'echo' is not available on a stream yet: set 'stream': false", "echo")
    params = _sampling(body, max(max_tokens, 1))
    if max_tokens == 0:
        params.max_new_tokens = 0
    _no_stream_logprobs(common, logprobs)
    return ParsedRequest("completion", common["model"], prompts, params, given, common["mode"], common["stream"],
                         common["include_usage"], logprobs, echo, common["n"], common["response_format"])


def _no_stream_logprobs(common: dict, logprobs) -> None:
    if logprobs is not None and common["stream"]:
        raise bad("log-probabilities are not available on a stream yet: set 'stream': false", "logprobs")


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat(body: dict) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body (``messages``: ``[{"role", "content"}]``, content a string or a
    list of ``{"type": "text", "text"}`` parts).

    Raises:
        APIError: 400 naming the bad field.
    """
    common = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role' and a 'content'", "messages")
        if m["role"] not in ("system", "user", "assistant", "developer"):
            raise bad(f"messages[{i}].role {m['role']!r} is not supported (system, user, assistant)", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        if content is None and role == "assistant":  # OpenAI allows it (a turn that only called tools)
            content = ""
        clean.append({"role": role, "content": _text(_message_text(content, i), "messages")})
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    given = body.get(name) is not None
    max_tokens = _int(body, name, lo=1, default=1)
    want = body.get("logprobs", False)
    if want is None:
        want = False
    if not isinstance(want, bool):
        raise bad("'logprobs' must be true or false for chat (the number of alternatives is 'top_logprobs')",
                  "logprobs")
    top = _int(body, "top_logprobs", lo=0)
    if top is not None and top > MAX_LOGPROBS:
        raise bad(f"'top_logprobs' must be at most {MAX_LOGPROBS}, got {top}", "top_logprobs")
    if top is not None and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want else None
    _no_stream_logprobs(common, logprobs)
    return ParsedRequest("chat", common["model"], [clean], _sampling(body, max_tokens), given,
                         common["mode"], common["stream"], common["include_usage"], logprobs, n=common["n"],
                         response_format=common["response_format"])
