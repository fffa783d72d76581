"""Where a decoding mode's time goes per generated token: decoder layers (``Engine.run_layers``), heads (final norm +
LM head, exit heads included: ``ModelAdapter.logits``) and everything else (exit checks, gates, the walk over layer
groups, drafting, sampling, the generate loop). Best of 3 runs of 128 greedy tokens per mode, one process.

    PYTHONPATH=. python benchmarks/bench_mode_overhead.py --weights native full "adaptive:laser=FILE" static:layers=24
"""

from __future__ import annotations

import argparse
import time

import torch

import laserlm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", help="mode specs, as in `laserlm generate --mode`")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="native")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", default="The history of the city of London begins")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = laserlm.load(a.model, weights=a.weights)
    eng = lm.engine
    acc = {"layers": 0.0, "heads": 0.0}
    run_layers, logits = eng.run_layers, eng.adapter.logits

    def timed(fn, key):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            acc[key] += time.perf_counter() - t0
            return out
        return wrapper

    eng.run_layers = timed(run_layers, "layers")
    eng.adapter.logits = timed(logits, "heads")
    print(f"| mode | ms/token | layers | heads | other | ({a.model}, --weights {a.weights}, {a.threads} thread(s), "
          f"{a.tokens} tokens, best of 3)")
    print("|---|---|---|---|---|")
    for spec in a.specs:
        lm.generate(a.prompt, max_new_tokens=8, mode=spec, ignore_eos=True)  # build the mode, warm up
        best = None
        for _ in range(3):
            acc["layers"] = acc["heads"] = 0.0
            t0 = time.perf_counter()
            lm.generate(a.prompt, max_new_tokens=a.tokens, mode=spec, ignore_eos=True)
            total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, dict(acc))
        total, parts = best
        ms = {k: v / a.tokens * 1e3 for k, v in parts.items()}
        print(f"| {spec} | {total / a.tokens * 1e3:.2f} | {ms['layers']:.2f} | {ms['heads']:.2f} | "
              f"{total / a.tokens * 1e3 - ms['layers'] - ms['heads']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
