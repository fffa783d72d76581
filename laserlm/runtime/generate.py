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

from ..errors import ContextLengthError, InvalidArgumentError
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
    """Text and statistics of one request. Times in seconds, rates in tokens per second."""

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
        params, tok = self.params, self.tokenizer
        ids: list[int] = []
        layers: list[float] = []
        itl: list[float] = []
        extra_events: list[dict] = []
        emitted = 0
        text = ""
        finish = "length"
        ttft = float("nan")
        start = time.perf_counter()
        source = self.token_source(self.prompt_ids, params, self.max_tokens)
        for ev in source:
            if not ids:
                ttft = ev.seconds
            else:
                itl.append(ev.seconds)
            if ev.info:
                extra_events.append(ev.info)
            if ev.token_id in self.eos_ids:
                layers.append(ev.layers)
                finish = "eos"
                break
            ids.append(ev.token_id)
            layers.append(ev.layers)
            text = tok.decode(ids, skip_special_tokens=True)
            cut = None
            if params.stop:
                window_start = max(0, emitted - max(len(s) for s in params.stop))
                hits = [i for i in (text.find(s, window_start) for s in params.stop) if i >= 0]
                cut = min(hits) if hits else None
            if cut is not None:
                text = text[:cut]
                finish = "stop"
                if len(text) > emitted:
                    piece = text[emitted:]
                    emitted = len(text)
                    if self.on_token:
                        self.on_token(piece, ev)
                    yield piece
                break
            safe = len(text)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                safe = len(text.rstrip("\ufffd"))
            safe -= _held_back(text[:safe], params.stop) if params.stop else 0
            if safe > emitted:
                piece = text[emitted:safe]
                emitted = safe
                if self.on_token:
                    self.on_token(piece, ev)
                yield piece
        else:
            if self.context_limited and len(ids) >= self.max_tokens:
                finish = "context"
        if finish in ("length", "context", "eos") and len(text) > emitted:
            piece = text[emitted:]
            emitted = len(text)
            if self.on_token:  # the held-back tail goes to the callback too (text is non-empty: ev is set)
                self.on_token(piece, ev)
            yield piece
        total = time.perf_counter() - start
        extra = {"events": extra_events} if extra_events else {}
        summary = getattr(source, "summary", None)  # token sources may report aggregate stats
        if callable(summary):
            extra.update(summary())
        self.result = GenerationResult(text=text, token_ids=ids, prompt_tokens=int(self.prompt_ids.shape[0]),
                                       finish_reason=finish, ttft_s=ttft, total_s=total,
                                       layers_per_token=layers, itl_s=itl, extra=extra)

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
    if len(ids) >= max_seq_len:
        raise ContextLengthError(
            f"prompt has {len(ids)} tokens but the context size is {max_seq_len} "
            "(and at least one position is needed to generate); shorten the prompt or raise --ctx-size"
        )
    return torch.tensor(ids, dtype=torch.long)
