"""Helpers the tools' reports share (``eval`` and ``bench``): a one-line machine description, a UTC
timestamp, strict JSON output (NaN -> null)."""

from __future__ import annotations

import math
import time

import torch


def machine() -> str:
    """A one-line description of this machine (CPU, cores, torch threads)."""
    import os  # noqa: PLC0415

    from .cpuinfo import cpu_name  # noqa: PLC0415

    return f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def strict_json(v):
    """``v`` with every NaN / infinite float replaced by ``None`` (strict JSON has no NaN), recursively."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return v


def write_json(doc: dict, path: str) -> None:
    """Write a report as indented, strict JSON (NaN -> null) to ``path`` (``"-"``: standard output)."""
    import json  # noqa: PLC0415

    text = json.dumps(strict_json(json.loads(json.dumps(doc, default=float))), indent=1, allow_nan=False)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
