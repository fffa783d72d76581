"""The ``speculative`` mode spec -> a configured :class:`~.self_speculative.SpeculativeDecoding`: its options
(:class:`SpeculativeOptions`, parsed by :func:`laserlm.runtime.options.from_spec`), which options go with which draft
source, the files a spec names (a laser file's exit head, a draft head) and the ``auto`` choices (a short greedy
calibration, a measured verify cost)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Optional, Union

import torch

from ..errors import InvalidArgumentError
from ..runtime.options import from_spec
from .policy import packed_verify_table
from .proposers import parse_draft
from .self_speculative import LOOKUP, SpeculativeDecoding

AUTO_OPTIONS = ("draft_layers", "k", "threshold")


@dataclass
class SpeculativeOptions:
    """Options of mode ``speculative`` (parsed by :func:`laserlm.runtime.options.from_spec`); ``None``: not
    given (the :class:`SpeculativeDecoding` default); ``"auto"``: chosen by the calibration."""

    draft_layers: Optional[Union[int, Literal["auto"]]] = None
    k: Optional[Union[int, Literal["auto"]]] = None
    threshold: Optional[Union[float, Literal["auto"]]] = None
    reuse: Optional[bool] = None
    auto: bool = False
    laser: Optional[str] = None
    draft: Optional[str] = None
    max_ngram: Optional[int] = None
    min_match: Optional[int] = None
    adaptive: Optional[bool] = None
    suffix_tokens: Optional[int] = None
    verify_cost: Optional[Union[float, Literal["auto", "prior"]]] = field(default=None,
                                                                     metadata={"expect": "a number, auto or prior"})
    verify_base: Optional[float] = None
    batch_above: Optional[int] = None
    head: Optional[str] = None
    head_threshold: Optional[float] = None
    head_cost: Optional[float] = None
    loss_budget: Optional[Union[float, Literal["off"]]] = field(
        default=None, metadata={"expect": "a number of plain steps in [0, 64] or off"})


LAYERS_ONLY = ("draft_layers", "threshold", "reuse", "laser")  # options of the shallow-path draft
LOOKUP_OPTIONS = ("max_ngram", "min_match")
HEAD_OPTIONS = ("head", "head_threshold", "head_cost")
DRAFT_OPTIONS = ("draft", "max_ngram", "min_match", "adaptive", "suffix_tokens", "verify_cost", "verify_base",
                 "head", "head_threshold", "head_cost",
                 "batch_above", "loss_budget")
OPTIONS = tuple(f.name for f in fields(SpeculativeOptions))


def laser_exit_head(engine, path, draft_layers: int | None) -> tuple[int, torch.nn.Module, str]:
    """The calibrated exit head of the laser file ``path`` at the draft depth.

    Args:
        engine: the engine the file must have been made for (architecture + weight hash checked by
            :func:`laserlm.depth.laser_file.load_laser_file`).
        path: laser file written by ``laserlm calibrate --output`` (or :func:`save_laser_file`).
        draft_layers: draft depth ``N`` (the head stored for exit layer ``N``, i.e. after layers
            ``0..N-1``, is used); ``None`` = the file's exit point in ``[1, L-1]`` closest to ``L // 2``
            (ties: the shallower).

    Returns:
        ``(draft_layers, head, name)``; ``head`` maps ``hidden [B, T, d] -> logits [B, T, V]`` float32.

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a (readable) laser file.
        InvalidArgumentError: the file was made for another model; it has no exit head at
            ``draft_layers`` (the message lists the exit layers it has) or none shallower than ``L``.
    """
    from pathlib import Path  # noqa: PLC0415

    from ..depth.laser_file import load_laser_file  # noqa: PLC0415

    art = load_laser_file(path, engine)
    n_layers = engine.num_layers
    exits = sorted(int(e) for e in art.heads)
    usable = [e for e in exits if 1 <= e < n_layers]
    listed = ", ".join(map(str, exits)) or "none"
    if draft_layers is None:
        if not usable:
            raise InvalidArgumentError(f"laser file {path} has no exit head shallower than the model's {n_layers} "
                                       f"layers to draft with (its exit layers: {listed})")
        draft_layers = min(usable, key=lambda e: (abs(e - n_layers // 2), e))
    elif draft_layers not in art.heads:
        raise InvalidArgumentError(f"laser file {path} has no exit head at draft_layers={draft_layers}; "
                                   f"its exit layers are: {listed}")
    return draft_layers, art.heads[draft_layers], f"laser:{Path(path).name}@{draft_layers}"


def make_speculative(engine, **opts) -> SpeculativeDecoding:
    """``speculative:draft_layers=N,k=K,threshold=T,reuse=0|1[,laser=PATH][,draft=ngram+suffix+layers,max_ngram=3,
    min_match=1,adaptive=0|1,suffix_tokens=65536,verify_cost=0.36|auto|prior,verify_base=0.34][,batch_above=2]
    [,loss_budget=1|off][,head=PATH,head_threshold=0,head_cost=0.11]`` -> :class:`SpeculativeDecoding`.

    ``draft=...+head`` loads the draft head file ``head`` (default: the one shipped for a bundled model); errors as
    :func:`~.draft_head.load_draft_head` (a file made for other weights is refused).

    Without ``verify_cost`` / ``verify_base``, lookup and head drafts on packed weights (``Engine.fast_rows`` set:
    ``native``, ``int4``, ``int8``) use this machine's verify cost table,
    :func:`~laserlm.speculative.calibration.machine_verify_table`: measured once per CPU, kernel variant, thread
    count and model shape (about a second), then read from laserlm's cache (reported as ``verify_fit`` with its
    ``source``; ``verify_cost`` / ``verify_base`` are then reported as ``None``). ``verify_cost=prior`` uses the
    kernel variant's fixed table instead, :func:`~.policy.packed_verify_table` (``"source": "packed-weights
    prior"``; no measurement). Float weights and ``draft=layers`` alone use the log model with the defaults
    above. On packed weights ``verify_cost=auto`` measures only the widths up to ``fast_rows``, every time.
    ``verify_cost=auto`` measures the verify cost curve of this engine on this machine (about a second on
    smollm2-135m; :func:`~laserlm.speculative.calibration.fit_verify_cost`); the policy then interpolates the
    measured table (``verify_fit["measured"]``, reported in the stats with the fitted ``verify_cost`` and
    ``verify_base``). The measurement is timing, so two
    processes may fit slightly different costs and take different drafts (greedy output is the same; seeded
    sampling then draws other, equally distributed, tokens).

    ``draft`` names the draft sources (module docstring); the shallow-path options (``draft_layers``,
    ``threshold``, ``reuse``, ``laser``, ``auto``) need ``layers`` among them, ``max_ngram`` / ``min_match`` a
    lookup source, ``suffix_tokens`` the ``suffix`` source.

    ``draft_layers``, ``k`` and ``threshold`` accept ``auto``; ``auto=1`` makes every option not
    given ``auto``. Auto options are chosen by :func:`~laserlm.speculative.calibration.calibrate`
    (about a minute of greedy decoding on WikiText-2 valid / ARC-Easy dev for smollm2-135m on 2 CPU cores,
    announced by one line on stderr, with a tqdm bar on a terminal), whose search is kept in
    ``mode.calibration`` and reported in the generation stats.

    ``laser=PATH`` drafts with the laser file's calibrated exit head at the draft depth (see
    :func:`laser_exit_head` for the default depth and the errors).

    Raises:
        InvalidArgumentError: unknown option, malformed or out-of-range value (e.g. ``max_ngram`` outside
            ``[1, 16]``), an unknown draft source, an option of a draft source ``draft`` does not name,
            missing calibration data,
            a laser file for another model or without a head at the draft depth.
        ModelNotFoundError / CorruptModelError: the laser file is missing / unreadable.
    """
    o = from_spec(SpeculativeOptions, opts, "speculative")
    sources = parse_draft(o.draft) if o.draft is not None else ("layers",)
    draft_kwargs = {key: getattr(o, key) for key in DRAFT_OPTIONS if getattr(o, key) is not None}
    if "layers" not in sources:
        given = [key for key in (*LAYERS_ONLY, "auto") if getattr(o, key) not in (None, False)]
        if o.k == "auto":
            given.append("k=auto")
        if given:
            raise InvalidArgumentError(f"speculative option(s) {', '.join(given)} set the shallow-path draft, "
                                       f"which draft={o.draft} does not use (add +layers to draft)")
    if not any(s in LOOKUP for s in sources):
        given = [key for key in (*LOOKUP_OPTIONS, "suffix_tokens") if getattr(o, key) is not None]
        if given:
            raise InvalidArgumentError(f"speculative option(s) {', '.join(given)} set the n-gram / suffix drafts; "
                                       f"name them in draft= (e.g. draft=ngram+layers)")
    given = [key for key in HEAD_OPTIONS if getattr(o, key) is not None]
    if given and "head" not in sources:
        raise InvalidArgumentError(f"speculative option(s) {', '.join(given)} set the draft head; add +head to draft "
                                   f"(e.g. draft=head+ngram)")
    if "head" in sources:
        from .draft_head import load_draft_head, shipped_head_path, shipped_heads  # noqa: PLC0415

        if o.head is not None and not str(o.head).strip():
            raise InvalidArgumentError("speculative option head needs a draft head file path (head=PATH), or leave "
                                       "it out for the head a bundled model ships")
        path = o.head if o.head is not None else shipped_head_path(engine)
        if path is None:
            raise InvalidArgumentError("draft=head needs a draft head file (head=PATH): laserlm ships none for this "
                                       f"model (it ships heads for: {', '.join(shipped_heads()) or 'none'}); train "
                                       "one with `laserlm train-draft-head -m MODEL -o PATH`")
        from pathlib import Path  # noqa: PLC0415

        draft_kwargs["draft_head"], _ = load_draft_head(path, engine)
        draft_kwargs["head_name"] = Path(path).name
        draft_kwargs.pop("head", None)
    if o.suffix_tokens is not None and "suffix" not in sources:
        raise InvalidArgumentError(f"speculative option suffix_tokens bounds the suffix cache; draft={o.draft} "
                                   "does not use it (add +suffix to draft)")
    if o.auto:
        for key in AUTO_OPTIONS:
            if getattr(o, key) is None:
                setattr(o, key, "auto")
    auto = {key for key in AUTO_OPTIONS if getattr(o, key) == "auto"}
    kwargs: dict = {key: getattr(o, key) for key in (*AUTO_OPTIONS, "reuse")
                    if getattr(o, key) is not None and key not in auto}
    kwargs.update(draft_kwargs)
    if o.laser is not None:
        if "draft_layers" in auto:
            raise InvalidArgumentError("draft_layers=auto is not supported with laser=: give draft_layers=N "
                                       "(one of the laser file's exit layers) or omit it")
        if not o.laser.strip():
            raise InvalidArgumentError("speculative option laser needs a laser file path (laser=PATH)")
        SpeculativeDecoding(engine.num_layers, **kwargs)  # validate the numbers before reading the file
        kwargs["draft_layers"], kwargs["exit_head"], kwargs["exit_head_name"] = laser_exit_head(
            engine, o.laser, kwargs.get("draft_layers"))
    verify_fit = None
    if o.verify_cost == "auto":
        if o.verify_base is not None:
            raise InvalidArgumentError("verify_cost=auto fits verify_base too: give verify_base only with a "
                                       "numeric verify_cost")
        kwargs.pop("verify_cost")
        SpeculativeDecoding(engine.num_layers, **kwargs)  # validate the rest before measuring
        from .calibration import fit_verify_cost  # noqa: PLC0415

        # packed weights: only the widths the compiled kernel takes (a wider verify is never drafted there)
        verify_fit = (fit_verify_cost(engine) if engine.fast_rows is None else
                      fit_verify_cost(engine, widths=tuple(w for w in packed_verify_table() if w <= engine.fast_rows),
                                      repeats=5))
        kwargs.update(verify_cost=verify_fit["verify_cost"], verify_base=verify_fit["verify_base"])
        draft_kwargs.update(verify_cost=verify_fit["verify_cost"], verify_base=verify_fit["verify_base"])
    elif o.verify_cost == "prior" or (o.verify_cost is None and o.verify_base is None and engine.fast_rows is not None
                                      and any(s in (*LOOKUP, "head") for s in sources)):
        # packed weights: the float32 log-curve underestimates a many-row verify by 2-3x (drafts too long), and one
        # kernel variant's table misprices other CPUs (Zen 4's AVX-512): this machine's own table, measured once
        if engine.fast_rows is None:
            raise InvalidArgumentError("verify_cost=prior is the packed weights' cost table: give --weights native, "
                                       "int8 or int4, or a numeric verify_cost")
        if o.verify_base is not None:
            raise InvalidArgumentError("verify_cost=prior is a table: give verify_base only with a numeric verify_cost")
        kwargs.pop("verify_cost", None)
        draft_kwargs.pop("verify_cost", None)
        if o.verify_cost == "prior":
            verify_fit = {"measured": packed_verify_table(), "source": "packed-weights prior"}
        else:
            from .calibration import machine_verify_table  # noqa: PLC0415

            SpeculativeDecoding(engine.num_layers, **kwargs)  # validate the rest before measuring
            verify_fit = machine_verify_table(engine)
    mode = SpeculativeDecoding(engine.num_layers, **kwargs)  # validates the fixed options first
    mode.verify_fit = verify_fit
    if auto:
        from .calibration import calibrate  # noqa: PLC0415

        fixed = {key: getattr(mode, key) for key in ("draft_layers", "k", "threshold") if key not in auto}
        report = calibrate(engine, exit_head=mode.exit_head, reuse=mode.reuse, **fixed)
        best = report["chosen"]
        mode = SpeculativeDecoding(engine.num_layers, draft_layers=best["draft_layers"], k=best["k"],
                                   threshold=best["threshold"], reuse=mode.reuse, exit_head=mode.exit_head,
                                   exit_head_name=mode.exit_head_name, **draft_kwargs)
        mode.calibration = report
        mode.verify_fit = verify_fit
    return mode


__all__ = ["OPTIONS", "SpeculativeOptions", "laser_exit_head", "make_speculative"]
