"""Where an onnxruntime decode step goes: time per graph session, the runner's K/V concatenation and its input
checks, per generated token (full depth, greedy, after a 16-token prompt).

Usage (1 thread; run alone for figures to quote)::

    PYTHONPATH=. python benchmarks/profile_onnx_step.py EXPORT_DIR [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from laserlm.runtime.ort_engine import OnnxCache, OnnxEngine, OnnxModel


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = OnnxModel(args.export, threads=args.threads).warm()
    dec = OnnxEngine(model)
    dec.prefill((torch.arange(16) + 100).unsqueeze(0))
    spent = {"concat": 0.0, "check": 0.0}

    def timed(fn, key):
        def wrapper(*a):
            t = time.perf_counter()
            out = fn(*a)
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    run, check, append = model.run, model.check_inputs, OnnxCache.write
    model.run = lambda name, feeds: timed(run, name)(name, feeds)  # includes its input check
    model.check_inputs = timed(check, "check")
    OnnxCache.write = timed(append, "concat")
    tok, n = 5, args.tokens
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(dec.decode_step(torch.tensor([tok])).logits[0, 0].argmax())
    total = time.perf_counter() - t0
    OnnxCache.write = append
    print(f"{1000 * total / n:.2f} ms/token; ms/token per part (a graph's time includes its input check):")
    for k, v in spent.items():
        print(f"  {k}: {1000 * v / n:.3f}")


if __name__ == "__main__":
    main()
