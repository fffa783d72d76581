#!/usr/bin/env bash
# The timed runs of 2026-12-03 for issues 13 and 16, one after another, alone on the machine (nothing else running).
# Usage: LASER=path/to/laser.safetensors OX=dir/for/exports bash benchmarks/run_issue13_16_alone.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LASER:?set LASER to a calibrated SmolLM2 laser file}"
: "${OX:?set OX to a scratch directory for the ONNX exports}"
PY=.venv/bin/python
LL=.venv/bin/laserlm
O=benchmarks/out
mkdir -p $O/onnx_adaptive $O/kv_pages
{ echo "lscpu: $(lscpu | grep 'Model name')"; echo "before: $(uptime)"; } > $O/onnx_adaptive/machine.txt
# issue 16: exports with the laser file (native blocks and float32), then engine and exports side by side
[ -f $OX/oxn/manifest.json ] || $LL export onnx --model smollm2-135m --out $OX/oxn --weights native --laser "$LASER" --max-len 1024 -t 1 2>&1 | grep -v Converting | tail -2
[ -f $OX/ox32/manifest.json ] || $LL export onnx --model smollm2-135m --out $OX/ox32 --laser "$LASER" --max-len 1024 -t 1 2>&1 | grep -v Converting | tail -2
echo "exports done: $(uptime)" >> $O/onnx_adaptive/machine.txt
$LL bench -m smollm2-135m --weights native,fp32 --onnx $OX/oxn --onnx $OX/ox32 --config full --config "adaptive:laser=$LASER" \
    --tests pp,tg -t 1 --reps 3 --no-hf --no-llamacpp --json $O/onnx_adaptive/bench_smollm2.json 2>&1 | grep -v Converting | tee $O/onnx_adaptive/bench_smollm2.txt
echo "after bench: $(uptime)" >> $O/onnx_adaptive/machine.txt
PYTHONPATH=. $PY benchmarks/profile_onnx_step.py $OX/oxn --tokens 64 | tee $O/onnx_adaptive/profile_step_native.txt
# issue 13: page sizes and compaction, then the batch workload on native weights
echo "kv pages before: $(uptime)" > $O/kv_pages/machine.txt
PYTHONPATH=. $PY benchmarks/bench_kv_pages.py --skip none --out $O/kv_pages/pages_compact.json 2>&1 | grep -v Converting | tee $O/kv_pages/pages_compact.txt
echo "kv pages after: $(uptime)" >> $O/kv_pages/machine.txt
PYTHONPATH=. $PY benchmarks/bench_batch.py --weights native --docs 32 --new-tokens 64 --max-batch 16 --skip hf llama churn poisson adaptive \
    --out $O/kv_pages/batch_native.json 2>&1 | grep -v Converting | tee $O/kv_pages/batch_native.txt
echo "batch after: $(uptime)" >> $O/kv_pages/machine.txt
