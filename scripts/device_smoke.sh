#!/usr/bin/env bash
# One device call: GPU facts, the Hopper kernel's GPU tests (a hang is cut by timeout), the bench's key configs.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv,noheader
timeout 300 python3 -m pytest -q -x -p no:warnings tests/kernels/test_hopper.py -k "matches" 2>&1 | tail -15
for cfg in "--b 64" "--b 128 --s-q 1 --h-q 16"; do
  timeout 240 python3 -m fp8mla bench --peers .peers --no-fa3 $cfg --out "$OUT/bench" 2>>"$OUT/bench.log" \
    | grep -E "^\|" | cut -c1-150
done
timeout 240 python3 -m pytest -q -x -p no:warnings tests/test_cuda_graphs.py tests/test_no_host_sync.py 2>&1 | tail -6
