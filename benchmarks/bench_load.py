"""Load time and peak memory of ``load_model(..., weights="native")``, cold and warm (issue 34).

Each measurement is a fresh Python process (``--repeats`` of each, alternating arms); its peak RSS is the child's
own ``ru_maxrss`` at the end of the load. "cold" starts from an empty ``LASERLM_CACHE`` (config + tokenizer read from the GGUF, weights packed
from the file; the compiled kernels are copied in so their one-time build is not counted); "warm" loads again from
that cache. ``--code DIR`` runs another checkout of laserlm (e.g. a ``git worktree`` of an older commit) for a
before/after comparison. The child also reports its RSS after importing torch and transformers ("base") and the
packed weights' bytes.

    python benchmarks/bench_load.py --models smollm2-135m gemma3-270m [--code /tmp/old] [--repeats 2]

Run alone; prints JSON and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch, transformers  # noqa: F401
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
from laserlm.models.loader import load_model
lm = load_model(sys.argv[1], weights="native", progress=False)
t = time.perf_counter() - t0
nbytes = lm.pack_report.nbytes
print(json.dumps({"load_s": t, "base_rss_mb": base / 1024, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "packed_mb": nbytes / 2**20}))
"""


def run_child(model: str, cache: Path, code: Path | None) -> dict:
    env = {**os.environ, "LASERLM_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--code", type=Path, default=None, help="another laserlm checkout to compare (PYTHONPATH)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/out/load.json")
    args = ap.parse_args()
    kernels = Path(os.environ.get("LASERLM_CACHE", Path.home() / ".cache" / "laserlm")) / "kernels"
    arms = [("this", None)] + ([("other", args.code)] if args.code else [])
    rows = []
    for model in args.models:
        for rep in range(args.repeats):
            for arm, code in arms:
                with tempfile.TemporaryDirectory() as t:
                    cache = Path(t)
                    if kernels.is_dir():
                        shutil.copytree(kernels, cache / "kernels")
                    for phase in ("cold", "warm"):
                        r = run_child(model, cache, code)
                        rows.append({"model": model, "arm": arm, "phase": phase, "repeat": rep, **r})
                        print(json.dumps(rows[-1]), flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "code": str(args.code) if args.code else None, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
