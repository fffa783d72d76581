#!/usr/bin/env bash
# Issue 33: evaluate one backbone delta end to end on SmolLM2 (native weights): full-depth quality against the
# original, calibration of exit gates at 0.90 and 0.95 agreement *with the original* (propagate bridge), and decode
# speed of the adapted model's modes against the original's full depth, interleaved in one run.
#   bash benchmarks/run_backbone_eval.sh DELTA OUTDIR [THREADS]
set -euo pipefail
DELTA=$1
OUT=$2
T=${3:-1}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
LASERLM=${LASERLM:-.venv/bin/laserlm}
echo "uptime before: $(uptime)" | tee "$OUT/uptime.txt"
lscpu | grep "Model name" | tee -a "$OUT/uptime.txt"
PYTHONPATH=. $PY benchmarks/bench_backbone_quality.py --delta "$DELTA" --threads "$T" --out "$OUT/quality.json"
W="$OUT/calib.work"
SIZES="--seq-len 128 --train-tokens 4096 --gate-tokens 2048 --calib-tokens 4096 --eval-tokens 2048 --head-steps 150
       --router-prompts 0 --no-predictor"
$LASERLM calibrate -m smollm2-135m --lora "$DELTA" $SIZES -t "$T" --work-dir "$W" --target-agreement 0.90 \
    -o "$OUT/laser_090.safetensors" --json --quiet > "$OUT/calibrate_090.json"
$LASERLM calibrate -m smollm2-135m --lora "$DELTA" $SIZES -t "$T" --work-dir "$W" --target-agreement 0.95 --resume \
    -o "$OUT/laser_095.safetensors" --json --quiet > "$OUT/calibrate_095.json"
PYTHONPATH=. $PY benchmarks/bench_backbone_speed.py --delta "$DELTA" --threads "$T" --tokens 64 --prompts 24 \
    --config "adaptive:laser=$OUT/laser_090.safetensors,patience=0" \
    --config "adaptive:laser=$OUT/laser_095.safetensors,patience=0" \
    --config "speculative:laser=$OUT/laser_090.safetensors,draft_layers=20,k=4,threshold=0.6" \
    --config "speculative:laser=$OUT/laser_090.safetensors,draft_layers=25,k=4,threshold=0.6" \
    --out "$OUT/speed.json"
echo "uptime after: $(uptime)" | tee -a "$OUT/uptime.txt"
