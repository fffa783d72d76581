"""Per-step framework overhead: a 30-layer Llama with hidden size 64 (arithmetic ~0), so a decode step's
time is almost pure Python/dispatcher overhead. Interleaved in one run, milliseconds per decode step:

- ``engine``: laserlm engine (fast Llama layers, :mod:`laserlm.runtime.fast_layers`);
- ``engine_modules``: the same engine calling the transformers layer modules (``fast_layers = False``);
- ``hf_generate``: transformers ``generate(do_sample=False)`` with its dynamic cache;
- ``hf_forward``: a bare transformers forward loop with its cache (no generate machinery).

Usage: ``python benchmarks/bench_engine_overhead.py [--reps 3] [--steps 60] [--threads 1]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from laserlm.runtime import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa"
    engine = Engine(model, max_seq_len=512)
    n = args.steps
    ids = torch.tensor([[5]])

    def run_engine(fast: bool) -> float:
        engine.fast_layers = fast
        engine.reset()
        tok = engine.prefill(ids).logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = engine.decode_step(tok).logits[:, -1].argmax(-1)
        return (time.perf_counter() - t0) / n * 1e3

    def hf_generate() -> float:
        t0 = time.perf_counter()
        ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n + 1,
                     min_new_tokens=n + 1)
        return (time.perf_counter() - t0) / (n + 1) * 1e3

    def hf_forward() -> float:
        out = ref(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n):
            out = ref(tok, cache=past, use_cache=True, logits_to_keep=1)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / n * 1e3

    impls = {"engine": lambda: run_engine(True), "engine_modules": lambda: run_engine(False),
             "hf_generate": hf_generate, "hf_forward": hf_forward}
    times: dict[str, list[float]] = {k: [] for k in impls}
    with torch.inference_mode():
        for f in impls.values():  # warm-up
            f()
        for _ in range(args.reps):
            for k, f in impls.items():
                times[k].append(f())
    for k, v in times.items():
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print(f"{k:<15} {statistics.mean(v):7.2f} ± {sd:5.2f} ms/step  runs: {', '.join(f'{x:.2f}' for x in v)}")


if __name__ == "__main__":
    main()
