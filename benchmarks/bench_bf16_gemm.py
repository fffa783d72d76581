"""bfloat16 vs float32 GEMM rate of PyTorch (oneDNN / BLAS) on the bundled models' prefill shapes, 1 thread.

Decides whether ``--prefill-dtype auto`` should pick bfloat16 on a CPU (``kernels.hardware_bf16_gemm``).
Usage: ``PYTHONPATH=. python benchmarks/bench_bf16_gemm.py`` (run alone).
"""

import time

import torch
import torch.nn.functional as F

from laserlm.models import kernels


def main() -> None:
    torch.set_num_threads(1)
    print("hardware_bf16_gemm:", kernels.hardware_bf16_gemm())
    for m, k, n in [(512, 576, 1536), (512, 1536, 576), (512, 640, 2048)]:  # SmolLM2 MLP up/down, Gemma3 MLP up
        x, w = torch.randn(m, k), torch.randn(n, k)
        xb, wb = x.bfloat16(), w.bfloat16()
        for name, f in [("float32", lambda: F.linear(x, w)), ("bfloat16", lambda: F.linear(xb, wb).float())]:
            f()
            t = time.perf_counter()
            for _ in range(20):
                f()
            dt = (time.perf_counter() - t) / 20
            print(f"{m} x {k} by {k} x {n} {name}: {2 * m * k * n / dt / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
