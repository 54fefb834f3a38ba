#!/usr/bin/env bash
# The GPU test suite in one device call (each file under its own timeout, logs under $OUT). The accuracy suite
# and the realistic DeepSeek-V3 layer need calls of their own:
#   PYTHONPATH=src python3 -m fp8mla bench --peers .peers --no-fa3 --accuracy --out "$OUT/acc"
#   PYTHONPATH=src python3 examples/deepseek_v3_decode.py --size realistic
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
for t in tests/kernels/test_hopper.py tests/kernels/test_gpu_matrix.py tests/test_cuda_graphs.py \
         "tests/test_no_host_sync.py tests/test_compat.py tests/test_deepseek_v3.py" tests/test_sanitizers.py; do
  echo "== $t"
  timeout 420 python3 -m pytest -q -x -p no:warnings -k "not sass" $t 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -4
done
