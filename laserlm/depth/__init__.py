"""Adaptive depth: layer groups, exit policies, exit heads/gates, bridges, the adaptive scheduler, and the
static baselines (ShortGPT pruning, naive early exit).

Its three decoding-mode factories (named in :mod:`laserlm.modes`):

- ``adaptive:groups=5,policy=confidence,threshold=0.9,measure=max,min_depth=8,patience=3,bridge=propagate``
  (other options: ``saturation_threshold``, ``ats_threshold``, ``ats_layer``, ``gate_threshold``,
  ``combine=all|any``, ``compensation=MAX_CHANGE``, ``laser=PATH`` for trained heads/gates,
  ``score=decode|replay`` for evaluation, ``router=1`` to let the file's sequence-level router cap the depth of
  each request); policies join with ``+`` (``policy=confidence+ats``);
- ``static:layers=K`` (keep K layers, drop the lowest Block Influence ones, ``calib=PATH`` text) or
  ``static:drop=12/13/14``;
- ``early-exit:layer=N`` (every token stops after N layers; ``laser=PATH`` for a trained head).
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .bridge import BRIDGES, make_bridge, project_kv
from .groups import LayerGroups, default_min_depth, make_groups
from .heads import ExitGate, ExitHead, gate_scalars_batch
from .laser_file import DEFAULT_BRIDGE, LaserArtifact, load_laser_file, save_laser_file
from .policies import (AllOf, AnyOf, AttentionTransition, BatchPoint, Compensation, Confidence, ExitPolicy,
                       GatePolicy, Never, Saturation, make_policy)
from .pruning import LayerSubset, block_influence, pruned_layers
from .router import DynamicRouter
from .scheduler import AdaptiveDepth

__all__ = ["AdaptiveDepth", "AllOf", "AnyOf", "AttentionTransition", "BRIDGES", "Compensation", "Confidence",
           "BatchPoint", "DEFAULT_BRIDGE", "DynamicRouter", "ExitGate", "ExitHead", "ExitPolicy", "GatePolicy",
           "LaserArtifact", "LayerGroups", "LayerSubset", "Never", "Saturation", "block_influence", "default_min_depth",
           "gate_scalars_batch",
           "load_laser_file", "make_adaptive", "make_bridge", "make_early_exit", "make_groups", "make_policy",
           "make_static", "project_kv", "pruned_layers", "save_laser_file"]


def _num(opts: dict, key: str, kind=float, default=None):
    if key not in opts:
        return default
    value = opts.pop(key)
    if not isinstance(value, str):
        return value
    try:
        return kind(value)
    except ValueError:
        raise InvalidArgumentError(f"option {key} must be {'an integer' if kind is int else 'a number'}, "
                                   f"got '{value}'") from None


def _reject_unknown(mode: str, opts: dict, known: str) -> None:
    if opts:
        raise InvalidArgumentError(f"unknown option(s) for mode '{mode}': {', '.join(sorted(opts))}; known: {known}")


ADAPTIVE_OPTIONS = ("groups, policy, threshold, measure, min_depth, patience, bridge, saturation_threshold, "
                    "ats_threshold, ats_layer, gate_threshold, combine, compensation, laser, score, router")


def make_adaptive(engine, **opts) -> AdaptiveDepth:
    """Factory of mode ``adaptive`` (options as strings or values; see the package docstring).

    Raises:
        InvalidArgumentError: unknown options, bad values (groups, thresholds, bridge, patience ...).
    """
    opts = dict(opts)
    art = None
    laser_path = opts.pop("laser", None)
    if laser_path is not None:
        art = load_laser_file(laser_path, engine)
    file_cfg = art.config if art else {}
    file_thr = art.thresholds if art else {}
    L = engine.num_layers
    groups = make_groups(opts.pop("groups", file_cfg.get("groups")), L,
                         _num(opts, "min_depth", int, file_cfg.get("min_depth")))
    policy = make_policy(
        opts.pop("policy", file_cfg.get("policy", "confidence")),
        threshold=_num(opts, "threshold", float, file_thr.get("threshold")),
        measure=opts.pop("measure", file_cfg.get("measure", "max")),
        saturation_threshold=_num(opts, "saturation_threshold"),
        ats_threshold=_num(opts, "ats_threshold"),
        gate_threshold=_num(opts, "gate_threshold", float, file_thr.get("gate_threshold")),
        combine=opts.pop("combine", "all"),
        compensation=_num(opts, "compensation"),
        gates=art.gates if art else None,
        vocab_size=engine.config.vocab_size,
    )
    bridge = opts.pop("bridge", art.bridge if art else DEFAULT_BRIDGE)  # a laser file: what it was calibrated for
    patience = _num(opts, "patience", int, file_cfg.get("patience", 3))
    ats_layer = _num(opts, "ats_layer", int, file_cfg.get("ats_layer"))
    score = opts.pop("score", None)
    router = None
    flag = str(opts.pop("router", "0")).lower()
    if flag not in ("0", "1", "true", "false", "yes", "no"):
        raise InvalidArgumentError(f"router must be 0 or 1, got '{flag}'")
    if flag in ("1", "true", "yes"):
        if art is None or art.router is None:
            raise InvalidArgumentError("router=1 needs a laser file with a trained router (laser=PATH from "
                                       "`laserlm calibrate` with --router-prompts > 0)")
        router = art.router
    _reject_unknown("adaptive", opts, ADAPTIVE_OPTIONS)
    return AdaptiveDepth(engine, groups, policy, make_bridge(bridge), patience=patience,
                         heads=art.heads if art else None, ats_layer=ats_layer, score=score, router=router)


def make_static(engine, **opts) -> LayerSubset:
    """Factory of mode ``static`` (ShortGPT static pruning): ``layers=K`` kept (lowest Block Influence dropped,
    computed on ``calib=PATH``, default WikiText-2 valid, ``calib_tokens=N``) or ``drop=i/j/k``."""
    opts = dict(opts)
    L = engine.num_layers
    if "drop" in opts:
        raw = opts.pop("drop")
        try:
            drop = [int(x) for x in str(raw).split("/") if x.strip()] if isinstance(raw, str) else list(raw)
        except ValueError:
            raise InvalidArgumentError(f"drop must be layer indices joined by '/', got '{raw}'") from None
        bad = [i for i in drop if not 0 <= i < L]
        if bad:
            raise InvalidArgumentError(f"layer {bad[0]} is out of range: the model has layers 0-{L - 1}")
    else:
        keep = _num(opts, "layers", int)
        if keep is None:
            raise InvalidArgumentError("mode 'static' needs layers=K (layers to keep) or drop=i/j/k")
        if not 1 <= keep <= L:
            raise InvalidArgumentError(f"layers must be in 1-{L}, got {keep}")
        drop = pruned_layers(engine, L - keep, opts.pop("calib", None),
                             _num(opts, "calib_tokens", int, 2048))
    _reject_unknown("static", opts, "layers, drop, calib, calib_tokens")
    return LayerSubset(engine, [i for i in range(L) if i not in set(drop)], name="static")


def make_early_exit(engine, **opts) -> LayerSubset:
    """Factory of mode ``early-exit``: ``layer=N`` (every token stops after N layers), ``laser=PATH`` (use the
    trained exit head at N if the file has one)."""
    opts = dict(opts)
    L = engine.num_layers
    layer = _num(opts, "layer", int)
    if layer is None:
        raise InvalidArgumentError("mode 'early-exit' needs layer=N (the fixed exit layer)")
    if not 1 <= layer <= L:
        raise InvalidArgumentError(f"exit layer must be in 1-{L}, got {layer}")
    head = None
    if "laser" in opts:
        head = load_laser_file(opts.pop("laser"), engine).heads.get(layer)
    _reject_unknown("early-exit", opts, "layer, laser")
    return LayerSubset(engine, list(range(layer)), head=head, name="early-exit")

