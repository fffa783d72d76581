#!/usr/bin/env bash
# Issue 11, last part: adaptive (calibrated), static and speculative modes against full depth on the fast path
# (native Q4_1 weights, compiled layer kernel), next to the same modes on the fp32 reference path, in one run per
# weight format; then the compute roofline of prefill (bench_roofline.py). Run alone on the machine.
#   LASER=path/to/smollm2_native.safetensors bash benchmarks/run_modes_fast_path.sh [OUT]
# The laser file comes from: laserlm calibrate -m smollm2-135m -w native -t 1 --target-agreement 0.90 -o $LASER
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/out/modes_fast_path}
: "${LASER:?set LASER to a calibrated .safetensors file}"
mkdir -p "$OUT"
{ date -u; lscpu | grep 'Model name'; uptime; } | tee "$OUT/machine.txt"
CONFIGS="adaptive:laser=$LASER;adaptive:laser=$LASER,policy=predictor;static:layers=28;static:layers=24"
CONFIGS="$CONFIGS;adaptive:policy=confidence,threshold=0.9;speculative:draft_layers=28,k=1,threshold=0.8"
CONFIGS="$CONFIGS;speculative:draft_layers=26,k=1,threshold=0.9;speculative:draft=ngram"
for w in native fp32; do
  .venv/bin/laserlm bench -m smollm2-135m -t 1 --weights $w --configs "$CONFIGS" --tests tg,gen -r 3 --no-hf \
    --no-llamacpp --no-progress --json "$OUT/modes_$w.json" | tee "$OUT/modes_$w.md"
done
for m in smollm2-135m gemma3-270m; do
  PYTHONPATH=. .venv/bin/python benchmarks/bench_roofline.py --model $m --threads 1 --json "$OUT/roofline_$m.json" \
    | tee "$OUT/roofline_$m.md"
done
uptime | tee -a "$OUT/machine.txt"
