#!/bin/bash
# RESULTS "The seeds' tables, side by side": one run, alone. out/smollm2-chat-t90.laser.safetensors is t90 of
# benchmarks/out/router/run.sh (the bundled chat recipe certified at 0.90, with its router).
laserlm report seeds -m smollm2-135m -t 1 --laser out/smollm2-chat-t90.laser.safetensors \
  --json benchmarks/out/seed_tables/seed_tables.json --md benchmarks/out/seed_tables/seed_tables.md --no-progress
