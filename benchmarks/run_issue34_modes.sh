#!/usr/bin/env bash
# Issue 34: every mode at 1B (a random-weight Llama-3.2-1B GGUF from benchmarks/synthetic_models.py): generate in
# full / adaptive (untrained exit heads) / speculative draft=ngram / static, a continuous batch, one served request,
# and a small `laserlm calibrate` timed per 1k training tokens. Random weights: quality figures are meaningless here,
# only "runs", time and RSS are reported.
#   bash benchmarks/run_issue34_modes.sh /work/synth/llama-3.2-1b-Q4_0.gguf [threads]
set -uo pipefail
M=$1; T=${2:-2}; OUT=benchmarks/out/issue34; mkdir -p "$OUT"; LOG=$OUT/modes_1b.txt
: > "$LOG"
{ echo "start $(date -u)"; uptime; } >> "$LOG"
P="The history of the Roman Empire begins with"
for mode in full "adaptive:groups=4,policy=confidence,threshold=0.9" "speculative:draft=ngram" "static:drop=4/8/12"; do
  echo "== generate --mode $mode" >> "$LOG"
  /usr/bin/time -f "rc=%x %e s %M KB" laserlm generate "$P" -m "$M" -n 32 -t "$T" --mode "$mode" 2>&1 | tail -2 >> "$LOG"
done
printf '%s\n' "$P" "Once upon a time" "The three laws of thermodynamics" "def fibonacci(n):" > /tmp/issue34_prompts.txt
echo "== batch" >> "$LOG"
/usr/bin/time -f "rc=%x %e s %M KB" laserlm batch /tmp/issue34_prompts.txt -m "$M" -n 16 -t "$T" -o /tmp/issue34_batch.jsonl 2>&1 | tail -2 >> "$LOG"
echo "== serve" >> "$LOG"
laserlm serve --model "$M" --threads "$T" --port 8577 > /tmp/issue34_serve.log 2>&1 &
SRV=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8577/health > /dev/null && break; sleep 1; done
NAME=$(curl -s http://127.0.0.1:8577/v1/models | python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
curl -s http://127.0.0.1:8577/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$NAME\", \"prompt\": \"$P\", \"max_tokens\": 16, \"temperature\": 0}" \
  | python -c "import json,sys; r=json.load(sys.stdin); print('served:', r['usage'] if 'usage' in r else r)" >> "$LOG" 2>&1
kill $SRV; wait $SRV 2>/dev/null
echo "== calibrate (1,024 train tokens)" >> "$LOG"
timeout 900 /usr/bin/time -f "rc=%x %e s %M KB" laserlm calibrate -m "$M" -t "$T" --train-tokens 1024 \
  --gate-tokens 1024 --calib-tokens 1024 --eval-tokens 1024 --no-predictor --quiet \
  -o /tmp/issue34_1b.laser.safetensors 2>&1 | tail -3 >> "$LOG"
{ echo "end $(date -u)"; uptime; } >> "$LOG"
cat "$LOG"
