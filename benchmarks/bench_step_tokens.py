"""Step time of a T-token forward (T = 1, 2, 4, 8) relative to T = 1, per weight format: the cost of
verifying k+1 draft tokens or of the deferred bridge's 2-token step. Prints a markdown table.

    python benchmarks/bench_step_tokens.py --model smollm2-135m --weights native,fp32 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import laserlm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="native,fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=128, help="cached positions before the step")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"| weights | T=1 ms | T=2 | T=4 | T=8 |  ({a.model}, {a.threads} thread(s), {a.context} cached positions, "
          f"median of {a.reps})")
    print("|---|---|---|---|---|")
    for w in a.weights.split(","):
        lm = laserlm.load(a.model, weights=w)
        eng = lm.engine
        ctx = torch.randint(0, 1000, (1, a.context))
        eng.reset()
        with torch.inference_mode():
            eng.forward(ctx)
            times = {}
            for t in (1, 2, 4, 8):
                toks = torch.randint(0, 1000, (1, t))
                samples = []
                for _ in range(a.reps + 3):
                    eng.truncate(a.context)
                    t0 = time.perf_counter()
                    eng.forward(toks, logits="all")
                    samples.append(time.perf_counter() - t0)
                times[t] = statistics.median(samples[3:])
        base = times[1]
        cells = [f"{base * 1e3:.2f}"] + [f"{times[t] / base:.2f}x" for t in (2, 4, 8)]
        print(f"| {w} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
