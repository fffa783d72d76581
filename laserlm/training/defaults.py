"""Build the calibrated adaptive default of a bundled model (see :mod:`laserlm.defaults` for the rule).

``laserlm generate --mode adaptive`` (and ``eval`` / ``bench`` configurations ``adaptive``) on a bundled model
without a laser file use the artifact ``laserlm calibrate --source chat --seq-len 128`` writes at otherwise default
settings (:func:`default_calibrate_config`: the model's own greedy answers to chat prompts). This module builds it
once into the cache (:func:`laserlm.defaults.adaptive_artifact_path`); the ``laserlm`` command installs
:func:`build_adaptive_default` with :func:`laserlm.defaults.set_adaptive_builder`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

from ..defaults import BUILD_MINUTES, adaptive_artifact_path
from ..errors import InvalidArgumentError
from ..models.cache import build_lock
from .pipeline import CalibrateConfig


def default_calibrate_config(data=None) -> CalibrateConfig:
    """The settings of the cached adaptive artifact (recipe :data:`laserlm.defaults.ADAPTIVE_RECIPE`):
    ``laserlm calibrate --source chat --seq-len 128``, i.e. ``laserlm calibrate``'s defaults (target agreement
    0.99 with probability >= 0.9, ``propagate`` bridge, default split sizes) on the model's own greedy answers to
    chat prompts, one 128-token conversation per chunk (:mod:`laserlm.training.chat_text`): the text bare
    ``adaptive`` is used on, so that the certificate is about exchangeable positions. ``data``: the data
    directory with the prompt files (``None``: the default one)."""
    return CalibrateConfig(data=data, source="chat", seq_len=128).validate()


def _float_engine(engine, progress: bool):
    """``engine`` itself for float weights; for packed weights (``int8`` / ``int4`` / ``native``) an engine on the
    float32 weights of the same checkpoint. Training exit heads backpropagates through the LM head, which packed
    matrices do not support at speed (a head-training step is orders of magnitude slower through packed weights).
    The artifact made on the float weights loads on every weight format of the
    checkpoint: a laser file is identified by the hash of the float weights, taken before packing."""
    if getattr(engine.loaded, "pack_report", None) is None:
        return engine
    from ..models.loader import load_model  # noqa: PLC0415
    from ..runtime.engine import Engine  # noqa: PLC0415

    if progress:
        print(f"laserlm: calibrating on the float32 weights of {engine.loaded.name} (the artifact also serves "
              f"--weights {engine.weights})", file=sys.stderr, flush=True)
    return Engine(load_model(engine.loaded.name, dtype="float32", weights="fp32"))


def build_adaptive_default(engine, cfg: CalibrateConfig | None = None, progress: bool = True) -> Path:
    """The cached calibrated adaptive artifact of ``engine``'s model (a :class:`laserlm.LaserLM` or its engine),
    built with :func:`laserlm.training.pipeline.calibrate` when absent; returns its path.

    A build prints one notice line on stderr and the calibration's progress bars (``progress``), works in
    ``<artifact>.work`` and resumes from it when an earlier build was interrupted, and renames the finished
    artifact into place (a half-built file never has the final name). Concurrent builds wait on a lock file.

    ``cfg``: calibration settings (default :func:`default_calibrate_config`; other settings are another cache
    entry).

    Raises:
        InvalidArgumentError: the model was not loaded with laserlm (no name or tokenizer to calibrate with).
        DataFileError: the calibration text is not found.
    """
    from . import pipeline  # noqa: PLC0415  (module attribute: tests may wrap pipeline.calibrate)

    engine = getattr(engine, "engine", engine)
    if getattr(engine, "loaded", None) is None or getattr(engine, "tokenizer", None) is None:
        raise InvalidArgumentError("the calibrated adaptive default needs a model loaded with laserlm.load "
                                   "(its name and tokenizer); pass laser=PATH or explicit thresholds instead")
    cfg = cfg or default_calibrate_config()
    is_default = cfg.to_dict() == default_calibrate_config(cfg.data).to_dict()
    path = adaptive_artifact_path(engine, None if is_default else cfg.to_dict(), cfg.data)
    if path.is_file():
        return path
    with build_lock(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process built it while we waited
            return path
        name = engine.loaded.name
        work = path.with_name(path.name + ".work")
        eta = f" (~{BUILD_MINUTES[name]} min on 2 cores)" if is_default and name in BUILD_MINUTES else ""
        resumed = ", resuming an interrupted build," if (work / "manifest.json").is_file() else ""
        if progress:
            print(f"laserlm: building the calibrated adaptive-depth artifact for {name} once{eta}{resumed} into "
                  f"{path.parent}; later runs reuse it", file=sys.stderr, flush=True)
        tmp = path.with_name("building-" + path.name)
        calib = _float_engine(engine, progress)
        lm = SimpleNamespace(engine=calib, tokenizer=calib.tokenizer, loaded=calib.loaded)
        pipeline.calibrate(lm, cfg, tmp, resume=True, progress=progress, work_dir=work)
        report = tmp.with_suffix(".json")
        if report.is_file():
            os.replace(report, path.with_suffix(".json"))
        os.replace(tmp, path)
    return path
