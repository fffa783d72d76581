#!/usr/bin/env bash
# Side by side in one process per model and thread count: laserlm native / int4 vs llama.cpp (llama-cpp-python,
# same GGUF) vs transformers generate; pp512 and tg128, 5 reps. Needs the llamacpp extra. Run alone.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/out/fast_decode}
mkdir -p "$OUT"
{ date -u; lscpu | grep 'Model name'; uptime; } | tee "$OUT/machine_final.txt"
for m in smollm2-135m gemma3-270m; do
  for t in 1 2; do
    .venv/bin/laserlm bench -m $m -t $t --weights native,int4 --tests pp,tg -r 5 --no-progress \
      --json "$OUT/final_${m}_t$t.json" | tee "$OUT/final_${m}_t$t.md"
  done
done
uptime | tee -a "$OUT/machine_final.txt"
