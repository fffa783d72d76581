#!/usr/bin/env bash
# Full-depth reference numbers for benchmarks/history/results_eval.md (issue #3).
# Usage: benchmarks/run_eval_reference.sh [MODEL] [LIMIT] [PPL_WINDOWS] [THREADS]
# One thread per process: on the shared 2-core machine, 2 threads per process under load from other
# jobs ran ~10x slower than 1 thread (OpenMP threads waiting on descheduled peers).
set -euo pipefail
MODEL=${1:-smollm2-135m}
LIMIT=${2:-100}
WINDOWS=${3:-40}
THREADS=${4:-1}
OUT=benchmarks/out/eval_runs
mkdir -p "$OUT"
for DTYPE in float32 bfloat16; do
  tag="${MODEL}_${DTYPE}"
  laserlm eval -m "$MODEL" --dtype "$DTYPE" -t "$THREADS" --tasks wikitext,lambada,hellaswag,arc_easy,piqa \
    --limit "$LIMIT" --ppl-windows "$WINDOWS" --no-progress --json "$OUT/${tag}_eval.json" | tee "$OUT/${tag}_eval.md"
  laserlm bench -m "$MODEL" --dtype "$DTYPE" -t "$THREADS" --reps 5 --warmup 1 --no-progress \
    --json "$OUT/${tag}_bench.json" --plot "$OUT/${tag}_bench.png" | tee "$OUT/${tag}_bench.md"
done
