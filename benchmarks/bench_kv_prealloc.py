"""KV pool pre-allocation, full vs staged (seed 004 §3.2's progressive pre-allocation): memory and step latency.

Each configuration runs in its own process (peak RSS is per process): the model is loaded, then a
:class:`laserlm.runtime.scheduler.Scheduler` with ``--kv-budget`` and ``kv_prealloc`` full or staged runs a workload
of WikiText-2 test paragraphs (``--prompt-tokens`` each, ``--new-tokens`` greedy tokens, EOS ignored) at two loads:
``light`` (one request at a time) and ``heavy`` (``--docs`` requests submitted at once, ``--max-batch`` running).
Reported per configuration: peak RSS of the process and its RSS after the model loaded (before any pool), the
arena's bytes at the end, the arena growths, wall time, and P50/P99 of the scheduler's step time. Configurations
alternate over ``--rounds`` rounds (full, staged, full, staged, ...).

Usage (run alone; record ``uptime`` before and after)::

    PYTHONPATH=. python benchmarks/bench_kv_prealloc.py --out benchmarks/out/kv_prealloc/kv_prealloc.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(args) -> dict:
    import torch

    import laserlm
    from laserlm.runtime.sampling import SamplingParams
    from laserlm.runtime.scheduler import BatchConfig, Scheduler

    torch.set_num_threads(args.threads)
    lm = laserlm.load(args.model, weights=args.weights, threads=args.threads)
    docs = []
    for line in Path(args.data).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("="):
            ids = lm.tokenizer(line)["input_ids"]
            if len(ids) >= args.prompt_tokens:
                docs.append(ids[:args.prompt_tokens])
        if len(docs) == args.docs:
            break
    rss_loaded = rss_mib()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    out = {"prealloc": args.child, "rss_loaded_mib": round(rss_loaded, 1)}
    sched = Scheduler(lm.engine, BatchConfig(kv_budget=args.kv_budget, max_batch=args.max_batch,
                                             kv_prealloc=args.child, prefix_cache=False))
    out["rss_pool_created_mib"] = round(rss_mib(), 1)
    for load in ("light", "heavy"):
        steps = []
        t0 = time.perf_counter()
        batches = [[d] for d in docs[:4]] if load == "light" else [docs]
        for batch in batches:
            for d in batch:
                sched.submit(torch.tensor(d), params)
            while sched.has_unfinished:
                s = time.perf_counter()
                sched.step()
                steps.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
        steps.sort()
        out[load] = {"wall_s": round(wall, 3), "steps": len(steps),
                     "step_p50_ms": round(1e3 * statistics.median(steps), 2),
                     "step_p99_ms": round(1e3 * steps[min(len(steps) - 1, int(0.99 * len(steps)))], 2),
                     "arena_mib": round(sched.pool.nbytes / 2**20, 1), "pages_allocated": sched.pool.capacity,
                     "pages_budget": sched.pool.num_pages, "growths": sched.pool.stats["arena_growths"],
                     "rss_mib": round(rss_mib(), 1)}
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--kv-budget", default="512MiB")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--out")
    ap.add_argument("--child", choices=["full", "staged"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    argv = [a for a in sys.argv[1:]]
    runs = []
    for r in range(args.rounds):
        for pre in ("full", "staged"):
            res = subprocess.run([sys.executable, __file__, *argv, "--child", pre], capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(res.stderr[-2000:])
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["round"] = r
            runs.append(row)
            print(json.dumps(row), flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    report = {"command": "python benchmarks/bench_kv_prealloc.py " + " ".join(argv), "cpu": cpu,
              "date": time.strftime("%Y-%m-%d"), "settings": {k: v for k, v in vars(args).items() if k != "child"},
              "runs": runs}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
