"""Generation: the token loop, stop conditions, incremental detokenization and streaming.

The loop is split in two layers so that every decoding mode shares the text handling:

- a *token source* yields :class:`TokenEvent` s (one per generated token): the one loop of
  :mod:`laserlm.runtime.loop` (:func:`~laserlm.runtime.loop.generate_tokens`) under any decoding mode;
- :class:`Generation` turns a token source into streamed text, applies EOS / stop strings /
  ``max_new_tokens`` / the context limit, and collects the statistics (TTFT, tokens/s, layers per
  token) into a :class:`GenerationResult`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from ..errors import InvalidArgumentError
from .request import check_prompt_ids
from .sampling import SamplingParams


@dataclass
class TokenEvent:
    """One generated token.

    Attributes:
        token_id: the token.
        layers: decoder layers run for the forward that produced it (may be fractional when
            a forward produced several tokens, as in speculative decoding).
        seconds: wall-clock seconds since the previous event (the first: since the start, i.e. TTFT).
        info: mode-specific details (exit group, acceptance, ...).
    """

    token_id: int
    layers: float
    seconds: float
    info: dict = field(default_factory=dict)


@dataclass
class GenerationResult:
    """Text and statistics of one request. Times in seconds, rates in tokens per second.

    ``token_ids`` are the emitted tokens (an EOS that ended generation is not emitted); ``layers_per_token`` has one
    entry per *computed* token, that EOS included, since its layers ran (``stats()["computed_tokens"]``)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    ttft_s: float
    total_s: float
    layers_per_token: list[float]
    itl_s: list[float]
    extra: dict = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.itl_s)
        return n / sum(self.itl_s) if n and sum(self.itl_s) > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else float("nan")

    @property
    def mean_layers_per_token(self) -> float:
        return sum(self.layers_per_token) / len(self.layers_per_token) if self.layers_per_token else float("nan")

    def stats(self) -> dict:
        """Machine-readable summary (the CLI's ``--json``). Undefined values (e.g. the decode rate when at
        most one token was generated) are ``None``, so the output is strict JSON (no ``NaN``)."""
        tpot = sum(self.itl_s) / len(self.itl_s) if self.itl_s else float("nan")

        def num(x: float, digits: int):
            return None if x != x or x in (float("inf"), float("-inf")) else round(x, digits)

        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "computed_tokens": len(self.layers_per_token),  # + the EOS that ended generation, if one did
            "finish_reason": self.finish_reason,
            "ttft_s": num(self.ttft_s, 6),
            "tpot_s": num(tpot, 6),
            "total_s": num(self.total_s, 6),
            "prefill_tokens_per_s": num(self.prefill_tokens_per_s, 3),
            "decode_tokens_per_s": num(self.decode_tokens_per_s, 3),
            "mean_layers_per_token": num(self.mean_layers_per_token, 3),
            "layers_per_token": self.layers_per_token,
            **self.extra,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stats"] = self.stats()
        return d


def eos_token_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if v is None:
            continue
        ids.update(v if isinstance(v, (list, tuple, set)) else [v])
    return {int(i) for i in ids}


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDecoder:
    """The text of a growing list of token ids, in linear time: ``push(id)`` returns ``tokenizer.decode(ids)`` of
    all ids so far.

    Decoding the whole list after every token costs O(n²). Like vLLM's ``detokenize_incrementally`` and HF's
    ``TextStreamer``, this decodes only the newest tokens with ``window`` tokens of context before the last point
    where the text was complete (no trailing U+FFFD, the replacement character of an unfinished UTF-8 sequence):
    the context makes tokenizers that drop a leading space at the start of a decode (SentencePiece) give the
    same characters as the whole decode. While a character is unfinished, the returned text ends in U+FFFD.

    Attributes:
        ids: the token ids pushed.
        text: the text up to the last complete point (``decode(ids[:complete])``).
        complete: how many ids ``text`` covers.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, window: int = 4):
        self.tokenizer, self.skip, self.window = tokenizer, skip_special_tokens, window
        self.ids: list[int] = []
        self.text = ""
        self.complete = 0
        self._start, self._head = 0, 0  # context start and len(decode(ids[start:complete]))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Append ``token_id``; returns the whole text so far (ending in U+FFFD inside an unfinished character)."""
        self.ids.append(int(token_id))
        n = len(self.ids)
        part = self._decode(self.ids[self._start:n])
        tail = part[self._head:]
        if part.endswith("\ufffd"):
            return self.text + tail
        self.text += tail
        self.complete = n
        self._start = max(0, n - self.window)
        self._head = len(self._decode(self.ids[self._start:n]))
        return self.text


class Detokenizer:
    """Push-based text assembly for one request: feed :class:`TokenEvent` s to :meth:`push`, get the text
    pieces that are safe to show, and :meth:`flush` the held-back tail at the end. It applies EOS and stop
    strings (the stop string is not part of the text), holds back an incomplete UTF-8 sequence and any suffix
    that may grow into a stop string, and collects what :class:`GenerationResult` reports.

    :class:`Generation` (the pull-based iterator) and the HTTP server (:mod:`laserlm.serve`) both use it, so
    offline and served requests give the same text.

    Args:
        tokenizer: the model's tokenizer.
        params: validated sampling parameters (``stop`` strings, ``ignore_eos``).
        eos_ids: tokens that end generation (ignored when ``params.ignore_eos``).

    Attributes:
        ids, layers, itl, events: generated token ids (EOS excluded), layers per token (EOS included),
            inter-token seconds, mode infos of the events.
        text: the text so far (cut at a stop string once one is found).
        finish: ``"eos"`` or ``"stop"`` once :meth:`push` returned ``done``; else ``None``.
        ttft: seconds of the first event (NaN before it).
    """

    def __init__(self, tokenizer, params: SamplingParams, eos_ids):
        self.tokenizer, self.params = tokenizer, params
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.ids: list[int] = []
        self.layers: list[float] = []
        self.itl: list[float] = []
        self.events: list[dict] = []
        self.text = ""
        self._decoder = IncrementalDecoder(tokenizer)
        self.emitted = 0
        self.finish: str | None = None
        self.ttft = float("nan")
        self.last_event: TokenEvent | None = None

    def push(self, ev: TokenEvent) -> tuple[str, bool]:
        """Take one event; returns ``(piece, done)``: the new text to show (maybe ``""``) and whether the
        request is over (EOS or a stop string; later events must not be pushed)."""
        params = self.params
        if self.last_event is None:
            self.ttft = ev.seconds
        else:
            self.itl.append(ev.seconds)
        self.last_event = ev
        if ev.info:
            self.events.append(ev.info)
        self.layers.append(ev.layers)
        if ev.token_id in self.eos_ids:
            self.finish = "eos"
            return self.flush(), True
        self.ids.append(ev.token_id)
        text = self._decoder.push(ev.token_id)
        if params.stop:
            window_start = max(0, self.emitted - max(len(s) for s in params.stop))
            hits = [i for i in (text.find(s, window_start) for s in params.stop) if i >= 0]
            if hits:
                self.text = text[:min(hits)]
                self.finish = "stop"
                return self._take(len(self.text)), True
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            safe = len(text.rstrip("\ufffd"))
        safe -= _held_back(text[:safe], params.stop) if params.stop else 0
        return self._take(safe), False

    def flush(self) -> str:
        """The text not shown yet (at the end of a request that did not stop on a stop string)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted:upto]
        self.emitted = upto
        return piece


class Generation:
    """An iterator of text pieces for one request; ``.result`` holds the :class:`GenerationResult` at the end.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: ``[T]`` int64 prompt tokens.
        token_source: ``fn(prompt_ids, params, max_tokens) -> Iterator[TokenEvent]``.
        params: validated sampling parameters.
        eos_ids: tokens that end generation (unless ``params.ignore_eos``).
        max_seq_len: context size; generation stops with ``finish_reason="context"`` when it is full.
        on_token: optional callback ``fn(text_piece, event)`` called for every streamed piece.
    """

    def __init__(self, tokenizer, prompt_ids: torch.Tensor, token_source: Callable, params: SamplingParams,
                 eos_ids: set[int], max_seq_len: int, on_token: Callable | None = None):
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.params = params
        self.eos_ids = set() if params.ignore_eos else eos_ids
        room = max_seq_len - prompt_ids.shape[0]
        self.context_limited = room < params.max_new_tokens
        self.max_tokens = min(params.max_new_tokens, room)
        self.token_source = token_source
        self.on_token = on_token
        self.result: GenerationResult | None = None
        self._it = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._it)

    def _run(self) -> Iterator[str]:
        det = Detokenizer(self.tokenizer, self.params, self.eos_ids)
        start = time.perf_counter()
        source = self.token_source(self.prompt_ids, self.params, self.max_tokens)
        for ev in source:
            piece, done = det.push(ev)
            if piece:
                if self.on_token:
                    self.on_token(piece, ev)
                yield piece
            if done:
                break
        tail = det.flush()
        if tail:
            if self.on_token:  # the held-back tail goes to the callback too (text is non-empty: an event came)
                self.on_token(tail, det.last_event)
            yield tail
        finish = det.finish
        if finish is None:
            finish = "context" if self.context_limited and len(det.ids) >= self.max_tokens else "length"
        total = time.perf_counter() - start
        extra = {"events": det.events} if det.events else {}
        summary = getattr(source, "summary", None)  # token sources may report aggregate stats
        if callable(summary):
            extra.update(summary())
        self.result = GenerationResult(text=det.text, token_ids=det.ids, prompt_tokens=int(self.prompt_ids.shape[0]),
                                       finish_reason=finish, ttft_s=det.ttft, total_s=total,
                                       layers_per_token=det.layers, itl_s=det.itl, extra=extra)

    def run(self) -> GenerationResult:
        """Consume the stream and return the result."""
        for _ in self:
            pass
        return self.result


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of plain ``text`` with the tokenizer's default special tokens (Gemma: a leading ``<bos>``),
    except that a BOS the text already starts with is not added a second time.

    A rendered chat prompt such as Gemma3's ``"<bos><start_of_turn>user\n..."`` passed as plain text would
    otherwise begin ``[2, 2, ...]`` (transformers #37686); here it gets the ids of tokenizing the template in
    one step (``apply_chat_template(..., tokenize=True)``, i.e. the text without added special tokens).
    Tokenizers that add no BOS (SmolLM2) are unaffected.

    Returns:
        ``list[int]`` token ids.
    """
    ids = tokenizer(text)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:2] == [bos, bos]:
        plain = tokenizer(text, add_special_tokens=False)["input_ids"]
        if plain[:1] == [bos]:  # the BOS is in the text itself: keep that one, drop the added one
            ids = ids[1:]
    return ids


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool, max_seq_len: int) -> torch.Tensor:
    """Tokenize a prompt (optionally through the chat template) -> ``[T]`` int64.

    Args:
        prompt: a string, or a list of ``{"role", "content"}`` messages (implies ``chat``). A string is
            encoded with the tokenizer's special tokens (:func:`encode_text`: a BOS the text already starts
            with, as in a rendered chat prompt, is not doubled); a chat prompt is rendered by the template,
            which writes its own special tokens.

    Raises:
        InvalidArgumentError: empty prompt, or chat requested for a tokenizer without a chat template.
        ContextLengthError: the prompt is longer than the context.
    """
    if isinstance(prompt, list):
        messages, chat = prompt, True
        if not messages or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise InvalidArgumentError("messages must be a non-empty list of {'role', 'content'} dicts")
    else:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgumentError("empty prompt: give some text to continue")
        messages = [{"role": "user", "content": prompt}]
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgumentError("this model's tokenizer has no chat template; drop --chat")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = encode_text(tokenizer, prompt)  # a prompt that starts with the BOS text gets one BOS, not two
    if len(ids) == 0:
        raise InvalidArgumentError("the prompt encodes to zero tokens")
    return check_prompt_ids(torch.tensor(ids, dtype=torch.long), 0, max_seq_len)
