"""Decoding modes: the one interface every engine configuration implements.

A *mode* is how tokens are computed on top of the engine: full depth here; adaptive depth, static
pruning, naive early exit (``laserlm.depth``) and self-speculative decoding (``laserlm.speculative``)
implement the same interface, and the table of named modes is built above them, in :mod:`laserlm.modes`
(``make_mode``). Generation, evaluation and benchmarks only talk to this interface, so every metric
runs for every configuration.

A mode is written as a spec string ``NAME[:key=value,key=value...]``, e.g. ``full``,
``adaptive:policy=confidence,threshold=0.9`` or ``speculative:draft_layers=12,k=4``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..errors import InvalidArgumentError
from .generate import TokenEvent, full_depth_tokens
from .sampling import SamplingParams


@dataclass
class ScoreOutput:
    """Teacher-forced scoring of a sequence: ``logits [T, V]`` float32 predicting positions 1..T,
    and ``layers [T]`` decoder layers run per position."""

    logits: torch.Tensor
    layers: torch.Tensor


class DecodingMode(Protocol):
    """What a decoding mode provides. ``engine`` is a :class:`~laserlm.runtime.engine.Engine`."""

    name: str

    def tokens(self, engine, prompt_ids: torch.Tensor, params: SamplingParams,
               max_tokens: int) -> Iterator[TokenEvent]:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids [T]`` (resets the engine's cache)."""

    def score(self, engine, input_ids: torch.Tensor) -> ScoreOutput:
        """Teacher-forced logits of every position of ``input_ids [T]`` under this mode."""


class FullDepth:
    """The unmodified model: every token runs every decoder layer."""

    name = "full"

    def tokens(self, engine, prompt_ids, params, max_tokens):
        return full_depth_tokens(engine, prompt_ids, params, max_tokens)

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
