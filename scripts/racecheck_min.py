"""Does compute-sanitizer's racecheck follow Gluon's warp-specialized mbarrier handoffs? Three minimal kernels.

    PYTHONPATH=src compute-sanitizer --tool racecheck python3 scripts/racecheck_min.py [--unguarded] [CASE]

Both hand a shared-memory vector from a 4-warp producer partition to two 4-warp consumer partitions N times,
guarded by ready/free mbarriers as hopper.py guards its alpha and norm vectors (wait -> st.shared ->
partition bar.sync -> one thread's arrive; wait -> ld.shared -> bar.sync -> arrive):
  per_thread   a [128] vector, one value per thread (Triton stores it with stmatrix, which racecheck does
               not track: its 0 hazards say nothing about the ordering);
  replicated   a [64] row vector sliced from a wgmma accumulator layout, so 4 lanes hold and store each value
               (hopper.py's case);
  one_writer   the same row vector broadcast to [64, 8] in the accumulator layout (each element held by one
               thread) and stored whole, dim 0 contiguous; the consumers read column 0.
``--unguarded`` drops the producer's wait on the free barrier: a real race, which racecheck must report.
Measured (BENCHMARKS.md, 2026-11-30 03:53-04:01): replicated and one_writer both report RAW hazards on every
producer thread's st.shared, the arriving thread 0's included, so racecheck does not see this handoff ordered
whoever stores; per_thread reports none.
Each kernel's sums are checked (a wrong sum prints WRONG).
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from fp8mla.kernels.hopper import O_ACC, S_FP8, VEC_SMEM as VEC  # the kernel's own layouts

FLAT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
ROUNDS = 16


COPIES = gl.constexpr(8)
COLUMNS = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1]))  # [N, COPIES]


@gluon.jit
def _producer(buf, ready, free, rounds, N: gl.constexpr, LAYOUT: gl.constexpr, GUARD: gl.constexpr,
              ONE_WRITER: gl.constexpr):
    for i in range(rounds):
        if GUARD:
            mbarrier.wait(free, (i & 1) ^ 1)
        v = gl.arange(0, N, LAYOUT).to(gl.float32) + i
        if ONE_WRITER:
            buf._reinterpret(gl.float32, [N, COPIES], COLUMNS).store(
                v[:, None] + gl.zeros([N, COPIES], gl.float32, S_FP8))   # LAYOUT is a row slice of S_FP8
        else:
            buf.index(0).store(v)
        mbarrier.arrive(ready)


@gluon.jit
def _consumer(buf, ready, free, out_ptr, rounds, N: gl.constexpr, LAYOUT: gl.constexpr):
    acc = gl.zeros([N], gl.float32, LAYOUT)
    for i in range(rounds):
        mbarrier.wait(ready, i & 1)
        acc += buf.index(0).load(LAYOUT)
        mbarrier.arrive(free)
    gl.store(out_ptr + gl.arange(0, N, LAYOUT), acc)


@gluon.jit
def handoff_kernel(out_ptr, rounds, N: gl.constexpr, PRODUCER_LAYOUT: gl.constexpr, CONSUMER_LAYOUT: gl.constexpr,
                   GUARD: gl.constexpr, ONE_WRITER: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [COPIES, N], VEC)   # copy 0 is what the consumers read
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=2)
    gl.warp_specialize([(_producer, (buf, ready, free, rounds, N, PRODUCER_LAYOUT, GUARD, ONE_WRITER)),
                        (_consumer, (buf, ready, free, out_ptr, rounds, N, CONSUMER_LAYOUT)),
                        (_consumer, (buf, ready, free, out_ptr + N, rounds, N, CONSUMER_LAYOUT))], [4, 4], [168, 168])


def main():
    guard = "--unguarded" not in sys.argv
    row = gl.SliceLayout(1, S_FP8), gl.SliceLayout(1, O_ACC)
    for name, n, (producer, consumer), one_writer in [("per_thread", 128, (FLAT, FLAT), False),
                                                      ("replicated", 64, row, False), ("one_writer", 64, row, True)]:
        if len(sys.argv) > 1 and sys.argv[-1] in ("per_thread", "replicated", "one_writer") and sys.argv[-1] != name:
            continue
        out = torch.zeros(2 * n, device="cuda")
        handoff_kernel[(1,)](out, ROUNDS, n, producer, consumer, guard, one_writer, num_warps=4)
        want = torch.arange(n, device="cuda").float() * ROUNDS + ROUNDS * (ROUNDS - 1) / 2
        print(name, "ok" if torch.equal(out, torch.cat([want, want])) else f"WRONG {out[:4].tolist()}", flush=True)


if __name__ == "__main__":
    main()
