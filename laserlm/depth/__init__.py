"""Adaptive depth: layer groups, exit policies, exit heads/gates, bridges, the adaptive mode, and the
static baselines (ShortGPT pruning, naive early exit).

Its three decoding-mode factories (named in :mod:`laserlm.mode_table`):

- ``adaptive:groups=5,policy=confidence,threshold=0.9,measure=max,min_depth=8,patience=3,bridge=propagate``
  (other options: ``saturation_threshold``, ``ats_threshold``, ``ats_layer``, ``gate_threshold``,
  ``combine=all|any``, ``compensation=MAX_CHANGE``, ``laser=PATH`` for trained heads/gates,
  ``score=decode|replay`` for evaluation), ``policy=predictor`` (the laser file's pre-layer complexity predictor, ``predictor_threshold``);
  policies join with ``+`` (``policy=confidence+ats``, ``policy=predictor+gate``);
- ``static:layers=K`` (keep K layers, drop the lowest Block Influence ones, ``calib=PATH`` text) or
  ``static:drop=12/13/14``;
- ``early-exit:layer=N`` (every token stops after N layers; ``laser=PATH`` for a trained head);
- ``routed:laser=PATH`` (seed 004's router: each request runs the layers of the route its layer-1 state picks,
  skipping middle layers or stopping at an exit head; ``confidence=P`` overrides the certified threshold).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..errors import InvalidArgumentError
from ..runtime.options import convert, from_spec
from .bridge import BRIDGES, make_bridge, project_kv
from .groups import LayerGroups, default_min_depth, make_groups
from .heads import ExitGate, ExitHead, gate_scalars_batch
from .laser_file import DEFAULT_BRIDGE, LaserArtifact, load_laser_file, save_laser_file
from .policies import (AllOf, AnyOf, AttentionTransition, BatchPoint, Compensation, Confidence, ExitPolicy,
                       GatePolicy, Never, Saturation, make_policy)
from .pruning import LayerSubset, block_influence, pruned_layers
from .router import DynamicRouter, Route, RoutedDepth
from .adaptive import AdaptiveDepth

__all__ = ["AdaptiveDepth", "AdaptiveOptions", "AllOf", "AnyOf", "AttentionTransition", "BRIDGES", "Compensation",
           "Confidence", "BatchPoint", "DEFAULT_BRIDGE", "DynamicRouter", "EarlyExitOptions", "ExitGate", "ExitHead",
           "ExitPolicy", "GatePolicy", "LaserArtifact", "LayerGroups", "LayerSubset", "Never", "Route", "RoutedDepth",
           "RoutedOptions", "Saturation", "StaticOptions", "adaptive_settings", "block_influence", "default_min_depth", "gate_scalars_batch", "load_laser_file",
           "make_adaptive", "make_bridge", "make_early_exit", "make_groups", "make_policy", "make_routed", "make_static", "project_kv",
           "pruned_layers", "save_laser_file"]


class _ModeOptions:
    """Messages shared by the depth modes' options (parsed by :func:`laserlm.runtime.options.from_spec`)."""

    UNKNOWN_MESSAGE = "unknown option(s) for mode '{what}': {unknown}; known: {known}"


@dataclass
class AdaptiveOptions(_ModeOptions):
    """Options of mode ``adaptive`` (see the package docstring); ``None``: not given (the laser file's value,
    else the default)."""

    groups: Any = None  # a group size, a spec string or a list: parsed by make_groups
    policy: Optional[str] = None
    threshold: Optional[float] = None
    measure: Optional[str] = None
    min_depth: Optional[int] = None
    patience: Optional[int] = None
    bridge: Optional[str] = None
    saturation_threshold: Optional[float] = None
    ats_threshold: Optional[float] = None
    ats_layer: Optional[int] = None
    gate_threshold: Optional[float] = None
    predictor_threshold: Optional[float] = None
    combine: str = "all"
    compensation: Optional[float] = None
    laser: Optional[str] = None
    score: Optional[str] = None


def _layer_indices(value):
    if value is None:
        return None
    if isinstance(value, str):
        return [int(x) for x in value.split("/") if x.strip()]
    return [convert(int, x) for x in value]


@dataclass
class StaticOptions(_ModeOptions):
    """Options of mode ``static``: ``layers=K`` (with ``calib``, ``calib_tokens``) or ``drop=i/j/k``."""

    layers: Optional[int] = None
    drop: Optional[list] = field(default=None, metadata={"parse": _layer_indices,
                                                         "expect": "layer indices joined by '/'"})
    calib: Optional[str] = None
    calib_tokens: Optional[int] = None


@dataclass
class EarlyExitOptions(_ModeOptions):
    """Options of mode ``early-exit``: ``layer=N`` and an optional ``laser=PATH``."""

    layer: Optional[int] = None
    laser: Optional[str] = None


@dataclass
class RoutedOptions(_ModeOptions):
    """Options of mode ``routed``: ``laser=PATH`` (a laser file with a router) and an optional ``confidence``."""

    laser: Optional[str] = None
    confidence: Optional[float] = None


ADAPTIVE_OPTIONS = ", ".join(f.name for f in fields(AdaptiveOptions))


def _given(value, default):
    return default if value is None else value


POLICY_OPTIONS = (("saturation_threshold", "saturation"), ("ats_threshold", "ats"), ("gate_threshold", "gate"),
                  ("predictor_threshold", "predictor"))  # an option and the policy that reads it


def adaptive_settings(o: AdaptiveOptions, art, num_layers: int, vocab_size: int) -> tuple:
    """``(groups, policy, bridge name, patience, ats_layer)`` of mode ``adaptive`` from its parsed options ``o``
    and a laser artifact ``art`` (or ``None``): a given option wins, else the file's value, else the default.
    Shared by :func:`make_adaptive` and :func:`laserlm.depth.ort.make_adaptive_onnx` (the onnxruntime engine), so both
    run the same exit rule.

    Raises:
        InvalidArgumentError: bad groups, thresholds or policy names.
    """
    file_cfg = art.config if art else {}
    file_thr = art.thresholds if art else {}
    names = _given(o.policy, file_cfg.get("policy", "confidence"))
    listed = {p.strip() for p in str(names).split("+")}
    unused = [(opt, name) for opt, name in POLICY_OPTIONS if getattr(o, opt) is not None and name not in listed]
    if unused:
        given = ", ".join(f"{opt}={getattr(o, opt)}" for opt, _ in unused)
        needed = "+".join(name for _, name in unused)
        raise InvalidArgumentError(f"adaptive option(s) {given} set a policy that policy={names} does not run; name "
                                   f"it, e.g. policy={needed} (or policy={names}+{needed})")
    groups = make_groups(_given(o.groups, file_cfg.get("groups")), num_layers,
                         _given(o.min_depth, file_cfg.get("min_depth")))
    policy = make_policy(
        names,
        threshold=_given(o.threshold, file_thr.get("threshold")),
        measure=_given(o.measure, file_cfg.get("measure", "max")),
        saturation_threshold=o.saturation_threshold,
        ats_threshold=o.ats_threshold,
        gate_threshold=_given(o.gate_threshold, file_thr.get("gate_threshold")),
        combine=o.combine,
        # a laser file's veto belongs to the policy it was certified with (the file's own, named or not; another
        # policy= runs without it unless compensation= is given)
        compensation=_given(o.compensation, file_thr.get("compensation")
                            if o.policy is None or o.policy == file_cfg.get("policy") else None),
        gates=art.gates if art else None,
        vocab_size=vocab_size,
        predictor=art.predictor if art else None,
        predictor_threshold=_given(o.predictor_threshold, file_thr.get("predictor_threshold")),
    )
    file_bridge = art.bridge if art else DEFAULT_BRIDGE  # a laser file: what it was calibrated for
    if art is not None and o.policy is not None and "predictor" in o.policy:  # the predictor's own certificate
        file_bridge = file_cfg.get("predictor_bridge", file_bridge)
    bridge = _given(o.bridge, file_bridge)
    patience = _given(o.patience, art.patience if art else 3)  # a laser file: what it was certified with
    ats_layer = _given(o.ats_layer, file_cfg.get("ats_layer"))
    return groups, policy, bridge, patience, ats_layer


def make_adaptive(engine, **opts) -> AdaptiveDepth:
    """Factory of mode ``adaptive`` (options as strings or values, :class:`AdaptiveOptions`; see the package
    docstring).

    Raises:
        InvalidArgumentError: unknown options, bad values (groups, thresholds, bridge, patience ...).
    """
    o = from_spec(AdaptiveOptions, opts, "adaptive")
    art = None
    laser_path = o.laser
    if laser_path is not None:
        art = load_laser_file(laser_path, engine)
    L = engine.num_layers
    groups, policy, bridge, patience, ats_layer = adaptive_settings(o, art, L, engine.config.vocab_size)
    return AdaptiveDepth(engine, groups, policy, make_bridge(bridge), patience=patience,
                         heads=art.heads if art else None, ats_layer=ats_layer, score=o.score)


def make_routed(engine, **opts) -> RoutedDepth:
    """Factory of mode ``routed`` (:class:`RoutedOptions`): the laser file's router and, for its cap routes, its
    exit heads.

    Raises:
        InvalidArgumentError: no ``laser=``, a file without a router (or with an older one), a confidence outside
            [0, 1].
    """
    o = from_spec(RoutedOptions, opts, "routed")
    if o.laser is None:
        raise InvalidArgumentError("mode 'routed' needs laser=PATH: a laser file with a router "
                                   "(`laserlm calibrate` with --router-prompts > 0)")
    art = load_laser_file(o.laser, engine)
    if art.router is None:
        raise InvalidArgumentError(art.router_note or f"{o.laser} has no router; calibrate with --router-prompts > 0")
    return RoutedDepth(engine, art.router, art.heads, o.confidence)


def make_static(engine, **opts) -> LayerSubset:
    """Factory of mode ``static`` (ShortGPT static pruning): ``layers=K`` kept (lowest Block Influence dropped,
    computed on ``calib=PATH``, default WikiText-2 valid, ``calib_tokens=N``) or ``drop=i/j/k``
    (:class:`StaticOptions`)."""
    o = from_spec(StaticOptions, opts, "static")
    L = engine.num_layers
    if o.drop is not None:
        extra = [k for k in ("layers", "calib", "calib_tokens") if getattr(o, k) is not None]
        if extra:
            raise InvalidArgumentError(f"mode 'static' takes drop=i/j/k or layers=K (with calib, calib_tokens), "
                                       f"not both: drop was given with {', '.join(extra)}")
        drop = o.drop
        bad = [i for i in drop if not 0 <= i < L]
        if bad:
            raise InvalidArgumentError(f"layer {bad[0]} is out of range: the model has layers 0-{L - 1}")
    else:
        keep = o.layers
        if keep is None:
            raise InvalidArgumentError("mode 'static' needs layers=K (layers to keep) or drop=i/j/k")
        if not 1 <= keep <= L:
            raise InvalidArgumentError(f"layers must be in 1-{L}, got {keep}")
        drop = pruned_layers(engine, L - keep, o.calib, _given(o.calib_tokens, 2048))
    return LayerSubset(engine, [i for i in range(L) if i not in set(drop)], name="static")


def make_early_exit(engine, **opts) -> LayerSubset:
    """Factory of mode ``early-exit``: ``layer=N`` (every token stops after N layers), ``laser=PATH`` (use the
    trained exit head at N if the file has one; :class:`EarlyExitOptions`)."""
    o = from_spec(EarlyExitOptions, opts, "early-exit")
    L = engine.num_layers
    layer = o.layer
    if layer is None:
        raise InvalidArgumentError("mode 'early-exit' needs layer=N (the fixed exit layer)")
    if not 1 <= layer <= L:
        raise InvalidArgumentError(f"exit layer must be in 1-{L}, got {layer}")
    head = None
    if o.laser is not None:
        head = load_laser_file(o.laser, engine).heads.get(layer)
    return LayerSubset(engine, list(range(layer)), head=head, name="early-exit")
