#!/usr/bin/env bash
# pp512 with the bfloat16 vs float32 prefill on a CPU with AVX512-BF16 and no AMX (AMD Zen 4), both bundled models,
# 1 and 2 threads. Usage: bash benchmarks/run_prefill_zen4.sh OUTDIR   (run alone: /work/bin/alone or nothing else)
set -euo pipefail
OUT=${1:?usage: run_prefill_zen4.sh OUTDIR}
mkdir -p "$OUT"
LM=${LM:-.venv/bin/laserlm}
lscpu | grep "Model name" | tee "$OUT/machine.txt"
uptime | tee -a "$OUT/machine.txt"
for m in smollm2-135m gemma3-270m; do
  for t in 1 2; do
    for p in bfloat16 float32; do
      $LM bench -m $m -t $t --weights native --prefill-dtype $p --tests pp -r 3 --no-hf --no-llamacpp --no-progress \
        --json "$OUT/${m%%-*}_t${t}_prefill_${p}.json" | tee "$OUT/${m%%-*}_t${t}_prefill_${p}.md"
    done
  done
done
uptime | tee -a "$OUT/machine.txt"
