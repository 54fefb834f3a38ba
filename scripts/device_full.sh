#!/usr/bin/env bash
# One device call: every GPU test, the realistic DeepSeek-V3 layer, and the accuracy suite (logs under $OUT).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 420 python3 -m pytest -q -p no:warnings -k "not sass" tests/kernels/test_gpu_matrix.py tests/kernels/test_hopper.py \
  tests/test_cuda_graphs.py tests/test_no_host_sync.py tests/test_compat.py tests/test_deepseek_v3.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -12
timeout 150 python3 examples/deepseek_v3_decode.py --size realistic 2>&1 | tee "$OUT/deepseek.log" | tail -8
timeout 240 python3 -m fp8mla bench --peers .peers --no-fa3 --accuracy --out "$OUT/acc" 2>"$OUT/acc.log" | grep -E "^\|" | cut -c1-170
