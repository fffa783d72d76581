#!/usr/bin/env bash
# Second pass of issue 11 (faster Q4_1 kernel, vectorized attention, LayerStack), side by side in one process per
# model and thread count: laserlm native / int4 vs llama.cpp (llama-cpp-python, same GGUF) vs transformers generate.
# Then the T-token step table and the quality of `native`. Needs the llamacpp extra. Run alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/out/fast_decode2}
mkdir -p "$OUT"
{ date -u; lscpu | grep 'Model name'; uptime; } | tee "$OUT/machine.txt"
for t in 1 2; do
  .venv/bin/laserlm bench -m smollm2-135m -t $t --weights native,int4 --tests pp,tg -r 10 --no-progress \
    --json "$OUT/smollm2_r10_t$t.json" | tee "$OUT/smollm2_r10_t$t.md"
  .venv/bin/laserlm bench -m gemma3-270m -t $t --weights native,int4 --tests pp,tg -r 5 --no-progress \
    --json "$OUT/gemma3_t$t.json" | tee "$OUT/gemma3_t$t.md"
done
{ PYTHONPATH=. .venv/bin/python benchmarks/bench_step_tokens.py --model smollm2-135m --weights native,int8 --threads 1
  PYTHONPATH=. .venv/bin/python benchmarks/bench_step_tokens.py --model gemma3-270m --weights native --threads 1
} | tee "$OUT/step_tokens.md"
for m in smollm2-135m gemma3-270m; do
  PYTHONPATH=. .venv/bin/python benchmarks/quality_weights.py --model $m --weights native --windows 12 | tee "$OUT/quality_$m.md"
done
uptime | tee -a "$OUT/machine.txt"
