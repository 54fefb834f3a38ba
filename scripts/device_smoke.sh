#!/usr/bin/env bash
# One device call (what produced the 2026-11-29 BENCHMARKS.md tables): the Hopper kernel against the reference,
# then the two key bench configs with the FlashMLA peers in the same process.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 90 python3 scripts/hopper_check.py --no-time 2>&1 | tail -3 || exit 1
for cfg in "--b 64" "--b 128 --s-q 1 --h-q 16"; do
  timeout 100 python3 -m fp8mla bench --peers .peers --no-fa3 --warmup 20 --rep 100 $cfg --out "$OUT/bench" \
    2>>"$OUT/bench.log" | grep -E "^\|"
done
