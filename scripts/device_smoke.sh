#!/usr/bin/env bash
# One device call: GPU facts, the Hopper kernel's GPU tests (a hang is cut by timeout), one bench config.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 300 python3 -m pytest -q -x -p no:warnings tests/kernels/test_hopper.py -k "matches" 2>&1 | tail -25
timeout 240 python3 -m fp8mla bench --peers .peers --no-fa3 --b 64 --out "$OUT/bench" 2>"$OUT/bench.log"
tail -3 "$OUT/bench.log"
