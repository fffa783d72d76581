#!/usr/bin/env bash
# Issue 34's 8B row: Llama-3.1-8B Q4_K_M (random weights, benchmarks/synthetic_models.py) on this machine, alone:
# cold and warm load (a whole `laserlm generate` process under GNU time), then pp512/tg128 beside llama-bench at
# 1 and 2 threads, then the read bandwidth and laserlm's bytes per token.
#   bash benchmarks/run_issue34_8b.sh /work/synth/llama-3.1-8b-Q4_K_M.gguf <llama.cpp tree>
set -euo pipefail
GGUF=$1; TREE=$2; OUT=benchmarks/out/issue34
mkdir -p "$OUT"
{ echo "8b start $(date -u)"; uptime; } >> "$OUT/machine.txt"
for kind in cold warm; do
  /usr/bin/time -f "$kind %e s %M KB" laserlm generate "The capital of France is" --model "$GGUF" -n 8 --threads 2 \
    2>&1 | tail -2 | tee -a "$OUT/load_8b.txt"
done
python benchmarks/bench_engines.py --rounds 1 --reps 1 --threads 2,1 --models "$GGUF" \
  --llama-bench "$TREE/build/bin/llama-bench" --out "$OUT/engines_llama8b.json" 2>&1 | tee "$OUT/engines_llama8b.txt"
python - "$GGUF" <<'PY' | tee "$OUT/bandwidth_8b.txt"
import sys, torch, laserlm
from laserlm.bench.utilization import read_bandwidth, bytes_per_token
for t in (1, 2):
    torch.set_num_threads(t)
    print(f"read bandwidth, {t} thread(s): {read_bandwidth() / 1e9:.1f} GB/s")
lm = laserlm.load(sys.argv[1])
print("bytes per token (full depth, context 64):", bytes_per_token(lm.engine, lm.engine.num_layers, 64))
PY
{ echo "8b end $(date -u)"; uptime; } >> "$OUT/machine.txt"
