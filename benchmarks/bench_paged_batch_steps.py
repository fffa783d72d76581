"""Decode throughput of a paged batch on packed weights: one step of B rows (each at its own length) through
``Engine.run_layers`` over a :class:`~laserlm.runtime.kv_pool.PagedBatch`, for B = 1, 2, 4, 8, 16, with the
compiled kernel (all rows in one ``LayerStack.run_paged`` call) and with the packed PyTorch ops
(``engine.native_layers = False``). Prints a markdown table of ms per step and output tokens/s.

    PYTHONPATH=. python benchmarks/bench_paged_batch_steps.py --model smollm2-135m --weights native --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import laserlm
from laserlm.runtime.kv_pool import KVPool, PagedBatch, PagedCache


def step_times(engine, rows: int, prompt: int, steps: int) -> float:
    pool = KVPool.for_engine(engine, "1GiB")
    caches = [PagedCache(pool, prompt + 8 * r + steps + 4) for r in range(rows)]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for r, c in enumerate(caches):  # rows of different lengths: prompt, prompt + 8, ...
            engine.prefill(torch.randint(100, 20000, (1, prompt + 8 * r), generator=g), cache=c)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            h, st = engine.begin(torch.full((rows, 1), 7 + i), cache=PagedBatch(caches))
            h = engine.run_layers(0, engine.num_layers, h, st)
            engine.commit(st)
            engine.head(h)
            times.append(time.perf_counter() - t0)
    for c in caches:
        c.free()
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="native")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64, help="tokens of the shortest row (row r has 8 r more)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rows", default="1,2,4,8,16")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = laserlm.load(a.model, weights=a.weights)
    print(f"| path | " + " | ".join(f"B={b}" for b in a.rows.split(",")) + f" |  ({a.model}, {a.weights}, "
          f"{a.threads} thread(s); ms per step / output tok/s; median of {a.steps - 2} steps)")
    print("|---|" + "---|" * len(a.rows.split(",")))
    for native in (True, False):
        lm.engine.native_layers = native
        cells = []
        for b in map(int, a.rows.split(",")):
            t = step_times(lm.engine, b, a.prompt, a.steps)
            cells.append(f"{t * 1e3:.1f} / {b / t:.0f}")
        print(f"| {'kernel (run_paged)' if native else 'packed PyTorch ops'} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
