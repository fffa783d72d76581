#!/usr/bin/env bash
# decode speed before (4132c61, before the issue-36 step) and after (HEAD), alternated, alone; Gemma and SmolLM2 native
set -u
OUT=/work/main/benchmarks/out/issue36_ab; mkdir -p $OUT
{ date -u; uptime; lscpu | grep "Model name"; } > $OUT/run.txt
for r in 1 2 3; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/work/before
    for m in smollm2-135m gemma3-270m; do
      (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m laserlm.cli bench -m $m --weights native \
        --configs "full;speculative:draft=ngram;adaptive:policy=confidence,threshold=0.9" \
        --tests pp,tg -p 128 -n 64 -t 1 --reps 3 --warmup 1 --no-hf --no-llamacpp --no-progress \
        --json $OUT/${m}_${side}_$r.json > $OUT/${m}_${side}_$r.md 2>&1)
    done
  done
done
{ date -u; uptime; } >> $OUT/run.txt
