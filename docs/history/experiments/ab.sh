#!/usr/bin/env bash
# A/B of experiment trees (.exp/NAME, made by materialize.sh) against the working tree in one process, on the GPU
# machine from the repository's root; logs under $OUT:
#   TREES=".exp/ipv" bash docs/history/experiments/ab.sh [TRITON_VERSION] [STEPS...]   # steps: dense sparse tests
# TREES defaults to every .exp/*/src; DENSE_TREES (the dense A/B's) to TREES; DENSE_ARGS (e.g. "--timed 64,2,64
# --paths fp8_rope_bf16 fp8q", and "--check-timed-paths" to check only those paths) narrows the dense A/B. A version
# other than 3.6.0 needs .triton carried (scripts/triton_bundle_env.sh).
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1
ver=${1:-3.6.0}
shift || true
steps=${*:-dense sparse tests}
tag=${ver//./}
[ "$ver" != 3.6.0 ] && { source scripts/triton_bundle_env.sh "$ver" || exit 1; }
trees=${TREES:-$(for d in .exp/*/src; do [ -d "$d" ] && printf '%s ' "${d%/src}"; done)}
dense_trees=${DENSE_TREES:-$trees}
quiet() { grep -v "leaked\|nanobind\|^ - \|^See https"; }
check() {   # check LOG ARGS...: hopper_check.py's checks and A/B timing, the passed checks left out of the output
  local log=$1; shift
  timeout 260 python3 scripts/hopper_check.py "$@" --rounds 3 2>&1 | quiet | tee "$OUT/$log$tag.log" | grep -v " ok$"
}
echo "== $(date -u +%H:%M:%S) triton $ver trees: $trees steps: $steps"
for s in $steps; do
  case $s in
  dense) check dense --trees $dense_trees --seqlens 1000 70 ${DENSE_ARGS:-} ;;
  sparse) check sparse --sparse --trees $trees ;;
  tests) for t in $trees; do   # each tree's own GPU tests of the Hopper kernels
      (cd $t && timeout 200 python3 -m pytest -q -x -p no:warnings tests/kernels/test_hopper.py tests/kernels/test_sparse.py -k "not sass" 2>&1 | quiet | tee $OUT/tests_$(basename $t)$tag.log | tail -3)
    done ;;
  esac
  echo "== $(date -u +%H:%M:%S) $s done"
done
