"""TensorRT build profile for an ONNX export (seed 004 §3.1: ``trtexec`` with min/opt/max shapes, max batch =
1.2x the peak concurrency). Nothing is built here: the profile and the commands are written for a machine with a
GPU and TensorRT.

One optimization profile per graph: ``batch`` min 1 / opt = peak concurrency / max = ceil(1.2 x peak);
``new_tokens`` min 1 / opt 1 (decode) / max = max_len (prefill); ``past`` min 0 / opt max_len // 2 / max
max_len - 1. The names come from each graph's ONNX inputs (read back from the file and checked against the
manifest).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import CorruptModelError, InvalidArgumentError
from ..runtime.options import is_int

PROFILE = "tensorrt_profile.json"


def batch_bounds(peak_concurrency: int) -> tuple[int, int, int]:
    """``(min, opt, max)`` batch for ``peak_concurrency`` requests: ``(1, peak, ceil(1.2 * peak))`` (seed 004 §3.1)."""
    if not is_int(peak_concurrency) or peak_concurrency < 1:
        raise InvalidArgumentError(f"peak concurrency must be a positive integer, got {peak_concurrency!r}")
    return 1, peak_concurrency, math.ceil(1.2 * peak_concurrency - 1e-9)


def _onnx_inputs(path: Path) -> list[str]:
    import onnx  # noqa: PLC0415

    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for damaged files
        raise CorruptModelError(f"{path}: cannot read the ONNX graph: {exc}") from None
    init = {i.name for i in m.graph.initializer}
    return [i.name for i in m.graph.input if i.name not in init]


def write_profile(export_dir, peak_concurrency: int = 1, fp16: bool = True) -> dict:
    """Write ``tensorrt_profile.json`` (shapes per graph input and one ``trtexec`` command per graph) into
    ``export_dir``; returns it.

    Raises:
        CorruptModelError: a graph's ONNX inputs differ from the manifest's (names), or a graph is unreadable.
        ModelNotFoundError / CorruptModelError: no valid export in ``export_dir`` (see
            :func:`laserlm.runtime.ort_engine.read_manifest`).
    """
    from ..runtime.ort_engine import read_manifest  # noqa: PLC0415

    d = Path(export_dir)
    man = read_manifest(d)
    bmin, bopt, bmax = batch_bounds(peak_concurrency)
    max_len = man["shapes"]["max_len"]
    if bmax > man["shapes"]["batch"][1]:
        note = (f"the graphs were exported with max batch {man['shapes']['batch'][1]}; the profile asks for {bmax} "
                "(onnxruntime checks the manifest's bound, TensorRT uses the profile)")
    else:
        note = None
    axes = {"batch": (bmin, bopt, bmax), "new_tokens": (1, 1, max_len), "past": (0, max_len // 2, max_len - 1)}
    graphs = {}
    for name, g in man["graphs"].items():
        declared = [s["name"] for s in g["inputs"]]
        actual = _onnx_inputs(d / g["file"])
        if actual != declared:
            raise CorruptModelError(f"{d / g['file']}: ONNX inputs {actual} differ from the manifest's {declared}")
        shapes = {}
        for s in g["inputs"]:
            shapes[s["name"]] = [[axes[x][k] if isinstance(x, str) else x for x in s["shape"]] for k in range(3)]
        flag = {k: ",".join(f"{n}:{'x'.join(str(v) for v in sh[i])}" for n, sh in shapes.items())
                for i, k in enumerate(("min", "opt", "max"))}
        cmd = (f"trtexec --onnx={g['file']} --saveEngine={name}.plan --minShapes={flag['min']} "
               f"--optShapes={flag['opt']} --maxShapes={flag['max']}" + (" --fp16" if fp16 else ""))
        graphs[name] = {"file": g["file"], "shapes": {n: dict(zip(("min", "opt", "max"), sh)) for n, sh in shapes.items()},
                        "trtexec": cmd}
    profile = {"built": False, "why_not_built": "no GPU / TensorRT on the exporting machine",
               "peak_concurrency": peak_concurrency, "batch": [bmin, bopt, bmax], "max_len": max_len,
               "rule": "max batch = ceil(1.2 x peak concurrency) (seed 004 §3.1)", "fp16": fp16,
               "note": note, "graphs": graphs}
    (d / PROFILE).write_text(json.dumps(profile, indent=2))
    (d / "trtexec.sh").write_text("#!/bin/sh\n# written by laserlm export onnx --tensorrt; NOT run here\nset -e\n" +
                                  "".join(g["trtexec"] + "\n" for g in graphs.values()))
    return profile
