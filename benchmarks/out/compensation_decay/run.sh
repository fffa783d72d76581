#!/bin/bash
# RESULTS "Long-text decay with the Residual Bridge's compensation": the bundled chat recipe certified at 0.90 with
# and without the compensation veto (W: a calibration work folder), then the long novel scored with each file.
set -euo pipefail
W=${W:-/tmp/compensation_decay}
OUT=benchmarks/out/compensation_decay
mkdir -p "$W"
common="-m smollm2-135m --source chat --seq-len 128 --threads 1 --work-dir $W/work --json"
laserlm calibrate $common --target-agreement 0.90 -o $W/t90.laser.safetensors > $OUT/t90.json 2> $W/t90.err
laserlm calibrate $common --resume --target-agreement 0.90 --compensation auto -o $W/t90_c.laser.safetensors \
  > $OUT/t90_c.json 2> $W/t90_c.err
laserlm eval -t 1 --tasks longtext --long-tokens 4096 --config "adaptive:laser=$W/t90.laser.safetensors" \
  --config "adaptive:laser=$W/t90_c.laser.safetensors" --json $OUT/longtext.json --no-progress > $W/longtext.log 2>&1
# a tighter veto than auto's choice (C = 2.04 never fired on the novel): C = 0.8, re-certified, then the novel
laserlm calibrate $common --resume --target-agreement 0.90 --compensation 0.8 -o $W/t90_c08.laser.safetensors \
  > $OUT/t90_c08.json 2> $W/t90_c08.err
laserlm eval -t 1 --tasks longtext --long-tokens 4096 --config "adaptive:laser=$W/t90_c08.laser.safetensors" \
  --json $OUT/longtext_c08.json --no-progress > $W/longtext_c08.log 2>&1
