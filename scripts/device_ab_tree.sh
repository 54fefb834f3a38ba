#!/usr/bin/env bash
# One device call: the bench (Hopper rows and FlashMLA) on this tree, then on each other source tree in turn,
# copied over it (e.g. branches, materialized here first since the device gets no git history:
#     rm -rf ab/next && mkdir -p ab/next && git archive next src scripts | tar -x -C ab/next
# and passed with carry [".peers", "ab"]), with each other tree's correctness check before its bench:
#     bash scripts/device_ab_tree.sh ab/next [ab/other ...]
# Each bench measures the FlashMLA peers in its own process: compare our rows' ratios to them, run against run.
# The trees should hold the same files (a file one tree adds stays for the next).
set -u
{  # parsed whole before it runs: the copies below may replace this very file
[ $# -ge 1 ] || { echo "usage: scripts/device_ab_tree.sh DIR [DIR ...] (trees with src/fp8mla)"; exit 2; }
export PYTHONPATH=src PYTHONUNBUFFERED=1
# bench configs: $CONFIGS (';'-separated) or these three
IFS=';' read -ra CONFIGS <<< "${CONFIGS:---b 64;--b 128 --s-q 1 --h-q 16;--b 8}"
bench() {
  for cfg in "${CONFIGS[@]}"; do
    timeout 150 python3 -m fp8mla bench --peers .peers --no-fa3 --backend hopper $cfg 2>>"$OUT/bench.log" | grep -E "^\|"
  done
}
echo "== this tree"; bench | tee "$OUT/this.md"
for tree in "$@"; do
  name=$(basename "$tree")
  cp -r "$tree/src/fp8mla/." src/fp8mla/
  [ -d "$tree/scripts" ] && cp -r "$tree/scripts/." scripts/
  echo "== $tree"
  if [ "${CHECK:-1}" != 0 ]; then   # CHECK=0: the trees are ones already checked (e.g. the commit before)
    timeout 200 python3 scripts/hopper_check.py --no-time 2>&1 | tee "$OUT/check-$name.log" | tail -3
    grep -q "ALL OK" "$OUT/check-$name.log" || { echo "$tree: check failed, not benched"; continue; }
  fi
  bench | tee "$OUT/$name.md"
done
exit
}
