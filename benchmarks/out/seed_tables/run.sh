#!/bin/bash
# RESULTS "The seeds' tables, side by side": one run, alone. The laser file is t90 of
# benchmarks/out/compensation_decay/run.sh (the bundled chat recipe certified at 0.90 agreement, with its router).
W=${W:-/tmp/compensation_decay}
laserlm report seeds -m smollm2-135m -t 1 --laser $W/t90.laser.safetensors \
  --json benchmarks/out/seed_tables/seed_tables.json --md benchmarks/out/seed_tables/seed_tables.md --no-progress
