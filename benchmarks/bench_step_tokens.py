"""Step time of a T-token forward relative to T = 1, per weight format: the price of verifying T - 1 draft tokens,
of the deferred bridge's 2-token step, or of a T-row batch on one sequence's weights. Prints a markdown table (and
writes JSON with ``--out``).

    python benchmarks/bench_step_tokens.py --model smollm2-135m --weights native,fp32 --threads 1

To compare kernels, run the same command from another checkout (``PYTHONPATH=OTHER_CHECKOUT``), alternating.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--tokens", default="1,2,3,4,8,16", help="step widths T (the first is the base)")
    p.add_argument("--out", default=None, help="also write the medians (seconds) as JSON")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    widths = [int(t) for t in a.tokens.split(",")]
    print(f"| weights | T={widths[0]} ms | " + " | ".join(f"T={t}" for t in widths[1:]) + f" |  ({a.model}, "
          f"{a.threads} thread(s), {a.context} cached positions, median of {a.reps}, laserlm from {laserlm.__file__})")
    print("|---|" + "---|" * len(widths))
    out = {"model": a.model, "threads": a.threads, "context": a.context, "laserlm": laserlm.__file__, "rows": {}}
    for w in a.weights.split(","):
        lm = laserlm.load(a.model, weights=w)
        eng = lm.engine
        ctx = torch.randint(0, 1000, (1, a.context))
        eng.reset()
        with torch.inference_mode():
            eng.forward(ctx)
            samples = {t: [] for t in widths}
            toks = {t: torch.randint(0, 1000, (1, t)) for t in widths}
            for rep in range(a.reps + 3):  # widths interleaved, so that a slow stretch of the machine hits all alike
                for t in widths:
                    eng.truncate(a.context)
                    t0 = time.perf_counter()
                    eng.forward(toks[t], logits="all")
                    if rep >= 3:
                        samples[t].append(time.perf_counter() - t0)
            times = {t: statistics.median(v) for t, v in samples.items()}
        base = times[widths[0]]
        out["rows"][w] = times
        cells = [f"{base * 1e3:.2f}"] + [f"{times[t] / base:.2f}x" for t in widths[1:]]
        print(f"| {w} | " + " | ".join(cells) + " |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
