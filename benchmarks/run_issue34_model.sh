#!/usr/bin/env bash
# One of issue 34's real-size architectures, made and measured, alone: the random-weight GGUF files
# (benchmarks/synthetic_models.py), the cold and warm load of each (a whole `laserlm generate` process under GNU
# time), then pp512 / tg128 beside llama-bench at 1 and 2 threads (bench_engines.py, which also records each
# process's peak RSS); the files are deleted afterwards unless KEEP=1.
#   bash benchmarks/run_issue34_model.sh qwen2.5-1.5b <llama.cpp tree> <scratch dir> [TYPES (default: Q4_0 Q4_K_M)]
#   ROUNDS=2 REPS=2 (defaults) set bench_engines' rounds and repetitions.
set -euo pipefail
NAME=$1; TREE=$2; DIR=$3; shift 3
TYPES=${*:-Q4_0 Q4_K_M}; OUT=benchmarks/out/issue34
mkdir -p "$OUT" "$DIR"
LOG="$OUT/model_$NAME.txt"
{ echo "== $NAME start $(date -u)"; uptime; } | tee -a "$LOG"
# shellcheck disable=SC2086
python benchmarks/synthetic_models.py "$NAME" --llama-cpp "$TREE" --types $TYPES --out "$DIR" 2>&1 | tail -4 | tee -a "$LOG"
FILES=""
for t in $TYPES; do
  f="$DIR/$NAME-$t.gguf"
  FILES="${FILES:+$FILES,}$f"
  for kind in cold warm; do
    /usr/bin/time -f "$NAME $t load $kind: %e s, peak RSS %M KB" laserlm generate "The capital of France is" --model "$f" \
      -n 8 --threads 2 2>&1 >/dev/null | tail -1 | tee -a "$LOG"
  done
done
{ echo "engines start $(date -u)"; uptime; } | tee -a "$LOG"
python benchmarks/bench_engines.py --rounds "${ROUNDS:-2}" --reps "${REPS:-2}" --threads 1,2 --models "$FILES" \
  --llama-bench "$TREE/build/bin/llama-bench" --out "$OUT/engines_$NAME.json" 2>&1 | tail -20 | tee -a "$LOG"
{ echo "== $NAME end $(date -u)"; uptime; } | tee -a "$LOG"
if [ "${KEEP:-0}" != 1 ]; then
  for t in $TYPES; do rm -f "$DIR/$NAME-$t.gguf"; done
fi
