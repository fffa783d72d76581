#!/bin/bash
# ONNX decode A/B: before = 6fdfb62 (OnnxDecoder loop), after = HEAD (OnnxEngine on the one loop); same export dirs.
set -e
cd /work/main && . .venv/bin/activate
OUT=benchmarks/out/issue36_onnx_ab; mkdir -p $OUT
[ -d /tmp/wt_before ] || git worktree add -f /tmp/wt_before 6fdfb62 >/dev/null  # the commit before the ONNX engine
for w in fp32 native; do
  [ -f /tmp/ox_$w/manifest.json ] || laserlm export onnx -m smollm2-135m -w $w --out /tmp/ox_$w --no-progress > $OUT/export_$w.log 2>&1
done
uptime > $OUT/machine.txt; lscpu | grep 'Model name' >> $OUT/machine.txt
for r in 1 2 3; do
  for side in before after; do
    for w in fp32 native; do
      if [ $side = before ]; then cd /tmp/wt_before; else cd /work/main; fi
      PYTHONPATH=. python -c "import sys; from laserlm.cli import main; sys.exit(main())" bench --backend onnxruntime -m /tmp/ox_$w --configs full --tests pp,tg -p 128 -n 64 -t 1 --reps 3 --warmup 1 --json > /work/main/$OUT/${side}_${w}_r$r.json 2> /work/main/$OUT/${side}_${w}_r$r.err || echo "fail $side $w $r"
      cd /work/main
    done
  done
done
uptime >> $OUT/machine.txt
