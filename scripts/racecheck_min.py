"""Does compute-sanitizer's racecheck follow Gluon's warp-specialized mbarrier handoffs? Two minimal kernels.

    PYTHONPATH=src compute-sanitizer --tool racecheck python3 scripts/racecheck_min.py [--unguarded]

Both hand a shared-memory vector from a 4-warp producer partition to two 4-warp consumer partitions N times,
guarded by ready/free mbarriers as hopper.py guards its alpha and norm vectors (wait -> st.shared ->
partition bar.sync -> one thread's arrive; wait -> ld.shared -> bar.sync -> arrive):
  per_thread   a [128] vector, one value per thread;
  replicated   a [64] row vector sliced from a wgmma accumulator layout, so 4 lanes hold and store each value
               (hopper.py's case).
``--unguarded`` drops the producer's wait on the free barrier: a real race, which racecheck must report.
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


@gluon.jit
def _producer(buf, ready, free, rounds, N: gl.constexpr, LAYOUT: gl.constexpr, GUARD: gl.constexpr):
    for i in range(rounds):
        if GUARD:
            mbarrier.wait(free, (i & 1) ^ 1)
        buf.store(gl.arange(0, N, LAYOUT).to(gl.float32) + i)
        mbarrier.arrive(ready)


@gluon.jit
def _consumer(buf, ready, free, out_ptr, rounds, N: gl.constexpr, LAYOUT: gl.constexpr):
    acc = gl.zeros([N], gl.float32, LAYOUT)
    for i in range(rounds):
        mbarrier.wait(ready, i & 1)
        acc += buf.load(LAYOUT)
        mbarrier.arrive(free)
    gl.store(out_ptr + gl.arange(0, N, LAYOUT), acc)


@gluon.jit
def handoff_kernel(out_ptr, rounds, N: gl.constexpr, PRODUCER_LAYOUT: gl.constexpr, CONSUMER_LAYOUT: gl.constexpr,
                   GUARD: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [N], VEC)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=2)
    gl.warp_specialize([(_producer, (buf, ready, free, rounds, N, PRODUCER_LAYOUT, GUARD)),
                        (_consumer, (buf, ready, free, out_ptr, rounds, N, CONSUMER_LAYOUT)),
                        (_consumer, (buf, ready, free, out_ptr + N, rounds, N, CONSUMER_LAYOUT))], [4, 4], [168, 168])


def main():
    guard = "--unguarded" not in sys.argv
    for name, n, producer, consumer in [("per_thread", 128, FLAT, FLAT),
                                        ("replicated", 64, gl.SliceLayout(1, S_FP8), gl.SliceLayout(1, O_ACC))]:
        out = torch.zeros(2 * n, device="cuda")
        handoff_kernel[(1,)](out, ROUNDS, n, producer, consumer, guard, num_warps=4)
        want = torch.arange(n, device="cuda").float() * ROUNDS + ROUNDS * (ROUNDS - 1) / 2
        print(name, "ok" if torch.equal(out, torch.cat([want, want])) else f"WRONG {out[:4].tolist()}", flush=True)


if __name__ == "__main__":
    main()
