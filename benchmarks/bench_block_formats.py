"""One matrix product per block format on laserlm's kernels: Q4_1, Q4_K, Q8_0 and Q6_K at the same shape (issue 34).

The question it answers: does keeping a GGUF's K-quant tensors as they are (Q4_K: 7.5 % fewer bytes than Q4_1; Q6_K:
23 % fewer than Q8_0) make a decode step faster, or do the kernels' extra work (scales per 32 weights from 6-bit
integers; 6-bit unpacking and a scale per 16 weights) cost more than the bytes save? The default shape is
Llama-3.2-1B's LM head (128,256 x 2,048), which a decode step reads once per token. Each format quantizes the same random matrix; the time is the median of ``--reps`` calls of ``T``
rows (1: a decode step; 4: a verify step or a batch) after warm-up, in this process's thread count.

    python benchmarks/bench_block_formats.py --threads 1 --out benchmarks/out/issue34/block_formats_t1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from laserlm.models import kernels, quant
from laserlm.reports import machine, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128256, help="N (output rows)")
    ap.add_argument("--cols", type=int, default=2048, help="K (a multiple of 256)")
    ap.add_argument("--tokens", default="1,4", help="comma-separated T (rows of activations)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.ops()
    if ops is None:
        raise SystemExit(f"the block kernels are not built: {kernels.unavailable_reason()}")
    n, k = args.rows, args.cols
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    mats = {name: (quant.kernel_layout(fn(w), fmt), fmt) for name, fmt, fn in (
        ("Q4_1", quant.Q4_1, quant.quantize_q4_1), ("Q4_K", quant.Q4_K, quant.quantize_q4_k),
        ("Q8_0", quant.Q8_0, quant.quantize_q8_0), ("Q6_K", quant.Q6_K, quant.quantize_q6_k))}
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(1))
        for name, (qw, fmt) in mats.items():
            for _ in range(3):
                ops.qmatmul(x, qw, fmt, k, n)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                ops.qmatmul(x, qw, fmt, k, n)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            rows.append({"format": name, "tokens": t, "ms": round(ms, 3), "mbytes": round(qw.numel() / 1e6, 1),
                         "gb_per_s": round(qw.numel() / ms / 1e6, 1)})
            print(f"T={t:<2} {name}: {ms:7.2f} ms  {qw.numel() / 1e6:6.1f} MB  {qw.numel() / ms / 1e6:5.1f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "date": now(), "isa": ops.kernel_isa(), "threads": args.threads,
                       "shape": [n, k], "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
