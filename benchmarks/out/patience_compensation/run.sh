#!/bin/bash
# The runs behind RESULTS "The patience rule and the Residual Bridge's compensation, certified" (OUT: a work folder).
# First (trains the modules; every run below resumes from them and re-certifies only the thresholds):
#   laserlm calibrate -m smollm2-135m --source chat --seq-len 128 --threads 1 -o OUT/p0.laser.safetensors --work-dir OUT/work
OUT=${OUT:-/tmp/patience_compensation}
common="-m smollm2-135m --source chat --seq-len 128 --threads 1 --work-dir $OUT/work --resume --json"
for cfg in "t95_p0:--target-agreement 0.95 --patience 0" "t95_p3:--target-agreement 0.95 --patience 3" \
           "t95_c2:--target-agreement 0.95 --compensation auto" "t90_p0:--target-agreement 0.90" \
           "t90_p3:--target-agreement 0.90 --patience 3" "t90_c:--target-agreement 0.90 --compensation auto"; do
  name=${cfg%%:*}; args=${cfg#*:}
  laserlm calibrate $common $args -o $OUT/$name.laser.safetensors > $OUT/$name.json 2> $OUT/$name.err
done
