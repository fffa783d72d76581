"""KV memory strategies A/B: the paged pool pre-allocated full or staged (seed 004 §3.2's progressive
pre-allocation) against plain per-request allocation (``kv_prealloc=request``, the baseline of the seed's
P99 387 -> 213 ms): memory and step latency.

Each configuration runs in its own process (peak RSS is per process): the model is loaded, then a
:class:`laserlm.runtime.scheduler.Scheduler` with ``--kv-budget`` and the configuration's ``kv_prealloc`` runs a
workload of WikiText-2 test paragraphs (EOS ignored, greedy) at up to three loads: ``light`` (four requests of
``--prompt-tokens`` + ``--new-tokens``, one at a time), ``heavy`` (``--docs`` such requests submitted at once,
``--max-batch`` running) and ``churn`` (the server's churn: ``--churn-requests`` requests of random prompt and output
lengths, one arriving every ``--churn-gap`` scheduler steps, so requests join and leave the running batch all the
time and per-request caches are allocated and freed throughout). Reported per configuration and load: wall time,
P50/P99 of the scheduler's step time, the largest KV bytes held (arena, or the requests' own caches), the arena
growths, the prefix-cache hits so far (``--prefix-cache``: the churn load reuses the heavy load's documents, cut to
other lengths); per configuration: peak RSS of the process and its RSS after the model loaded (before any pool).

Configurations (``--configs``): ``full``, ``staged``, ``request``, ``blocks`` (a full arena cut into one block of pages per
layer group of ``--kv-groups``, seed 004's fixed block per execution group); a ``-pt`` suffix turns the engine's compiled
layers off (every layer on the PyTorch path), which separates the allocation strategy from the kernel: the pool's
batched rows run the compiled paged kernel, per-request rows cannot (they are not in one arena) and take the
PyTorch path with a padded gather. Configurations alternate over ``--rounds`` rounds.

Usage (run alone; record ``uptime`` before and after)::

    PYTHONPATH=. python benchmarks/bench_kv_prealloc.py --out benchmarks/out/kv_prealloc/kv_prealloc.json
"""

from __future__ import annotations

import argparse
import json
import random
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
    base = args.child.removesuffix("-pt")
    prealloc, groups = ("full", args.kv_groups) if base == "blocks" else (base, None)
    if args.child.endswith("-pt"):
        lm.engine.native_layers = False
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
    out = {"config": args.child, "prealloc": prealloc, "compiled_layers": not args.child.endswith("-pt"),
           "kv_groups": groups, "rss_loaded_mib": round(rss_loaded, 1)}
    sched = Scheduler(lm.engine, BatchConfig(kv_budget=args.kv_budget, max_batch=args.max_batch,
                                             kv_prealloc=prealloc, prefix_cache=args.prefix_cache,
                                             kv_groups=groups))
    out["rss_pool_created_mib"] = round(rss_mib(), 1)
    rng = random.Random(args.seed)
    churn = [(torch.tensor(docs[i % len(docs)][:rng.randint(8, args.prompt_tokens)]),
              SamplingParams(max_new_tokens=rng.randint(8, 2 * args.new_tokens), temperature=0.0, ignore_eos=True))
             for i in range(args.churn_requests)]
    for load in args.loads.split(","):
        steps, kv_peak, arrivals = [], 0, []
        if load == "light":
            arrivals = [[(torch.tensor(d), params)] for d in docs[:4]]
        elif load == "heavy":
            arrivals = [[(torch.tensor(d), params) for d in docs]]
        t0 = time.perf_counter()
        if load == "churn":  # one arrival every --churn-gap steps, whatever is running
            queue = list(churn)
            while queue or sched.has_unfinished:
                if queue and (len(steps) % args.churn_gap == 0 or not sched.has_unfinished):
                    sched.submit(*queue.pop(0))
                s = time.perf_counter()
                sched.step()
                steps.append(time.perf_counter() - s)
                kv_peak = max(kv_peak, sched.kv_bytes)
        for batch in arrivals:
            for ids, prm in batch:
                sched.submit(ids, prm)
            while sched.has_unfinished:
                s = time.perf_counter()
                sched.step()
                steps.append(time.perf_counter() - s)
                kv_peak = max(kv_peak, sched.kv_bytes)
        wall = time.perf_counter() - t0
        steps.sort()
        out[load] = {"wall_s": round(wall, 3), "steps": len(steps), "prefix_hit_tokens": sched.stats["prefix_hit_tokens"],
                     "cached_pages_reused": sched.pool.stats["cached_pages_reused"],
                     "step_p50_ms": round(1e3 * statistics.median(steps), 2),
                     "step_p99_ms": round(1e3 * steps[min(len(steps) - 1, int(0.99 * len(steps)))], 2),
                     "kv_peak_mib": round(kv_peak / 2**20, 1), "arena_mib": round(sched.pool.nbytes / 2**20, 1),
                     "pages_allocated": sched.pool.capacity, "pages_budget": sched.pool.num_pages,
                     "growths": sched.pool.stats["arena_growths"], "rss_mib": round(rss_mib(), 1)}
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--kv-budget", default="512MiB")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="full,staged",
                    help="comma-separated: full, staged, request, blocks (full, one block per --kv-groups layer "
                         "group), each optionally with -pt (compiled layers off)")
    ap.add_argument("--kv-groups", default="5", help="the layer groups of the blocks configuration (default: %(default)s)")
    ap.add_argument("--loads", default="light,heavy", help="comma-separated: light, heavy, churn (in this order)")
    ap.add_argument("--churn-requests", type=int, default=48)
    ap.add_argument("--churn-gap", type=int, default=8, help="scheduler steps between two arrivals of the churn load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="share prompt pages between requests (off by default; per-request allocation has none)")
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    configs = args.configs.split(",")
    bad = [c for c in configs + ([args.child] if args.child else [])
           if c.removesuffix("-pt") not in ("full", "staged", "request", "blocks")]
    if bad or any(x not in ("light", "heavy", "churn") for x in args.loads.split(",")):
        ap.error(f"unknown configuration or load: {bad or args.loads}")
    from laserlm.errors import InvalidArgumentError  # noqa: PLC0415
    from laserlm.runtime.kv_pool import parse_kv_groups  # noqa: PLC0415

    try:
        parse_kv_groups(args.kv_groups)  # syntax, before any model loads (the tiling is checked with the model)
    except InvalidArgumentError as e:
        ap.error(str(e))
    if "--kv-groups" in sys.argv and not any(c.removesuffix("-pt") == "blocks" for c in configs):
        ap.error("--kv-groups applies to the blocks configuration only: add blocks to --configs")
    if args.child:
        print(json.dumps(child(args)))
        return
    argv = [a for a in sys.argv[1:]]
    runs = []
    for r in range(args.rounds):
        for pre in configs:
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
