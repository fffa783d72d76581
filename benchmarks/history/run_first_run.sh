#!/bin/bash
# The first run of a new user (issue 12): `laserlm generate --mode adaptive` with no laser file on the bundled
# smollm2-135m, against full depth and the old untrained default (confidence 0.9, patience 3), in an empty cache
# for the calibrated defaults. Usage: LASERLM_CACHE=/tmp/somecache bash benchmarks/run_first_run.sh [THREADS]
# (symlink converted/, gguf/ and kernels/ of ~/.cache/laserlm into that cache to skip the GGUF conversion).
set -u
T=${1:-1}
PY=${PYTHON:-python}
P="The weather today is"
run() { echo "\$ laserlm $*"; /usr/bin/time -f "[wall %e s]" $PY -m laserlm.cli "$@"; echo; }
date -u; uptime; lscpu | grep "Model name"; echo "LASERLM_CACHE=${LASERLM_CACHE:-}"
run generate -t "$T" "$P"
run generate -t "$T" --mode "adaptive:policy=confidence,threshold=0.9" "$P"   # what bare adaptive built before
run generate -t "$T" --mode adaptive "$P"        # first run: builds the calibrated artifact once
run generate -t "$T" --mode adaptive "$P"        # second run: reuses it
run generate -t "$T" "$P"
run generate -t "$T" --mode speculative "$P"     # first run: tunes the draft settings once
run generate -t "$T" --mode speculative "$P"     # reuses them
run generate -t "$T" --mode "speculative:draft_layers=15,k=4,threshold=0" "$P"   # what bare speculative built before
uptime; date -u
