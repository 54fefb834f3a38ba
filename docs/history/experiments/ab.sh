#!/usr/bin/env bash
# A/B of the rebuilt branches against main in one process; logs under $OUT.
#   bash .exp/scripts/ab.sh [TRITON_VERSION] [STEPS...]   steps: launch dense sparse tests
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1
ver=${1:-}
shift || true
steps=${*:-launch dense sparse tests}
tag=36
if [ -n "$ver" ] && [ "$ver" != 3.6.0 ]; then source scripts/triton_bundle_env.sh "$ver" || exit 1; tag=39; fi
trees=""
for t in ipv bf16s; do [ -d .exp/$t/src ] && trees="$trees .exp/$t"; done
dense_trees=""; [ -d .exp/ipv/src ] && dense_trees=".exp/ipv"
echo "== $(date -u +%H:%M:%S) triton $tag trees:$trees steps: $steps"
for s in $steps; do
  case $s in
  launch) timeout 150 python3 -m pytest -q -x -p no:warnings tests/kernels/test_hopper_launch.py 2>&1 | tee $OUT/launch$tag.log | tail -3 ;;
  dense) [ -n "$dense_trees" ] && timeout 230 python3 scripts/hopper_check.py --trees $dense_trees --seqlens 1000 70 --rounds 3 2>&1 | tee $OUT/dense$tag.log | grep -v "^check.* ok$" | tail -40 ;;
  sparse) [ -n "$trees" ] && timeout 230 python3 scripts/hopper_check.py --sparse --trees $trees --rounds 3 2>&1 | tee $OUT/sparse$tag.log | grep -v "^check.* ok$" | tail -40 ;;
  tests)
    if [ -d .exp/bf16s/src ]; then (cd .exp/bf16s && timeout 100 python3 -m pytest -q -x -p no:warnings tests/kernels/test_sparse.py -k "dequantizing" 2>&1 | tee $OUT/t_bf16s$tag.log | tail -3); fi
    if [ -d .exp/ipv/src ]; then (cd .exp/ipv && timeout 200 python3 -m pytest -q -x -p no:warnings tests/kernels/test_hopper.py tests/kernels/test_sparse.py -k "not sass" 2>&1 | tee $OUT/t_ipv$tag.log | tail -3); fi ;;
  esac
  echo "== $(date -u +%H:%M:%S) $s done"
done
