#!/usr/bin/env bash
# The GPU test suite in one device call, each file under its own timeout, logs under $OUT (default /tmp):
#   bash scripts/gpu_suite.sh                 # under the machine's Triton
#   bash scripts/gpu_suite.sh 3.9.0           # under a carried Triton bundle (scripts/triton_bundle_env.sh)
# The bench and the accuracy suite need calls of their own:
#   PYTHONPATH=src python3 -m fp8mla bench --peers .peers --no-fa3 [--accuracy] --out "$OUT/bench"
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1
[ $# -ge 1 ] && { source scripts/triton_bundle_env.sh "$1" || exit 1; }
python3 -c 'import torch, triton; print(f"== torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")'
fail=0
for t in tests/kernels/test_hopper.py tests/kernels/test_gpu_matrix.py tests/test_cuda_graphs.py tests/kernels/test_sparse.py \
         "tests/test_no_host_sync.py tests/test_compat.py tests/test_deepseek_v3.py tests/test_api.py" \
         "tests/test_safety.py tests/kernels/test_planner.py tests/kernels/test_combine.py" \
         tests/test_sanitizers.py; do
  echo "== $t"
  timeout 420 python3 -m pytest -q -x -p no:warnings -k "not sass" $t 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || fail=1
done
exit $fail
