"""Mode ``adaptive`` on the onnxruntime engine (:class:`laserlm.runtime.ort_engine.OnnxEngine`).

The same :class:`~laserlm.depth.adaptive.AdaptiveDepth` as on PyTorch, with the exit rule built by the same
:func:`~laserlm.depth.adaptive_settings` from the export's copy of its laser file; only what the exported graphs
fix is checked here: the layer groups and min depth are the exported ones, the exit heads are the exported adapter
graphs, the bridge is ``propagate`` (its ``bridge_<g>`` graphs), and nothing reads attention probabilities or token
embeddings (complexity predictor), which are not graph outputs.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CorruptModelError, InvalidArgumentError
from ..models.files import file_sha256
from ..runtime.options import from_spec
from . import AdaptiveOptions, adaptive_settings, make_groups
from .adaptive import AdaptiveDepth
from .groups import LayerGroups
from .heads import ExitGate
from .laser_file import LaserArtifact, read_metadata
from .policies import find_predictor


def exported_laser(engine) -> LaserArtifact | None:
    """The gates, thresholds and config of the export's copy of its laser file (``None``: exported without one),
    its identity checked against the manifest.

    Raises:
        InvalidArgumentError: the file was made for another model.
        CorruptModelError: gate tensors that do not match their config.
    """
    man = engine.onnx.manifest
    lm = man.get("laser")
    if not lm:
        return None
    path = engine.onnx.path / lm["file"]
    meta, tensors = read_metadata(path)
    if meta.get("weights_sha256") != man["model"]["weights_sha256"]:
        raise InvalidArgumentError(f"{path} was made for another model than the exported one (weight hash differs)")
    d = man["model"]["hidden_size"]
    gates = {}
    for key, gc in meta.get("gates", {}).items():
        gate = ExitGate(d, gc.get("num_scalars"), gc.get("uses_ats", False), gc.get("features", "head"))
        prefix = f"gates.{key}."
        try:
            gate.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        except (RuntimeError, KeyError) as exc:
            raise CorruptModelError(f"{path}: gate tensors do not match its config: {exc}") from None
        gates[int(key)] = gate
    config = dict(meta.get("config", {}))
    config.setdefault("bridge", "propagate")
    return LaserArtifact(gates=gates, thresholds=meta.get("thresholds", {}), config=config, path=path)


def make_adaptive_onnx(engine, **opts) -> AdaptiveDepth:
    """Mode ``adaptive[:options]`` on an :class:`~laserlm.runtime.ort_engine.OnnxEngine` (options as in
    :class:`laserlm.depth.AdaptiveOptions`, e.g. ``threshold=0.9``, ``patience=0``; the laser file is the
    exported one).

    Raises:
        InvalidArgumentError: groups or a laser file other than the exported ones, a bridge other than
            ``propagate``, the complexity predictor, or a policy that needs the attention transition
            score.
    """
    o = from_spec(AdaptiveOptions, opts, "adaptive")
    man = engine.onnx.manifest
    art = exported_laser(engine)
    if o.laser is not None:
        if not Path(o.laser).is_file():
            raise InvalidArgumentError(f"laser file not found: {o.laser}")
        if art is None:
            raise InvalidArgumentError(f"{engine.onnx.path} was exported without a laser file; re-export with "
                                       f"`laserlm export onnx --laser {o.laser}`")
        if file_sha256(Path(o.laser)) != file_sha256(art.path):
            raise InvalidArgumentError(f"laser file {o.laser} is not the one exported to {engine.onnx.path}; "
                                       "re-export with it")
    exported = LayerGroups(tuple(engine.bounds), engine.num_layers, man["min_depth"])
    if o.groups is not None and make_groups(o.groups, engine.num_layers).bounds != exported.bounds:
        raise InvalidArgumentError(f"groups={o.groups} differ from the exported layer groups "
                                   f"{exported.describe()}; re-export with --groups {o.groups}")
    o.groups = [b for _, b in exported.bounds]
    if o.min_depth is None:
        o.min_depth = man["min_depth"]
    groups, policy, bridge, patience, _ = adaptive_settings(o, art, engine.num_layers, engine.config.vocab_size)
    if bridge != "propagate":
        raise InvalidArgumentError(f"the onnxruntime backend runs the propagate bridge only, not '{bridge}'")
    if getattr(policy, "needs_ats", False):
        raise InvalidArgumentError("the onnxruntime backend cannot measure the attention transition score (its "
                                   "attention probabilities are not graph outputs); use a policy without ats (for a "
                                   "laser file: `laserlm calibrate --no-ats`, then export with it)")
    if find_predictor(policy) is not None:
        raise InvalidArgumentError("the onnxruntime backend does not run the complexity predictor (it reads token "
                                   "embeddings, which are not a graph output)")
    missing = [b for b in groups.exit_points if f"bridge_{groups.group_ending_at(b) + 1}" not in man["graphs"]]
    if missing:
        raise InvalidArgumentError(f"exit points {missing} have no exported bridge graph; re-export with these "
                                   "groups and min depth")
    heads = {b: engine.exit_head(b) for b in groups.exit_points if b in engine.exit_adapter}
    return AdaptiveDepth(engine, groups, policy, bridge="propagate", patience=patience, heads=heads)
