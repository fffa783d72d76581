"""Compute roofline of prefill on this CPU: how many multiply-adds per second each arithmetic can do, and what that
means for a pp512 target.

Decode (T = 1) is bound by the bytes of weights read (laserlm.bench.utilization); prefill and batches of many rows
are bound by arithmetic. This script measures, in one process and on one thread count:

1. the peak of the two instructions that could carry the work: ``vpmaddwd`` (int16 x int16 -> int32, 16
   multiply-adds; the only integer dot product on AVX2 without int8 activations: ``vpmaddubsw`` needs a ``vpmaddwd``
   to widen its int16 sums, so int8 runs at the same 16 multiply-adds per ``vpmaddwd``) and ``vfmadd231ps``
   (float32, 8 multiply-adds), each as 8-10 independent chains in registers, no memory traffic;
2. the achieved rate of laserlm's block kernels (Q4_1 and Q8_0 blocks, int16 activations) and of the float32 BLAS
   matmul (torch) on the model's own layer shapes, at T = 1 ... 512 rows;
3. the multiply-adds of one pp512 token of the model (every decoder matrix, plus attention over the mean causal
   context of a 512-token prompt; the LM head runs only on the last position), and from it the ceiling of pp512
   tokens/s at each measured rate, next to ``--llamacpp-pp512`` if given.

    PYTHONPATH=. python benchmarks/bench_roofline.py --model gemma3-270m --threads 1 --llamacpp-pp512 197

Needs a C++ compiler (as the kernels do). Run alone on the machine: the peaks are per-core figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch import nn

import laserlm
from laserlm.models import kernels, quant

PEAK_SRC = r"""
#include <torch/extension.h>
#include <omp.h>
// Register-only loops in assembly (compiled C++ spilled the accumulators to the stack): 8 independent
// vpmaddwd + vpaddd chains, 10 independent vfmadd231ps chains; the vector contents do not matter for timing.
void madd_loop(int64_t iters) {
  asm volatile(
      "vpxor %%ymm14, %%ymm14, %%ymm14\n\t" "vpxor %%ymm15, %%ymm15, %%ymm15\n\t"
      "1:\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm8\n\t" "vpaddd %%ymm8, %%ymm0, %%ymm0\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm9\n\t" "vpaddd %%ymm9, %%ymm1, %%ymm1\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm10\n\t" "vpaddd %%ymm10, %%ymm2, %%ymm2\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm11\n\t" "vpaddd %%ymm11, %%ymm3, %%ymm3\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm12\n\t" "vpaddd %%ymm12, %%ymm4, %%ymm4\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm13\n\t" "vpaddd %%ymm13, %%ymm5, %%ymm5\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm8\n\t" "vpaddd %%ymm8, %%ymm6, %%ymm6\n\t"
      "vpmaddwd %%ymm14, %%ymm15, %%ymm9\n\t" "vpaddd %%ymm9, %%ymm7, %%ymm7\n\t"
      "dec %0\n\t" "jnz 1b\n\t"
      : "+r"(iters) : : "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc");
}
void fma_loop(int64_t iters) {
  asm volatile(
      "vxorps %%ymm14, %%ymm14, %%ymm14\n\t" "vxorps %%ymm15, %%ymm15, %%ymm15\n\t"
      "1:\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n\t"
      "dec %0\n\t" "jnz 1b\n\t"
      : "+r"(iters) : : "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc");
}
// every thread of the team runs the loop; returns after the slowest
void madd_rate(int64_t iters, int64_t threads) {
#pragma omp parallel num_threads(threads)
  madd_loop(iters);
}
void fma_rate(int64_t iters, int64_t threads) {
#pragma omp parallel num_threads(threads)
  fma_loop(iters);
}
"""


def peaks(threads: int) -> dict:
    """GMAC/s of vpmaddwd (16 MAC each) and vfmadd231ps (8 MAC each) over ``threads`` threads, best of 3."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    build = os.path.join(tempfile.gettempdir(), "laserlm_roofline_" + kernels.build_key())
    os.makedirs(build, exist_ok=True)
    mod = cpp_extension.load_inline(name="laserlm_roofline", cpp_sources=[PEAK_SRC], functions=["madd_rate", "fma_rate"],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                    build_directory=build, verbose=False)
    out = {}
    for name, fn, macs in (("int16 vpmaddwd", mod.madd_rate, 8 * 16), ("float32 FMA", mod.fma_rate, 10 * 8)):
        iters, best = 20_000_000, float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn(iters, threads)
            best = min(best, time.perf_counter() - t0)
        out[name] = iters * macs * threads / best / 1e9
    return out


def layer_shapes(engine) -> list[tuple[int, int]]:
    """(N, K) of every matrix one decoder layer multiplies, averaged over layers by listing all of them."""
    shapes = []
    for layer in engine.adapter.layers:
        for m in layer.modules():
            if isinstance(m, (nn.Linear, quant.QuantLinear, quant.DenseLinear)):
                shapes.append((m.out_features, m.in_features))
    return shapes


def pp_macs_per_token(engine, n_prompt: int) -> dict:
    """Multiply-adds per prompt token of a ``n_prompt``-token prefill: matrices + attention (QK^T and PV over the
    mean causal context, capped by a sliding window)."""
    a = engine.adapter
    cfg = a.config
    mats = sum(n * k for n, k in layer_shapes(engine))
    heads, hd = cfg.num_attention_heads, a.head_dim
    window = getattr(cfg, "sliding_window", None)
    attn = 0.0
    for kind in a.layer_types:
        ctx = [min(p + 1, window) if (kind == "sliding_attention" and window) else p + 1 for p in range(n_prompt)]
        attn += 2 * heads * hd * sum(ctx) / n_prompt
    return {"matrices": mats, "attention": attn, "total": mats + attn}


def rate(fn, macs: float, min_s: float = 0.3) -> float:
    fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s or reps < 3:
        fn()
        reps += 1
    return macs * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--rows", default="1,4,16,64,512", help="activation rows T to time the matmuls at")
    p.add_argument("--llamacpp-pp512", type=float, help="llama.cpp's measured pp512 t/s, for the target line")
    p.add_argument("--laserlm-pp512", type=float, help="laserlm's measured pp512 t/s")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = laserlm.load(a.model, weights="native")
    eng = lm.engine
    pk = peaks(a.threads)
    work = pp_macs_per_token(eng, a.n_prompt)
    ops = kernels.ops()
    # the distinct matrices of one layer, as float32 and in both block formats
    shapes = sorted(set(layer_shapes(eng)))
    g = torch.Generator().manual_seed(0)
    rows = [int(t) for t in a.rows.split(",")]
    per_t = {}
    for t in rows:
        got = {"float32 BLAS": 0.0, "Q4_1 kernel": 0.0, "Q8_0 kernel": 0.0}
        secs = dict.fromkeys(got, 0.0)
        macs = 0
        for n, k in shapes:
            w = torch.randn(n, k, generator=g)
            x = torch.randn(t, k, generator=g)
            q4 = quant.kernel_layout(quant.quantize_q4_1(w), quant.Q4_1)
            q8 = quant.kernel_layout(quant.quantize_q8_0(w), quant.Q8_0)
            m = t * n * k
            macs += m
            fns = {"float32 BLAS": lambda: x @ w.T, "Q4_1 kernel": lambda: ops.qmatmul(x, q4, quant.Q4_1, k, n),
                   "Q8_0 kernel": lambda: ops.qmatmul(x, q8, quant.Q8_0, k, n)}
            for name, fn in fns.items():
                secs[name] += m / (rate(fn, m, 0.15) * 1e9)
        per_t[t] = {name: macs / s / 1e9 for name, s in secs.items()}
    best = max(max(v.values()) for v in per_t.values())
    print(f"{a.model}, {a.threads} thread(s); one pp{a.n_prompt} token = {work['matrices'] / 1e6:.1f} M MAC in "
          f"matrices + {work['attention'] / 1e6:.1f} M in attention = {work['total'] / 1e6:.1f} M MAC\n")
    print("| arithmetic | GMAC/s | pp ceiling t/s |")
    print("|---|---|---|")
    for name, v in pk.items():
        print(f"| peak {name} (registers only) | {v:.1f} | {v * 1e9 / work['total']:.0f} |")
    for t, v in per_t.items():
        for name, r in v.items():
            print(f"| {name}, T = {t} rows, this model's layer shapes | {r:.1f} | {r * 1e9 / work['total']:.0f} |")
    print()
    if a.laserlm_pp512:
        print(f"laserlm pp512 {a.laserlm_pp512:.0f} t/s = {a.laserlm_pp512 * work['total'] / 1e9:.1f} GMAC/s")
    if a.llamacpp_pp512:
        need = 2 * a.llamacpp_pp512 * work["total"] / 1e9
        print(f"llama.cpp pp512 {a.llamacpp_pp512:.0f} t/s = {a.llamacpp_pp512 * work['total'] / 1e9:.1f} GMAC/s; "
              f"2x llama.cpp needs {need:.1f} GMAC/s sustained = {need / pk['float32 FMA']:.0%} of the float32 FMA "
              f"peak, {need / pk['int16 vpmaddwd']:.0%} of the vpmaddwd peak, {need / best:.0%} of the best "
              f"achieved matmul rate above")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "threads": a.threads, "macs_per_token": work, "peaks_gmacs": pk,
                       "matmul_gmacs": per_t, "llamacpp_pp512": a.llamacpp_pp512,
                       "laserlm_pp512": a.laserlm_pp512}, f, indent=2)


if __name__ == "__main__":
    main()
