"""Decoding modes: the one interface every engine configuration implements.

A *mode* is how tokens are computed on top of the engine: full depth here; adaptive depth, static
pruning, naive early exit (``laserlm.depth``) and self-speculative decoding register themselves in
:data:`MODES`. Generation, evaluation and benchmarks only talk to this interface, so every metric
runs for every configuration.

A mode is written as a spec string ``NAME[:key=value,key=value...]``, e.g. ``full``,
``adaptive:policy=confidence,threshold=0.9`` or ``speculative:draft_layers=12,k=4``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

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


# name -> factory(engine, **options) -> DecodingMode; options are the parsed key=value pairs (strings)
MODES: dict[str, Callable] = {"full": lambda engine, **opts: _no_options("full", opts) or FullDepth()}


def _no_options(name: str, opts: dict):
    if opts:
        raise InvalidArgumentError(f"mode '{name}' takes no options, got {', '.join(opts)}")
    return None


def register_mode(name: str, factory: Callable) -> None:
    """Make ``factory(engine, **options) -> DecodingMode`` available as mode ``name``."""
    MODES[name] = factory


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


def _load_plugins() -> None:
    """Import the packages that register modes (they are optional while under construction)."""
    import importlib  # noqa: PLC0415

    for mod in ("laserlm.depth", "laserlm.speculative"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise


def make_mode(spec, engine) -> DecodingMode:
    """Build a mode from a spec string (or return a mode object unchanged).

    Raises:
        InvalidArgumentError: unknown mode name (the known ones are listed) or bad options.
    """
    if not isinstance(spec, str):
        return spec
    _load_plugins()
    name, opts = parse_spec(spec)
    if name not in MODES:
        raise InvalidArgumentError(f"unknown mode '{name}'; available modes: {', '.join(sorted(MODES))}")
    return MODES[name](engine, **opts)
