#!/usr/bin/env bash
# Issue 17: wall clock of the complexity predictor against the exit gates at the same certified targets, one bench
# run per model (interleaved repetitions, full depth in the same run), alone on the machine.
#   bash benchmarks/run_predictor_vs_gates.sh MODEL PREFIX [OUT]
# PREFIX_T.safetensors for T in 0.90 0.95 0.99 come from (first target, then --resume for the others):
#   laserlm calibrate -m MODEL --seq-len 128 --train-tokens 4096 --gate-tokens 2048 --calib-tokens 4096 \
#     --eval-tokens 2048 --head-steps 150 --router-prompts 0 -t 1 --work-dir W --target-agreement T -o PREFIX_T.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$1; PREFIX=$2; OUT=${3:-benchmarks/out/predictor_vs_gates}
mkdir -p "$OUT"
NAME=$(basename "$PREFIX")
{ date -u; lscpu | grep 'Model name'; uptime; } | tee "$OUT/machine_$NAME.txt"
CONFIGS=""
for T in 0.90 0.95 0.99; do
  F="${PREFIX}_$T.safetensors"
  CONFIGS="$CONFIGS;adaptive:laser=$F;adaptive:laser=$F,policy=predictor"
done
.venv/bin/laserlm bench -m "$MODEL" -t 1 --configs "${CONFIGS#;}" --tests tg -n 128 -r 5 --no-hf --no-llamacpp \
  --no-progress --json "$OUT/bench_$NAME.json" | tee "$OUT/bench_$NAME.md"
uptime | tee -a "$OUT/machine_$NAME.txt"
