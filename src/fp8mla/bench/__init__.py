"""The bench (``python -m fp8mla bench``): fp8mla's formats and backends against the peer kernels (FlashMLA BF16,
FlashMLA dense FP8, FA3-MLA), on the same inputs in one process; speed, host cost and accuracy.

  run.py       the configs, the timers and the suites         peers.py    the peers, loaded from their binaries
  metrics.py   FLOPs, bytes and errors (FlashMLA's formulas)   report.py   markdown, JSON and the plots
  fetch.py     the peer binaries, fetched from the vllm wheel (``python -m fp8mla fetch-peers``)
"""
from .run import add_arguments, run_bench

__all__ = ["add_arguments", "run_bench"]
