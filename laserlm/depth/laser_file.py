"""The laser file: one safetensors file holding what `laserlm calibrate` trains for a base model.

Layout (format version :data:`FORMAT_VERSION`):

- tensors ``heads.<exit>.*`` (:class:`~laserlm.depth.heads.ExitHead` adapters), ``gates.<exit>.*``
  (:class:`~laserlm.depth.heads.ExitGate`), ``router.*`` (:class:`~laserlm.depth.router.DynamicRouter`) and,
  optionally, ``predictor.*`` (:class:`~laserlm.depth.predictor.ComplexityPredictor`, its layout in the
  metadata's ``predictor``; files without one load unchanged);
- safetensors metadata ``"laserlm"``: a JSON object with ``format_version``, ``identity`` (name, model type
  and the architecture numbers of the base model), ``weights_sha256`` (the base model's weight hash,
  :func:`laserlm.models.weights_hash.weights_sha256`), the head / gate / router layouts, ``thresholds``,
  ``config`` (groups, policy, min depth, ATS layer, the bridge the thresholds were certified for, the
  calibration report ...) and ``tensors_sha256`` (a checksum of the tensors: damaged data is refused).

One loader, :func:`load_laser_file`, serves every reader (the ``adaptive`` / ``early-exit`` modes, the
speculative draft head, training, evaluation, bench). Identity is checked by the architecture numbers and
then by the weight hash, so a file never loads on another model with equal shapes; the hash is memoised per
model object and taken before packing, so a file made on ``--weights fp32`` loads on ``--weights native``.

Bridge: a file that does not state one (``config["bridge"]``) runs with :data:`DEFAULT_BRIDGE`, ``propagate``,
the bridge `laserlm calibrate` certifies by default; :func:`save_laser_file` always writes it.

Older files (format version 1: identity by 32 embedding values, the weight hash only in calibrated files) are
refused with an error telling to re-run `laserlm calibrate`: their identity check was weaker and their bridge
default ambiguous, and re-calibrating takes minutes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


from ..errors import CorruptModelError, InvalidArgumentError, ModelNotFoundError
from ..runtime.options import is_int
from ..models.files import write_safetensors
from ..models.weights_hash import weights_sha256
from .heads import ExitGate, ExitHead
from .predictor import ComplexityPredictor
from .router import DynamicRouter

FORMAT_VERSION = 2
DEFAULT_BRIDGE = "propagate"
IDENTITY_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


@dataclass
class LaserArtifact:
    """What a laser file holds.

    Attributes:
        heads: ``exit layer -> ExitHead``.
        gates: ``exit layer -> ExitGate``.
        router: the sequence-level :class:`~laserlm.depth.router.DynamicRouter` (mode ``routed``), or ``None``.
        router_note: why a file's router is not loaded (an older format), or ``None``.
        predictor: the pre-layer :class:`~laserlm.depth.predictor.ComplexityPredictor`, or ``None``.
        thresholds: calibrated settings (e.g. ``{"gate_threshold": 0.83}``, ``{"threshold": 0.9}``).
        config: JSON-able settings (groups, policy, min depth, ATS layer, ``bridge``, calibration report ...).
        identity: the base model identity the file was made for (set by :func:`load_laser_file`).
        path: where it was read from (set by :func:`load_laser_file`).
    """

    heads: dict = field(default_factory=dict)
    gates: dict = field(default_factory=dict)
    router: DynamicRouter | None = None
    router_note: str | None = None
    predictor: ComplexityPredictor | None = None
    thresholds: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    identity: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def bridge(self) -> str:
        """The bridge the thresholds were calibrated for (:data:`DEFAULT_BRIDGE` when the file does not say)."""
        return self.config.get("bridge", DEFAULT_BRIDGE)

    @property
    def patience(self) -> int:
        """``k`` of the patience rule the thresholds were certified with (every calibrated file says; a file that
        does not gets the adaptive mode's default, 3)."""
        value = self.config.get("patience", 3)
        if not is_int(value) or value < 0:
            raise CorruptModelError(f"laser file {self.path}: patience must be a non-negative integer, got {value!r}")
        return value

    def mode_spec(self, bridge: str | None = None) -> str:
        """Mode spec running the calibrated policy: ``adaptive:laser=PATH,bridge=...,patience=K`` (the file's);
        another bridge or patience than the file's changes the decisions the thresholds were certified for."""
        return f"adaptive:laser={self.path},bridge={bridge or self.bridge},patience={self.patience}"


def _engine_of(lm):
    return getattr(lm, "engine", lm)


def model_identity(engine) -> dict:
    """Identity of the engine's model: the loader's identity fields plus the architecture numbers."""
    cfg = engine.config
    ident = dict(engine.loaded.identity) if getattr(engine, "loaded", None) is not None else {}
    ident.update({"model_type": getattr(cfg, "model_type", None), "num_hidden_layers": cfg.num_hidden_layers,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size})
    return ident


def check_identity(meta: dict, engine, path: str = "laser file") -> None:
    """Raise :class:`InvalidArgumentError` when a laser file's metadata ``meta`` was made for another model:
    other architecture numbers, or (equal shapes) another weight hash."""
    mine = model_identity(engine)
    theirs = meta.get("identity", {})
    diff = [k for k in IDENTITY_KEYS if theirs.get(k) != mine.get(k)]
    made = theirs.get("name") or theirs.get("model_type", "?")
    if diff:
        raise InvalidArgumentError(
            f"{path} was made for another model ({made}: " +
            ", ".join(f"{k}={theirs.get(k)!r}" for k in IDENTITY_KEYS) +
            f"); this model is {mine.get('name', mine.get('model_type'))} (" +
            ", ".join(f"{k}={mine.get(k)!r}" for k in IDENTITY_KEYS) + ")")
    if meta.get("weights_sha256") != weights_sha256(engine.model):
        raise InvalidArgumentError(
            f"{path} was made for another model ({made}): the weights differ (the base model's weights hash "
            f"{str(meta.get('weights_sha256'))[:12]}... is not this model's {weights_sha256(engine.model)[:12]}...); "
            "recalibrate with `laserlm calibrate`")
    check_delta(meta, engine, path)


def check_delta(meta: dict, engine, path: str = "laser file") -> None:
    """Raise :class:`InvalidArgumentError` when a file made on a model adapted by a delta (``laserlm train-backbone``,
    :mod:`laserlm.models.delta`) meets the model without that delta, or the reverse."""
    from ..models.delta import ATTRIBUTE  # noqa: PLC0415

    theirs = (meta.get("lora") or {}).get("sha256")
    mine = engine.model.__dict__.get(ATTRIBUTE)
    if theirs == mine:
        return
    if theirs is not None:
        file = (meta.get("lora") or {}).get("file", "?")
        raise InvalidArgumentError(
            f"{path} was made on the model adapted by the delta {file} ({theirs[:12]}...), but "
            + ("this model carries no delta" if mine is None else f"this model carries another delta ({mine[:12]}...)")
            + f"; load the model with that delta: --lora {file} (the CLI's --laser loads it by itself), or "
              f"laserlm.load(..., lora='{file}')")
    raise InvalidArgumentError(
        f"{path} was made on the model without a delta, but this model carries one ({mine[:12]}...); load the model "
        "without --lora, or calibrate the adapted model (`laserlm calibrate --lora FILE`)")


def delta_file_of(meta: dict, path) -> Path | None:
    """The delta file a laser file's metadata names (resolved next to the laser file when relative), or ``None``."""
    d = meta.get("lora")
    if not d or not d.get("file"):
        return None
    f = Path(d["file"])
    return f if f.is_absolute() else Path(path).parent / f


def tensors_digest(tensors: dict) -> str:
    """sha256 over a laser file's tensors (names, dtypes, shapes and bytes, in name order): detects damaged data. The
    same checksum as delta files' (:func:`laserlm.models.delta.tensors_sha256`)."""
    from ..models.delta import tensors_sha256  # noqa: PLC0415

    return tensors_sha256(tensors)


def save_laser_file(path, lm, artifact: LaserArtifact, json_copy: bool = False) -> Path:
    """Write ``artifact`` for ``lm``'s model (a :class:`laserlm.LaserLM` or an engine) to ``path``.

    The file is written beside ``path`` and renamed over it (:func:`laserlm.models.files.atomic_write`), so a reader
    never sees half a file. ``json_copy``: also
    write the metadata, indented, to ``<path without suffix>.json`` (a report for people; never read back).

    Raises:
        InvalidArgumentError: the parent directory does not exist.
    """
    engine = _engine_of(lm)
    path = Path(path)
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"output directory does not exist: {path.parent}")
    tensors = {}
    for prefix, modules in (("heads", artifact.heads), ("gates", artifact.gates)):
        for layer, module in modules.items():
            for k, v in module.state_dict().items():
                tensors[f"{prefix}.{int(layer)}.{k}"] = v.detach().contiguous().cpu()
    config = dict(artifact.config)
    config.setdefault("bridge", DEFAULT_BRIDGE)
    meta = {
        "format_version": FORMAT_VERSION,
        "identity": model_identity(engine),
        "weights_sha256": weights_sha256(engine.model),
        "heads": {str(int(k)): h.config_dict() for k, h in artifact.heads.items()},
        "gates": {str(int(k)): g.config_dict() for k, g in artifact.gates.items()},
        "thresholds": artifact.thresholds,
        "config": config,
    }
    if artifact.router is not None:
        for k, v in artifact.router.state_dict().items():
            tensors[f"router.{k}"] = v.detach().contiguous().cpu()
        meta["router"] = artifact.router.config_dict()
    if artifact.predictor is not None:
        for k, v in artifact.predictor.state_dict().items():
            tensors[f"predictor.{k}"] = v.detach().contiguous().cpu()
        meta["predictor"] = artifact.predictor.config_dict()
    from ..models.delta import ATTRIBUTE, PATH_ATTRIBUTE  # noqa: PLC0415

    if (digest := engine.model.__dict__.get(ATTRIBUTE)) is not None:  # made on a model adapted by a delta
        src = Path(engine.model.__dict__[PATH_ATTRIBUTE]).resolve()
        try:
            file = os.path.relpath(src, path.parent.resolve())
        except ValueError:  # another drive
            file = str(src)
        meta["lora"] = {"sha256": digest, "file": file}
    meta["tensors_sha256"] = tensors_digest(tensors)
    write_safetensors(tensors, path, {"laserlm": json.dumps(meta)})
    if json_copy:
        path.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    return path


def read_metadata(path) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of a laser file, format and checksum checked, identity not.

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a laser file, truncated, damaged tensors, or another format version (version 1
            files: the message says to re-run `laserlm calibrate`).
    """
    from safetensors import safe_open  # noqa: PLC0415

    if not str(path).strip():
        raise ModelNotFoundError("laser file not given: laser= needs a file path (from `laserlm calibrate -o FILE`)")
    path = Path(path)
    if path.is_dir():
        raise ModelNotFoundError(f"laser file expected, got a directory: {path}")
    if not path.is_file():
        raise ModelNotFoundError(f"laser file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several error types for bad files
        raise CorruptModelError(f"cannot read laser file {path}: {exc}") from None
    if "laserlm" not in raw:
        raise CorruptModelError(f"{path} is not a laser file (no laserlm metadata)")
    try:
        meta = json.loads(raw["laserlm"])
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path}: bad laserlm metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise CorruptModelError(f"{path}: bad laserlm metadata: not a JSON object")
    version = meta.get("format_version")
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise CorruptModelError(f"{path} has laser file format version {version}, from an older laserlm (weaker "
                                f"model identity check); re-run `laserlm calibrate` to make a version "
                                f"{FORMAT_VERSION} file")
    if version != FORMAT_VERSION:
        raise CorruptModelError(f"{path} has laser file format version {version!r}; this laserlm reads version "
                                f"{FORMAT_VERSION}")
    if tensors_digest(tensors) != meta.get("tensors_sha256"):
        raise CorruptModelError(f"{path}: tensor data is damaged (checksum mismatch); recalibrate or copy it again")
    return meta, tensors


def load_laser_file(path, lm) -> LaserArtifact:
    """Read a laser file for ``lm``'s model (a :class:`laserlm.LaserLM` or an engine).

    Returns:
        a :class:`LaserArtifact` with ``heads`` / ``gates`` (``int exit layer -> module``), ``router`` (or
        ``None``), ``thresholds``, ``config`` (its ``bridge`` filled with :data:`DEFAULT_BRIDGE` when absent),
        ``identity`` and ``path``.

    Raises:
        ModelNotFoundError: no such file.
        CorruptModelError: not a laser file, truncated, unreadable, damaged, another format version, or
            tensors that do not match its layout.
        InvalidArgumentError: the file was made for another model (architecture or weight hash differ).
    """
    engine = _engine_of(lm)
    meta, tensors = read_metadata(path)
    path = Path(path)
    check_identity(meta, engine, str(path))
    config = dict(meta.get("config", {}))
    config.setdefault("bridge", DEFAULT_BRIDGE)
    art = LaserArtifact(thresholds=meta.get("thresholds", {}), config=config, identity=meta.get("identity", {}),
                        path=path)
    d = engine.config.hidden_size

    def part(prefix: str) -> dict:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    try:
        for key, hc in meta.get("heads", {}).items():
            head = ExitHead(engine.adapter, hc.get("adapter", "none"), hc.get("rank", 16))
            head.load_state_dict(part(f"heads.{key}."))
            art.heads[int(key)] = head
        for key, gc in meta.get("gates", {}).items():
            gate = ExitGate(d, gc.get("num_scalars"), gc.get("uses_ats", False), gc.get("features", "head"))
            gate.load_state_dict(part(f"gates.{key}."))
            art.gates[int(key)] = gate
        rc = meta.get("router")
        if rc is not None and "routes" not in rc:  # an older laserlm's router, which only capped the final layers
            art.router_note = (f"{path} has a router from an older laserlm (final-layer caps only); re-run "
                               "`laserlm calibrate` for a router whose routes skip middle layers")
        elif rc is not None:
            art.router = DynamicRouter.from_config(d, engine.num_layers, rc)
            art.router.load_state_dict(part("router."))
        pc = meta.get("predictor")
        if pc is not None:
            art.predictor = ComplexityPredictor(d, pc["exit_points"], pc.get("context", 4), pc.get("channels", 32),
                                                pc.get("uses_ats", False))
            art.predictor.load_state_dict(part("predictor."))
    except (RuntimeError, KeyError, IndexError, TypeError, ValueError, InvalidArgumentError) as exc:
        raise CorruptModelError(f"{path}: tensors do not match its config: {exc}") from None
    return art
