"""Seed 004's router (mode ``routed``): decode speed of every route of a laser file against full depth, and what
the certified router's route mix would give.

For each route of the file's router (``laserlm calibrate`` writes it; the summary's ``router`` section has the
route distribution and agreement) one request is forced onto that route (mode ``routed`` with a router that always
picks it) and decodes ``--tokens`` greedy tokens after each of ``--prompts`` WikiText-2 test paragraphs; full depth
runs the same requests. Routes and full depth alternate over ``--repeats`` rounds, and the median decode rate
(tokens/s after the first token) is kept. The expected speed of the certified router is the harmonic mix of the
route speeds weighted by its route distribution on the held-out prompts, read from the calibrate summary
(``--summary``, the ``--json`` output of ``laserlm calibrate``).

Usage (run alone; record ``uptime`` before and after)::

    PYTHONPATH=. python benchmarks/bench_router.py --laser t90.laser.safetensors --summary t90.json \\
        --out benchmarks/out/router/speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--laser", required=True, help="a laser file with a router")
    ap.add_argument("--summary", help="the calibrate --json summary (for the certified route mix)")
    ap.add_argument("--data", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    import laserlm
    from laserlm.depth.laser_file import load_laser_file
    from laserlm.depth.router import DynamicRouter, RoutedDepth
    from laserlm.runtime.loop import generate_tokens
    from laserlm.runtime.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    lm = laserlm.load(args.model, weights=args.weights, threads=args.threads)
    eng = lm.engine
    art = load_laser_file(args.laser, lm)
    routes, L = art.router.routes, eng.num_layers
    prompts = []
    for line in Path(args.data).read_text(encoding="utf-8").splitlines():
        ids = lm.tokenizer(line.strip())["input_ids"] if line.strip() and not line.strip().startswith("=") else []
        if len(ids) >= args.prompt_tokens:
            prompts.append(torch.tensor(ids[:args.prompt_tokens]))
        if len(prompts) == args.prompts:
            break

    def forced(i):
        r = DynamicRouter(eng.config.hidden_size, routes, confidence=0.5)
        with torch.no_grad():
            r.linear.weight.zero_()
            r.linear.bias.copy_(20.0 * torch.nn.functional.one_hot(torch.tensor(i), len(routes)).float())
        return RoutedDepth(eng, r, art.heads)

    modes = {routes[i].describe(L): forced(i) for i in range(len(routes))}
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rates = {k: [] for k in modes}
    for _ in range(args.repeats):
        for name, mode in modes.items():
            n, secs = 0, 0.0
            for ids in prompts:
                t_first = None
                for _ev in generate_tokens(eng, mode, ids, params, args.tokens):
                    if t_first is None:
                        t_first = time.perf_counter()
                n += args.tokens - 1
                secs += time.perf_counter() - t_first
            rates[name].append(n / secs)
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"model": args.model, "weights": args.weights, "threads": args.threads, "laser": str(args.laser),
           "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
           "speedup_vs_full": {k: round(v / med["full"], 3) for k, v in med.items()},
           "layers": {r.describe(L): len(r.kept) for r in routes}}
    if args.summary:
        held = json.loads(Path(args.summary).read_text())["router"]["held_out"]
        dist = held["routes"]
        total = sum(dist.values())
        secs_per_token = sum(c / total / med[k] for k, c in dist.items())
        out["certified_mix"] = {"routes": dist, "speedup_vs_full": round(1 / secs_per_token / med["full"], 3)}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
