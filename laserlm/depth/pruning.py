"""Static baselines: static layer pruning (ShortGPT) and naive early exit.

- Static pruning drops the same decoder layers for every token. Which layers: the lowest *Block Influence*
  ``BI_i = 1 - E_t[cos(h_i,t, h_i+1,t)]`` (cosine of the hidden state entering and leaving layer i, averaged
  over calibration tokens; Men et al. 2024, "ShortGPT").
- Naive early exit stops every token after a fixed number of layers and applies the exit head there
  (the model's final norm + LM head unless a trained head is given).

Both are a :class:`LayerSubset`: the model restricted to a set of kept layers, used for the prompt and for
every generated token alike (the dropped layers never run, so their K/V are never needed).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from ..errors import InvalidArgumentError
from ..runtime.runner import Emitted
from ..runtime.modes import Mode, ScoreOutput
from .router import runs
from .stats import summarize_events

DEFAULT_CALIB_TOKENS = 2048
_BLOCK_INFLUENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {(calib, tokens): [L]}


CALIB_TEXT = "wikitext-2/valid.txt"  # under the data directory (see laserlm.data)


def default_calibration_text() -> Path:
    """``wikitext-2/valid.txt`` under the data directory (``$LASERLM_DATA``, see :mod:`laserlm.data`).

    Raises:
        DataFileError: no data directory configured or no such file (the message names ``calib=``).
    """
    from ..data import resolve  # noqa: PLC0415

    return resolve(None, CALIB_TEXT, flag="calib=", what="calibration text (or pass drop=i/j/k)")


@torch.inference_mode()
def block_influence(engine, input_ids: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """ShortGPT Block Influence of every decoder layer, ``[L]`` float64.

    Args:
        input_ids: ``[N]`` calibration tokens, processed in independent chunks of ``chunk`` tokens (at most the
            engine's context).
    """
    ids = input_ids.reshape(-1)
    L = engine.num_layers
    chunk = min(chunk, engine.max_seq_len)
    total = torch.zeros(L, dtype=torch.float64)
    count = 0
    for s in range(0, ids.shape[0], chunk):
        piece = ids[s:s + chunk]
        if piece.shape[0] < 2:
            continue
        h, st = engine.begin(piece.unsqueeze(0), use_cache=False)
        for i in range(L):
            out = engine.run_layer(i, h, st)
            total[i] += torch.nn.functional.cosine_similarity(h[0].double(), out[0].double(), dim=-1).sum()
            h = out
        count += piece.shape[0]
    if count == 0:
        raise InvalidArgumentError("block influence needs at least 2 calibration tokens")
    return 1.0 - total / count


def calibration_ids(engine, path=None, num_tokens: int = DEFAULT_CALIB_TOKENS) -> torch.Tensor:
    """The first ``num_tokens`` tokens of calibration text, ``[N]`` int64: ``path`` is a text file, a data
    directory (its WikiText-2 valid) or ``hf:NAME[:CONFIG[:SPLIT]]`` (see :mod:`laserlm.data`); default:
    WikiText-2 valid of the default data directory.

    Raises:
        DataFileError: the text is not found (the message names ``calib=``); InvalidArgumentError: no
            tokenizer on the engine.
    """
    from ..data import read_text, resolve  # noqa: PLC0415

    path = resolve(path or None, CALIB_TEXT, flag="calib=", what="calibration text (or pass drop=i/j/k)",
                   default_split="validation")
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        raise InvalidArgumentError("the engine has no tokenizer to read calibration text; pass drop=i/j/k")
    text = read_text(path, errors="replace")[: num_tokens * 12]
    return torch.tensor(tok(text)["input_ids"][:num_tokens], dtype=torch.long)


def pruned_layers(engine, num_drop: int, calib=None, num_tokens: int = DEFAULT_CALIB_TOKENS) -> list[int]:
    """The ``num_drop`` layers with the lowest Block Influence (cached per engine and calibration)."""
    L = engine.num_layers
    if not 0 <= num_drop < L:
        raise InvalidArgumentError(f"can drop 0-{L - 1} of the model's {L} layers, got {num_drop}")
    cache = _BLOCK_INFLUENCE.setdefault(engine, {})
    key = (str(calib), num_tokens)
    if key not in cache:
        cache[key] = block_influence(engine, calibration_ids(engine, calib, num_tokens))
    bi = cache[key]
    return sorted(int(i) for i in torch.argsort(bi)[:num_drop])


class LayerSubset(Mode):
    """The model restricted to ``kept`` decoder layers (static pruning / naive early exit).

    Args:
        kept: sorted layer indices to run.
        head: exit head ``fn(hidden [.., d]) -> logits`` (default: the engine's final norm + LM head).
        name: mode name.

    Raises:
        InvalidArgumentError: no kept layer, duplicates or indices out of range.
    """

    def __init__(self, engine, kept: list[int], head=None, name: str = "static"):
        L = engine.num_layers
        kept = [int(i) for i in kept]
        if not kept:
            raise InvalidArgumentError("at least one decoder layer must be kept")
        if len(set(kept)) != len(kept) or any(not 0 <= i < L for i in kept):
            raise InvalidArgumentError(f"kept layers must be distinct indices in 0-{L - 1}, got {kept}")
        self.kept = sorted(kept)
        self.runs = runs(self.kept)
        self.head = head
        self.name = name

    def describe(self) -> str:
        return f"{self.name}(layers={len(self.kept)}, runs={self.runs})"

    @torch.inference_mode()
    def _forward(self, engine, ids: torch.Tensor, last: bool, start: int | None = None, cache=None) -> torch.Tensor:
        """Kept layers only, over ``ids [T]`` at ``start`` in ``cache`` (``cache=None``: stand-alone, no cache)."""
        h, st = engine.begin(ids.reshape(1, -1), start=start, cache=cache, use_cache=cache is not None)
        for a, b in self.runs:
            h = engine.run_layers(a, b, h, st)
        engine.commit(st)
        if last:
            h = h[:, -1:]
        head = engine.head if self.head is None else self.head
        return head(h)[0].float()

    def _emit(self, request, logits) -> list[Emitted]:
        n = len(self.kept)
        return [Emitted(request.sample(logits[-1]), n, {"exit_layer": self.kept[-1] + 1, "compute_layers": n})]

    def prefill(self, engine, request) -> list[Emitted]:
        """The prompt through the kept layers only; ``Emitted.layers`` = number of kept layers."""
        return self._emit(request, self._forward(engine, request.prompt_ids, True, 0, request.cache))

    def step(self, engine, request) -> list[Emitted]:
        return self._emit(request, self._forward(engine, torch.tensor([request.last_token]), True, None,
                                                 request.cache))

    def summary(self, request) -> dict:
        return summarize_events(request.infos)

    @torch.inference_mode()
    def score(self, engine, input_ids) -> ScoreOutput:
        """Batched teacher-forced forward skipping the dropped layers: ``logits [T, V]``."""
        logits = self._forward(engine, input_ids, False)
        return ScoreOutput(logits, torch.full((logits.shape[0],), float(len(self.kept))))
