#!/usr/bin/env bash
# Issue 11 benchmark: laserlm's weight formats vs llama.cpp (llama-bench and llama-cpp-python) vs transformers,
# pp512 / tg128 at 1 and 2 threads on both bundled models, multi-token step cost, and modes on the fast path.
# Usage: LLAMA_BENCH=/path/to/llama-bench bash benchmarks/run_fast_decode.sh [outdir]
# Run it alone on the machine; it records uptime before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/out/fast_decode}
mkdir -p "$OUT"
PY=.venv/bin/python
LM=.venv/bin/laserlm
SMOL=$($PY -c "from laserlm.models.registry import BUNDLED; print(BUNDLED['smollm2-135m'].locate())")
GEM=$($PY -c "from laserlm.models.registry import BUNDLED; print(BUNDLED['gemma3-270m'].locate())")
{ date -u; lscpu | grep 'Model name'; uptime; } | tee "$OUT/machine.txt"
if [ -n "${LLAMA_BENCH:-}" ]; then
  "$LLAMA_BENCH" -m "$SMOL" -m "$GEM" -t 1,2 -p 512 -n 128 -r 5 -o md | tee "$OUT/llama_bench.md"
fi
for t in 1 2; do
  $LM bench -m smollm2-135m -t $t --weights native,int4,int8,fp32,bf16 --tests pp,tg -r 3 --no-progress \
    --json "$OUT/smollm2_t$t.json" | tee "$OUT/smollm2_t$t.md"
  $LM bench -m gemma3-270m -t $t --weights native,int4,fp32 --tests pp,tg -r 3 --no-progress \
    --json "$OUT/gemma3_t$t.json" | tee "$OUT/gemma3_t$t.md"
  # the prefill dtype side by side (the rows above use the default, auto: bfloat16 on a CPU with AMX-BF16)
  for m in smollm2-135m gemma3-270m; do
    $LM bench -m $m -t $t --weights native --prefill-dtype float32 --tests pp -r 3 --no-hf --no-llamacpp --no-progress \
      --json "$OUT/${m%%-*}_t${t}_prefill_fp32.json" | tee "$OUT/${m%%-*}_t${t}_prefill_fp32.md"
  done
done
$PY benchmarks/bench_step_tokens.py --model smollm2-135m --weights native,int8,fp32 --threads 1 | tee "$OUT/step_tokens.md"
$PY benchmarks/bench_step_tokens.py --model gemma3-270m --weights native --threads 1 | tee -a "$OUT/step_tokens.md"
$LM bench -m smollm2-135m -t 1 --weights native --tests tg -r 3 --no-hf --no-llamacpp --no-progress \
  --config full --config static:layers=26 --config early-exit:layer=24 \
  --config "adaptive:groups=5,policy=confidence,threshold=0.9,bridge=deferred" \
  --config "speculative:draft_layers=20,k=3,threshold=0.0" \
  --json "$OUT/modes_native.json" | tee "$OUT/modes_native.md"
uptime | tee -a "$OUT/machine.txt"
