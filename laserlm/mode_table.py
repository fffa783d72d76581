"""The table of named decoding modes, built explicitly from the mode packages (no import-time registration).

The mode interface (:class:`~laserlm.runtime.modes.Mode`), the reference :class:`~laserlm.runtime.modes.FullDepth`
and the spec syntax (:func:`~laserlm.runtime.modes.parse_spec`, ``NAME[:key=value,...]``) live in the runtime;
this module sits above the runtime and the modes and maps names to factories ``factory(engine, **options)``:

| name | factory | package |
|---|---|---|
| ``full`` | :class:`~laserlm.runtime.modes.FullDepth` (no options) | :mod:`laserlm.runtime` |
| ``adaptive`` | :func:`laserlm.depth.make_adaptive` | :mod:`laserlm.depth` |
| ``static`` | :func:`laserlm.depth.make_static` | :mod:`laserlm.depth` |
| ``early-exit`` | :func:`laserlm.depth.make_early_exit` | :mod:`laserlm.depth` |
| ``routed`` | :func:`laserlm.depth.make_routed` | :mod:`laserlm.depth` |
| ``speculative`` | :func:`laserlm.speculative.make_speculative` | :mod:`laserlm.speculative` |

On the onnxruntime engine (:class:`~laserlm.runtime.ort_engine.OnnxEngine`) the table is :data:`ONNX_MODES`:
``full`` and ``adaptive`` (:func:`laserlm.depth.ort.make_adaptive_onnx`).

The API, the CLI and the tools (evaluation, bench, training) build modes with :func:`make_mode`;
:func:`register_mode` adds a name (tests and extensions). A *configuration* (``eval`` / ``bench``) is a mode
spec with an optional attention spec, ``MODE_SPEC[@ATTENTION]``: :func:`split_config`, :func:`config_kernel`.
"""

from __future__ import annotations

from typing import Callable

from .depth import make_adaptive, make_early_exit, make_routed, make_static
from .depth.ort import make_adaptive_onnx
from .errors import InvalidArgumentError
from .runtime.modes import Mode, FullDepth, parse_spec
from .runtime.ort_engine import OnnxEngine
from .speculative import make_speculative


def make_full(engine, **opts) -> FullDepth:
    """Factory of mode ``full`` (every token runs every decoder layer).

    Raises:
        InvalidArgumentError: any option (``full`` takes none).
    """
    if opts:
        raise InvalidArgumentError(f"mode 'full' takes no options, got {', '.join(opts)}")
    return FullDepth()


# name -> factory(engine, **options) -> Mode; options are the parsed key=value pairs (strings)
MODES: dict[str, Callable] = {
    "full": make_full,
    "adaptive": make_adaptive,
    "static": make_static,
    "early-exit": make_early_exit,
    "routed": make_routed,
    "speculative": make_speculative,
}


# the modes of the onnxruntime engine (laserlm.runtime.ort_engine): its graphs run whole layer groups, the
# propagate bridge and the exported exit heads
ONNX_MODES: dict[str, Callable] = {"full": make_full, "adaptive": make_adaptive_onnx}


def register_mode(name: str, factory: Callable) -> None:
    """Make ``factory(engine, **options) -> Mode`` available as mode ``name``."""
    MODES[name] = factory


def make_mode(spec, engine) -> Mode:
    """Build a mode from a spec string ``NAME[:key=value,...]`` (or return a mode object unchanged).

    Raises:
        InvalidArgumentError: unknown mode name (the known ones are listed) or bad options.
    """
    if not isinstance(spec, str):
        return spec
    name, opts = parse_spec(spec)
    if isinstance(engine, OnnxEngine):  # the exported graphs run two of the modes
        if name not in ONNX_MODES:
            raise InvalidArgumentError(f"the onnxruntime backend runs modes {' and '.join(repr(m) for m in ONNX_MODES)}, "
                                       f"not '{name}'")
        return ONNX_MODES[name](engine, **opts)
    if name not in MODES:
        raise InvalidArgumentError(f"unknown mode '{name}'; available modes: {', '.join(sorted(MODES))}")
    return MODES[name](engine, **opts)


_KEEP = object()


def split_config(config: str) -> tuple[str, str | None]:
    """``"MODE_SPEC[@ATTENTION]"`` -> ``(mode_spec, attention_spec or None)``, e.g.
    ``"full@sparse:threshold=0.5"`` -> ``("full", "sparse:threshold=0.5")``."""
    mode, sep, attn = config.partition("@")
    return mode, (attn if sep else None)


def config_kernel(engine, config: str, default=_KEEP):
    """The attention kernel a configuration runs with: its ``@ATTENTION`` part (block-sparse attention,
    :func:`laserlm.attention.kernel.configure`), else ``default`` (``_KEEP``: the engine's current kernel).
    The reference ``"full"`` always runs dense. The engine's kernel is left unchanged."""
    _, attn = split_config(config)
    if attn is not None and isinstance(engine, OnnxEngine):
        raise InvalidArgumentError(f"the onnxruntime backend has dense attention only: drop '@{attn}' from "
                                   f"configuration '{config}'")
    if attn is None:
        return None if config == "full" else (engine.kernel if default is _KEEP else default)
    from .attention.kernel import configure  # noqa: PLC0415

    saved = engine.kernel
    try:
        return configure(engine, attn)
    finally:
        engine.kernel = saved
