#!/usr/bin/env bash
# Issue 5 benchmark: calibrate smollm2-135m at several targets, then quality (laserlm eval, test splits) and
# speed (laserlm bench) of the calibrated configurations next to static pruning and naive early exit, and the
# Pareto plot. Artifacts go to $ART (default /tmp/cf; ~5 MB each, not committed).
# Usage: bash benchmarks/run_calibration_pareto.sh [calibrate|eval|bench|plot|all]
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${ART:-/tmp/cf}
OUT=benchmarks/out
LL=".venv/bin/laserlm"
mkdir -p "$ART" "$OUT"
step=${1:-all}

if [[ $step == calibrate || $step == all ]]; then
  # one full default-size run (propagate, state gates), timed; the other targets reuse its trained modules
  /usr/bin/time -f "calibrate wall %e s" $LL calibrate -m smollm2-135m -o $ART/smol99.safetensors \
      --target-agreement 0.99 --delta 0.1 -t 2 --json > $OUT/calibrate_default_099.json
  for t in 80 95 90; do
    $LL calibrate -m smollm2-135m -o $ART/smol$t.safetensors --work-dir $ART/smol99.safetensors.work --resume \
        --target-agreement 0.$t --delta 0.1 -t 2 --json > $OUT/calibrate_default_0$t.json
  done
  for t in 99 95 90; do  # the same modules, thresholds certified for the deferred bridge (exact states)
    $LL calibrate -m smollm2-135m -o $ART/smol${t}d.safetensors --work-dir $ART/smol99.safetensors.work --resume \
        --bridge deferred --target-agreement 0.$t --delta 0.1 -t 2 --json > $OUT/calibrate_default_0${t}_deferred.json
  done
fi

CAL=(); for t in 99 95 90 80; do CAL+=(--config "adaptive:laser=$ART/smol$t.safetensors"); done
DEF=(); for t in 99 95 90; do DEF+=(--config "adaptive:laser=$ART/smol${t}d.safetensors"); done
STA=(); for k in 29 28 27 26; do STA+=(--config "static:layers=$k"); done
NAI=(); for c in 0.95 0.9 0.8; do NAI+=(--config "adaptive:policy=confidence,threshold=$c,patience=0,bridge=propagate"); done

EVAL=(eval -m smollm2-135m -t 2 --tasks wikitext,agreement,lambada,hellaswag,arc_easy,piqa --limit 100
      --ppl-windows 40 --no-progress)
if [[ $step == eval || $step == all ]]; then  # one file per family (full depth is in each)
  $LL "${EVAL[@]}" "${DEF[@]}" "${STA[@]}" --json $OUT/pareto_eval_deferred_static.json
  # (this first run was stopped during hellaswag in the 2026-11-30 session; its tables were parsed from stdout)
  # propagate configurations are decoded token by token (batched across sequences), so tasks run on a subset
  $LL eval -m smollm2-135m -t 1 --tasks wikitext,agreement --ppl-windows 40 --no-progress "${CAL[@]}" \
      --json $OUT/pareto_eval_propagate.json
  $LL eval -m smollm2-135m -t 1 --tasks arc_easy,piqa,hellaswag --limit 50 --no-progress \
      --config "adaptive:laser=$ART/smol99.safetensors" --config "adaptive:laser=$ART/smol95.safetensors" \
      --config "adaptive:laser=$ART/smol95d.safetensors" --config static:layers=28 --json $OUT/pareto_eval_tasks.json
  $LL eval -m smollm2-135m -t 1 --tasks wikitext,agreement --ppl-windows 40 --no-progress "${NAI[@]}" \
      --json $OUT/pareto_eval_naive.json
fi

if [[ $step == bench || $step == all ]]; then
  $LL bench -m smollm2-135m -t 2 "${CAL[@]}" "${DEF[@]}" --config static:layers=28 \
      --config "adaptive:policy=confidence,threshold=0.9,patience=0,bridge=propagate" \
      --tests tg,gen --reps 3 --no-hf --no-progress --json $OUT/calibration_pareto_bench.json
fi

if [[ $step == plot || $step == all ]]; then
  .venv/bin/python benchmarks/plot_pareto.py --eval $OUT/pareto_eval_*.json \
      --bench $OUT/calibration_pareto_bench.json --out benchmarks/out/calibration_pareto.png
fi
