"""The calibration artifact: one safetensors file (the depth package's *laser file*) + a JSON report.

The file is written by :func:`laserlm.depth.heads.save_laser_file` (tensors ``heads.<exit>.*``,
``gates.<exit>.*``; JSON config in the safetensors metadata: format version, base-model identity and
fingerprint, head/gate layout, thresholds) so that ``laserlm generate --laser PATH`` / the adaptive
mode read it with :func:`laserlm.depth.heads.load_laser_file`. Calibration adds:

- ``router.*`` tensors and ``config["router"]`` (seed 004's DynamicRouter; ignored by the depth loader);
- ``config["weights_sha256"]``: SHA-256 of all base-model weights cast to bfloat16 (so a float32 and a
  bfloat16 load of the same weights agree), checked by :func:`load_artifact`;
- ``config["calibration"]``: the target, delta, the certified guarantee and the run summary.

A human-readable copy of the config is written next to the file as ``<name>.json`` (not read back).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..depth.heads import FORMAT_VERSION, LaserArtifact, load_laser_file, save_laser_file, tensors_digest
from ..errors import CorruptModelError, InvalidArgumentError
from ..depth.router import DynamicRouter

ARTIFACT_FORMAT_VERSION = FORMAT_VERSION

_HASH_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> hash


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over ``name, shape, bfloat16 bytes`` of every parameter in order (tied weights once).

    bfloat16 rounding makes float32 and bfloat16 loads of the same checkpoint hash equal. ~1 s for
    135M parameters; cached per model object.
    """
    key = model
    if key in _HASH_CACHE:
        return _HASH_CACHE[key]
    h = hashlib.sha256()
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:  # tied weights (embedding = LM head) hashed once
            continue
        seen.add(p.data_ptr())
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(p.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def _engine_of(lm):
    return getattr(lm, "engine", lm)


@dataclass
class CalibrationArtifact:
    """A loaded calibration artifact.

    Attributes:
        heads: ``exit layer -> ExitHead``.
        gates: ``exit layer -> ExitGate``.
        router: the :class:`DynamicRouter` or ``None``.
        thresholds: calibrated thresholds (``{"gate_threshold": lam}``; 1.0 = never exit).
        config: the JSON config (groups, min depth, ATS layer, calibration report ...).
        path: where it was read from.
    """

    heads: dict
    gates: dict
    router: DynamicRouter | None = None
    thresholds: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    path: Path | None = None

    def mode_spec(self, bridge: str | None = None) -> str:
        """Mode spec running the calibrated policy: ``adaptive:laser=PATH,bridge=...,patience=0``.

        The default bridge is the one the thresholds were calibrated for (``config["bridge"]``; files from
        before that field: ``deferred``, exact states); another bridge or patience changes the decisions.
        """
        bridge = bridge or self.config.get("bridge", "deferred")
        return f"adaptive:laser={self.path},bridge={bridge},patience=0"


def save_artifact(path, lm, heads: dict, gates: dict, thresholds: dict, config: dict,
                  router: DynamicRouter | None = None) -> Path:
    """Write the artifact for ``lm``'s model (a :class:`laserlm.LaserLM` or an engine).

    Args:
        heads / gates: ``exit layer -> ExitHead / ExitGate`` (keys int or str).
        thresholds: e.g. ``{"gate_threshold": 0.83}``.
        config: JSON-able settings and report (groups, min depth, ATS layer, calibration ...).
        router: optional router, stored as ``router.*`` tensors.

    Raises:
        InvalidArgumentError: the parent directory does not exist.
    """
    engine = _engine_of(lm)
    path = Path(path)
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"output directory does not exist: {path.parent}")
    config = dict(config)
    config["weights_sha256"] = weights_sha256(engine.model)
    if router is not None:
        config["router"] = {"exit_points": router.exit_points, "layer": 1}
    art = LaserArtifact(heads={int(k): v for k, v in heads.items()}, gates={int(k): v for k, v in gates.items()},
                        thresholds=thresholds, config=config)
    tmp = path.with_name(path.name + ".tmp")
    save_laser_file(tmp, engine, art)
    if router is not None:
        from safetensors import safe_open  # noqa: PLC0415
        from safetensors.torch import save_file  # noqa: PLC0415

        with safe_open(str(tmp), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors.update({f"router.{k}": v.detach().contiguous() for k, v in router.state_dict().items()})
        cfg = json.loads(meta["laserlm"])
        cfg["tensors_sha256"] = tensors_digest(tensors)  # now covering the router too
        save_file(tensors, str(tmp), metadata={**meta, "laserlm": json.dumps(cfg)})
    tmp.replace(path)
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(path), framework="pt") as f:
        full = json.loads(f.metadata()["laserlm"])
    path.with_suffix(".json").write_text(json.dumps(full, indent=2))
    return path


def load_artifact(path, lm) -> CalibrationArtifact:
    """Load a calibration artifact for ``lm``'s model (a :class:`laserlm.LaserLM` or an engine).

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a laser file, truncated, unreadable, or another format version.
        InvalidArgumentError: made for another model (architecture, fingerprint or weight hash differ).
    """
    engine = _engine_of(lm)
    path = Path(path)
    art = load_laser_file(path, engine)
    want = art.config.get("weights_sha256")
    if want is not None and want != weights_sha256(engine.model):
        ident = art.identity.get("name", "?")
        raise InvalidArgumentError(f"{path} was made for another model ({ident}): the base model's weights hash "
                                   "differs from this model's; recalibrate with `laserlm calibrate`")
    router = None
    rc = art.config.get("router")
    if rc is not None:
        from safetensors import safe_open  # noqa: PLC0415

        with safe_open(str(path), framework="pt") as f:
            sd = {k[len("router."):]: f.get_tensor(k) for k in f.keys() if k.startswith("router.")}
        router = DynamicRouter(engine.config.hidden_size, rc["exit_points"])
        try:
            router.load_state_dict(sd)
        except RuntimeError as exc:
            raise CorruptModelError(f"{path}: router tensors do not match its config: {exc}") from None
    return CalibrationArtifact(art.heads, art.gates, router, art.thresholds, art.config, path)
