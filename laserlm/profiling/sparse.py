"""Block-sparse attention density vs context length, measured on real text (seed 004; MInference, Quest).

For each length ``n`` the first ``n`` tokens of a long document are prefilled once with dense attention and
once with :class:`~laserlm.attention.kernel.SparseAttention` at the given settings; the kernel's mean
density (fraction of (query block, key block) pairs computed, sparse layers only) and both wall-clock times
are reported, with the agreement of the last position's top-1 as a cheap quality check.
"""

from __future__ import annotations

import time

import torch

from ..attention import configure


def _prefill(engine, x: torch.Tensor, tail: int) -> tuple[torch.Tensor, float]:
    """Stand-alone forward of ``x [1, n]``: top-1 of the last ``tail`` positions and the seconds taken."""
    t0 = time.perf_counter()
    h, st = engine.begin(x, use_cache=False)
    h = engine.run_layers(0, engine.num_layers, h, st)
    top = engine.head(h[:, -tail:])[0].argmax(-1)
    return top, time.perf_counter() - t0


@torch.inference_mode()
def density_vs_context(engine, ids: torch.Tensor, lengths: list[int], attention: str = "sparse",
                       progress=None, tail: int = 256) -> list[dict]:
    """``[{"context", "density", "dense_s", "sparse_s", "top1_agree"}]`` per length (lengths beyond
    ``ids`` or the engine's context size are skipped); ``top1_agree`` over the last ``tail`` positions.
    ``engine.kernel`` is restored afterwards."""
    saved = engine.kernel
    rows = []
    try:
        for n in lengths:
            if n > ids.shape[0] or n > engine.max_seq_len:
                continue
            x = ids[:n].unsqueeze(0)
            engine.kernel = None
            dense, dense_s = _prefill(engine, x, tail)
            kernel = configure(engine, attention)
            kernel.reset_stats()
            sparse, sparse_s = _prefill(engine, x, tail)
            rows.append({"context": n, "density": kernel.summary()["density"], "dense_s": dense_s,
                         "sparse_s": sparse_s,
                         "top1_agree": float((dense == sparse).float().mean())})
            if progress:
                progress()
    finally:
        engine.kernel = saved
    return rows
