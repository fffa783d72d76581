#!/bin/bash
# The runs behind RESULTS "The router as the seed describes it" (W: a calibration work folder).
# First (trains the heads and gates of the bundled chat recipe; the runs below resume from them):
#   laserlm calibrate -m smollm2-135m --source chat --seq-len 128 --threads 1 -o W/p0.laser.safetensors --work-dir W/work
W=${W:-/tmp/router}
common="-m smollm2-135m --source chat --seq-len 128 --threads 1 --work-dir $W/work --resume --json"
laserlm calibrate $common --target-agreement 0.90 -o $W/t90.laser.safetensors > $W/t90.json
laserlm calibrate $common --target-agreement 0.95 -o $W/t95.laser.safetensors > $W/t95.json
# low targets without the predictor (its propagate certification at a low target is slow; the router does not use it)
laserlm calibrate $common --no-predictor --target-agreement 0.70 -o $W/t70.laser.safetensors > $W/t70.json
laserlm calibrate $common --no-predictor --target-agreement 0.60 -o $W/t60.laser.safetensors > $W/t60.json
# every route's decode speed (alone), and the certified mix at 0.70
PYTHONPATH=. python benchmarks/bench_router.py --laser $W/t70.laser.safetensors \
  --out benchmarks/out/router/speed_t70.json
# the same with the mean of the prompt's layer-1 states as the feature (mean_t*.json): add --router-position mean
# the certified mixes' decode speed (certified_mix.json): the held-out route distribution of each t*.json weighted by
# the forced-route speeds of speed_t70.json (harmonic mean)
