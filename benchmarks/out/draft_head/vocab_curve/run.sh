#!/bin/bash
# RESULTS "The draft head's vocabulary curve": one data set (the model's greedy answers to 256 ARC/PIQA questions and
# 512 open requests, 64 WikiText-2 valid records; features collected once in W and reused), heads with draft
# vocabularies of k = 2k, 4k, 8k and the full 49,152 tokens, 5 epochs each; then the draft cost and open-chat speed.
set -euo pipefail
W=${W:-/tmp/dh_curve}
OUT=benchmarks/out/draft_head/vocab_curve
mkdir -p "$W"
for k in 2048 4096 8192 49152; do
  /usr/bin/time -v laserlm train-draft-head -m smollm2-135m -w native --threads 1 --chat-records 256 \
    --instruction-records 512 --text-records 64 --seq-len 192 --epochs 5 --vocab $k -o $W/head_$k.safetensors \
    --work-dir $W/work --keep-data --json > $OUT/train_$k.json 2> $W/train_$k.err
done
# chain against tree drafts, priced on this CPU (benchmarks/bench_draft_tree.py), for the shipped head and each point
PYTHONPATH=. python benchmarks/bench_draft_tree.py --threads 1 --out benchmarks/out/draft_head/tree_sim.json
for k in 2048 4096 8192; do
  PYTHONPATH=. python benchmarks/bench_draft_tree.py --threads 1 --head $W/head_$k.safetensors --shapes 1x1,4x2 \
    --out $OUT/tree_sim_$k.json
done
