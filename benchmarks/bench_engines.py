"""pp512 / tg128 of laserlm beside llama.cpp's and ik_llama.cpp's llama-bench on the same GGUF files, alternated.

Models are bundled names or .gguf paths. Each engine's process runs under GNU time for its peak RSS (the whole
llama-bench / `laserlm bench` process: load, pp512 and tg128).

Every round runs each engine once per (model, threads), in turn, so that a slow stretch of the shared machine hits
all of them alike; the table gives the median over rounds and laserlm's ratio to each other engine. Build the other
engines as DESIGN.md / issue 32 describe and pass their llama-bench binaries; a missing binary skips that engine.

    python benchmarks/bench_engines.py --rounds 3 --threads 1,2 --models smollm2-135m,gemma3-270m \\
        --llama-bench PATH/llama.cpp/build/bin/llama-bench --ik-bench PATH/ik_llama.cpp/build/bin/llama-bench \\
        --out benchmarks/out/engines.json

``--laserlm-old DIR`` adds laserlm from another checkout (``PYTHONPATH=DIR``), for an A/B of two versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gguf_path(model: str) -> str:
    """A bundled model's GGUF file, or ``model`` itself when it is a .gguf path (benchmarks/synthetic_models.py)."""
    if model.endswith(".gguf"):
        return model
    from laserlm.models.registry import BUNDLED

    return str(BUNDLED[model].locate())


def timed(cmd: list[str], env=None, cwd=None) -> tuple[str, float, float]:
    """Run ``cmd`` under GNU time: (stdout, peak RSS in GiB, wall seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", *cmd], capture_output=True, text=True,
                          timeout=3600, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed:\n{proc.stderr[-3000:]}")
    kb = int(proc.stderr.rsplit("maxrss_kb=", 1)[1].split()[0])
    return proc.stdout, kb / 2**20, wall


def run_llama_bench(binary: str, gguf: str, threads: int, reps: int, extra: list[str]) -> dict:
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "512", "-n", "128", "-r", str(reps), "-o", "json", *extra]
    out, rss, wall = timed(cmd)
    res = {"rss_gib": rss, "wall_s": wall}
    for row in json.loads(out):
        key = "pp512" if row["n_prompt"] else "tg128"
        res[key] = row["avg_ts"]
    return res


def run_laserlm(model: str, threads: int, reps: int, pythonpath: str | None) -> dict:
    """``laserlm bench`` in a fresh process: the installed laserlm, or the checkout ``pythonpath`` names. It runs in the
    temp directory, because ``python -m`` puts the working directory first on ``sys.path``: started from a checkout's
    root, both arms of an A/B would import that checkout."""
    if Path(model).exists():
        model = str(Path(model).resolve())
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = str(Path(pythonpath).resolve())
        cmd = [sys.executable, "-m", "laserlm.cli", "bench", "--model", model, "--no-hf", "--no-llamacpp",
               "-t", str(threads), "-r", str(reps), "--tests", "pp,tg", "--json", f.name, "--no-progress"]
        _, rss, wall = timed(cmd, env=env, cwd=tempfile.gettempdir())
        row = json.load(open(f.name))["rows"][0]
    return {"pp512": row["pp512"], "tg128": row["tg128"], "rss_gib": rss, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="repetitions inside each engine's own run")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument("--ik-bench", default=None, help="ik_llama.cpp's llama-bench binary (run with -rtr 1: repacked)")
    p.add_argument("--laserlm-old", default=None, help="another laserlm checkout to run beside this one")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    engines = {"laserlm": lambda m, t: run_laserlm(m, t, a.reps, None)}
    if a.laserlm_old:
        engines["laserlm (old)"] = lambda m, t: run_laserlm(m, t, a.reps, a.laserlm_old)
    if a.llama_bench and Path(a.llama_bench).exists():
        engines["llama.cpp"] = lambda m, t: run_llama_bench(a.llama_bench, gguf_path(m), t, a.reps, [])
    if a.ik_bench and Path(a.ik_bench).exists():
        engines["ik_llama.cpp"] = lambda m, t: run_llama_bench(a.ik_bench, gguf_path(m), t, a.reps, ["-rtr", "1"])
    models, threads = a.models.split(","), [int(t) for t in a.threads.split(",")]
    raw: dict = {}
    t_start = time.time()
    for r in range(a.rounds):
        for m in models:
            for t in threads:
                for name, fn in engines.items():
                    res = fn(m, t)
                    raw.setdefault(m, {}).setdefault(str(t), {}).setdefault(name, []).append(res)
                    print(f"round {r + 1}: {m} t={t} {name}: pp512 {res['pp512']:.1f} tg128 {res['tg128']:.1f}",
                          file=sys.stderr, flush=True)
    table = []
    print("| model | threads | engine | pp512 t/s | tg128 t/s | laserlm pp / this | laserlm tg / this | peak RSS GiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for m in models:
        for t in threads:
            med = {name: {k: statistics.median(x[k] for x in runs) for k in ("pp512", "tg128", "rss_gib")}
                   for name, runs in raw[m][str(t)].items()}
            ours = med["laserlm"]
            for name, v in med.items():
                row = {"model": m, "threads": t, "engine": name, **v,
                       "pp_ratio": ours["pp512"] / v["pp512"], "tg_ratio": ours["tg128"] / v["tg128"]}
                table.append(row)
                print(f"| {Path(m).name} | {t} | {name} | {v['pp512']:.1f} | {v['tg128']:.1f} | {row['pp_ratio']:.2f}x | "
                      f"{row['tg_ratio']:.2f}x | {v['rss_gib']:.2f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        json.dump({"argv": sys.argv, "rounds": a.rounds, "reps": a.reps, "started": time.ctime(t_start),
                   "finished": time.ctime(), "table": table, "raw": raw}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
