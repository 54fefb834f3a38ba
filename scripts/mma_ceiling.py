"""The tensor-core ceiling of the 64-row FP8 kernel's design: its three warpgroups issue only their wgmmas, on
operands that stay in shared memory (no TMA, no softmax, no transposes, no handshakes), one CTA per SM.

The softmax warpgroup runs each page's Q.K^T (q's latent part from registers, 64 x 64 x 576 e4m3) and waits for
it, as hopper.py's does; each PV warpgroup runs each page's P.V^T into its 64 x 256 fp32 O (64 x 256 x 64) and
waits for the one before, as hopper.py's do. Same registers per warpgroup, same shared-memory layouts. What the
real kernel adds to this (loads, softmax, V transposes, the P handoff) can only make it slower, so this bounds
what any kernel of this design reaches:

    PYTHONPATH=src python3 scripts/mma_ceiling.py [--pages 1024]

prints the TFLOPS of the products issued, for both sides together (FlashMLA's formula: 2 * 64 * 64 * (576 + 512)
a page a CTA) and for each alone. The operands are random e4m3 values written once: on zeros the tensor cores draw
less power, the clock stays higher and the same loop ran ~10% faster. ``--sass`` (no GPU needed) compiles the three
for sm_90a and prints their SASS summaries instead.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from fp8mla.kernels.constants import D_LATENT, D_ROPE, PAGE_SIZE
from fp8mla.kernels.hopper import (LAT_SMEM, O_ACC, P_SMEM, Q_REGS, ROPE_FP8_SMEM, S_FP8, STAGES, VT_SMEM)
from fp8mla.kernels.hopper_common import BLOCK_M, HALF, LEFT, PV_REGS, RIGHT

sys.path.insert(0, str(Path(__file__).parent))
from hopper_check import alternating_medians  # noqa: E402

SIDES = {"both": (True, True), "Q.K^T only": (True, False), "P.V only": (False, True)}
QK_FLOPS = 2 * BLOCK_M.value * PAGE_SIZE.value * (D_LATENT.value + D_ROPE.value)   # a page's products for one CTA
PV_FLOPS = 2 * BLOCK_M.value * PAGE_SIZE.value * D_LATENT.value


@gluon.jit
def _qk_side(q_lat, q_rope, k_lat, k_rope, sink_ptr, pages, ON: gl.constexpr):
    if ON:
        q_a = q_lat.load(Q_REGS)
        total = gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8)
        for i in range(pages):
            s = i % STAGES
            acc = warpgroup_mma(q_a, k_lat.index(s).permute((1, 0)), gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8),
                                use_acc=False, is_async=True)
            acc = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc, q_rope, k_lat.index(s), k_rope.index(s)])[0]
            total += acc   # keeps every product live
        gl.store(sink_ptr + gl.program_id(0) * 3, gl.sum(gl.sum(total, axis=1), axis=0))


@gluon.jit
def _pv_side(p_smem, vt, sink_ptr, pages, ON: gl.constexpr, WG: gl.constexpr):
    if ON:
        o = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, O_ACC))
        for i in range(pages):
            o = warpgroup_mma_wait(0, deps=[o])
            o = warpgroup_mma(p_smem.index(i % 2), vt.index(2 * WG + i % 2).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=[o])
        gl.store(sink_ptr + gl.program_id(0) * 3 + 1 + WG, gl.sum(gl.sum(o, axis=1), axis=0))


@gluon.jit
def _fill(data_ptr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """A [ROWS, COLS] tile of the random e4m3 values at data_ptr (ROWS * COLS of them, row-major)."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
    r = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    c = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    return gl.load(data_ptr + r[:, None] * COLS + c[None, :])


@gluon.jit
def mma_ceiling_kernel(data_ptr, sink_ptr, pages, QK: gl.constexpr, PV: gl.constexpr):
    # random operands, not zeros: the tensor cores draw more power on random values, and the clock follows
    q_lat = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, D_LATENT], LAT_SMEM, _fill(data_ptr, BLOCK_M, D_LATENT))
    q_rope = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, D_ROPE], ROPE_FP8_SMEM,
                                       _fill(data_ptr, BLOCK_M, D_ROPE))
    k_lat = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE_SIZE, D_LATENT], LAT_SMEM)
    k_rope = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE_SIZE, D_ROPE], ROPE_FP8_SMEM)
    vt = gl.allocate_shared_memory(gl.float8e4nv, [4, HALF, PAGE_SIZE], VT_SMEM)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, PAGE_SIZE], P_SMEM)
    for i in gl.static_range(2):   # the ring's pages (STAGES) and P's
        k_lat.index(i).store(_fill(data_ptr, PAGE_SIZE, D_LATENT))
        k_rope.index(i).store(_fill(data_ptr, PAGE_SIZE, D_ROPE))
        p_smem.index(i).store(_fill(data_ptr, BLOCK_M, PAGE_SIZE))
    for i in gl.static_range(4):   # V^T: two pages of each PV warpgroup's half
        vt.index(i).store(_fill(data_ptr, HALF, PAGE_SIZE))
    fence_async_shared()
    gl.warp_specialize([
        (_qk_side, (q_lat, q_rope, k_lat, k_rope, sink_ptr, pages, QK)),
        (_pv_side, (p_smem, vt, sink_ptr, pages, PV, LEFT)),
        (_pv_side, (p_smem, vt, sink_ptr, pages, PV, RIGHT)),
    ], [4, 4], [PV_REGS] * 2)


def sass_summaries() -> dict:
    from fp8mla.kernels.sass import compile_sm90, sass_report

    signature = {"data_ptr": "*fp8e4nv", "sink_ptr": "*fp32", "pages": "i32", "QK": "constexpr", "PV": "constexpr"}
    return {name: sass_report(compile_sm90(mma_ceiling_kernel, signature, dict(QK=qk, PV=pv), gluon=True,
                                           num_warps=4), name).summary()
            for name, (qk, pv) in SIDES.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1024, help="pages per CTA")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sass", action="store_true", help="only compile for sm_90a and print SASS summaries")
    args = parser.parse_args()
    if args.sass:
        print(json.dumps(sass_summaries()))
        return
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(ctas * 3, device="cuda")
    data = torch.randn(BLOCK_M.value * D_LATENT.value, device="cuda").to(torch.float8_e4m3fn)   # covers every tile
    calls = {name: (lambda qk=qk, pv=pv: mma_ceiling_kernel[(ctas,)](data, sink, args.pages, QK=qk, PV=pv,
                                                                      num_warps=4))
             for name, (qk, pv) in SIDES.items()}
    _, medians = alternating_medians(calls, args.rounds)
    print(f"{ctas} CTAs x {args.pages} pages, {args.rounds} rounds\n\n| wgmmas issued | µs | TFLOPS |\n|---|---|---|")
    for name, us in medians.items():
        qk, pv = SIDES[name]
        flops = ctas * args.pages * (qk * QK_FLOPS + pv * PV_FLOPS)
        print(f"| {name} | {us:.1f} | {flops / us / 1e6:.0f} |")


if __name__ == "__main__":
    main()
