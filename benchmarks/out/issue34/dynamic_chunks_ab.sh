#!/bin/bash
# Alternated A/B of 2-thread decode: two laserlm checkouts (OLD, NEW: e.g. git worktrees of f948312, the second with
# dynamic_chunks.patch applied) and llama-bench, ROUNDS rounds, each arm three tg128 repetitions (tg_probe.py).
#   M=<llama-3.2-1b-Q4_0.gguf> OLD=<checkout> NEW=<checkout> LLAMA_BENCH=<tree>/build/bin/llama-bench \
#     PY=<venv>/bin/python bash dynamic_chunks_ab.sh > dynamic_chunks_ab_2threads.txt
HERE=$(cd "$(dirname "$0")" && pwd)
T=${T:-2}; PY=${PY:-python}
cd "${TMPDIR:-/tmp}"; uptime   # not a checkout's root: python -m / -c would import that checkout first
for r in $(seq 1 "${ROUNDS:-8}"); do
  for arm in old new; do
    dir=$OLD; [ "$arm" = new ] && dir=$NEW
    echo "round $r $arm $(PYTHONPATH=$dir "$PY" "$HERE/tg_probe.py" "$M" "$T" 3 2>&1 | grep rep | awk '{print $4}' | tr '\n' ' ')"
  done
  echo "round $r llama $("$LLAMA_BENCH" -m "$M" -t "$T" -p 0 -n 128 -r 3 -o csv 2>/dev/null | tail -1 | awk -F, '{print $(NF-1)}')"
done
uptime
