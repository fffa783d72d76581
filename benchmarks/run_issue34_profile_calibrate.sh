#!/usr/bin/env bash
# Issue 34 items 4-5 at one model size: `laserlm profile` (timing parts only: the LM head's share of a decode step,
# break-even exit rates, the predicted and measured static-pruning speedup) and the time and peak RSS of a small
# `laserlm calibrate` (1,024 training tokens), on a random-weight GGUF from benchmarks/synthetic_models.py. Random
# weights: the profile's agreement, Block Influence and sensitivity columns describe noise, not a model; only its
# timings mean anything. Run alone (uptime before and after is logged).
#   bash benchmarks/run_issue34_profile_calibrate.sh /work/synth/llama-3.2-1b-Q4_0.gguf [threads] [out-dir]
set -uo pipefail
M=$1; T=${2:-1}; OUT=${3:-benchmarks/out/issue34/profile_calibrate_$(basename "$M" .gguf)}
mkdir -p "$OUT"; LOG=$OUT/run.log
: > "$LOG"
{ echo "start $(date -u)"; uptime; lscpu | grep "Model name"; echo "model $M threads $T"; } >> "$LOG"
echo "== laserlm profile" >> "$LOG"
/usr/bin/time -f "rc=%x %e s %M KB" laserlm profile -m "$M" -t "$T" --tokens 512 --sensitivity-tokens 64 \
  --sparse-lengths none --no-progress --out "$OUT/profile" >> "$LOG" 2>&1
echo "== laserlm calibrate (1,024 training tokens)" >> "$LOG"
timeout 1800 /usr/bin/time -f "rc=%x %e s %M KB" laserlm calibrate -m "$M" -t "$T" --train-tokens 1024 \
  --gate-tokens 1024 --calib-tokens 1024 --eval-tokens 1024 --no-predictor --quiet \
  -o "$OUT/untrained.laser.safetensors" >> "$LOG" 2>&1
rm -f "$OUT/untrained.laser.safetensors"
{ echo "end $(date -u)"; uptime; } >> "$LOG"
cat "$LOG"
