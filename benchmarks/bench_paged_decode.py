"""Decode speed of one request and of small batches on the paged KV pool (the scheduler / server path) against
``LaserLM.generate`` (contiguous cache), native weights, and the row-by-row kernel A/B for small batches.

Usage (run alone; record ``uptime`` before and after)::

    PYTHONPATH=. python benchmarks/bench_paged_decode.py --threads 2

Prints TPOT (ms per token, mean over the batch's requests) for ``generate``, ``generate_batch`` of 1 prompt, and
batches of 2 and 4 with ``KERNEL_BATCH_ROWS`` = 1 (batched PyTorch ops) and 4 (the kernel row by row), for a
short prompt and one of about 350 tokens, each A/B pair twice in alternating order.
"""

from __future__ import annotations

import argparse

import torch

import laserlm
from laserlm.runtime import packed_layers


def tpot(results) -> float:
    return sum(1000 / r.decode_tokens_per_s for r in results) / len(results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = laserlm.load("smollm2-135m")
    short = "Explain why the sky is blue in simple words."
    long = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 25)
    n = args.tokens
    lm.generate(short, max_new_tokens=8)
    default = packed_layers.KERNEL_BATCH_ROWS
    for rep in range(2):
        g = lm.generate(short, max_new_tokens=n, ignore_eos=True)
        b = lm.generate_batch([short], max_new_tokens=n, ignore_eos=True)
        print(f"short prompt, one request: generate {1000 / g.decode_tokens_per_s:.1f} ms/token, "
              f"paged (generate_batch) {tpot(b):.1f} ms/token", flush=True)
    for name, p in (("short", short), ("long~350", long)):
        for size in (2, 4):
            res: dict = {}
            for rep in range(2):
                for lim in ((1, 4) if rep == 0 else (4, 1)):
                    packed_layers.KERNEL_BATCH_ROWS = lim
                    res.setdefault(lim, []).append(tpot(lm.generate_batch([p] * size, max_new_tokens=n,
                                                                          ignore_eos=True)))
            print(f"{name} batch {size}: batched PyTorch ops {[round(x, 1) for x in res[1]]} ms/token, kernel row by "
                  f"row {[round(x, 1) for x in res[4]]} ms/token", flush=True)
    packed_layers.KERNEL_BATCH_ROWS = default


if __name__ == "__main__":
    main()
