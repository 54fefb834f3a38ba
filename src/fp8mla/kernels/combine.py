"""Combine step of split-KV decode: merges each request's partial results by their log-sum-exp.

Requests with one split were written directly by the decode kernel and are skipped; requests with no key
(seqlen 0) get out 0 and lse +inf here. Partial O comes in bf16 or fp32 (``partial_dtype``), merged in fp32.
A request's out and lse become NaN where a piece of it is NaN (the decode kernels mark bad pages and stale
schedules so), and where its seqlen is one the kernels could not use: negative, beyond the block table, or not what
the schedule was planned for (pieces for a request of no keys, or none for one with keys). Every program runs
after the decode kernel, so this also overwrites what the decode wrote for such a request.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import runtime
from ..schedule import combine_plan
from .constants import D_LATENT, PAGE_SIZE
from .launcher import ASK, CachedLauncher


@triton.jit
def mla_combine_kernel(out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, num_splits_ptr, seqlens_ptr, max_pages, H, S_Q,
                       BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, STEP_SPLITS: tl.constexpr):
    req = tl.program_id(0)
    R = H * S_Q
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    out_rows = out_ptr + (req.to(tl.int64) * R + rows) * D_LATENT
    lse_rows = lse_ptr + req.to(tl.int64) * R + (rows % H) * S_Q + rows // H
    split0 = tl.load(num_splits_ptr + req)
    n_splits = tl.load(num_splits_ptr + req + 1) - split0
    seqlen = tl.load(seqlens_ptr + req)
    unusable = (seqlen < 0) | ((seqlen + PAGE_SIZE - 1) // PAGE_SIZE > max_pages) | ((seqlen == 0) != (n_splits == 0))
    if unusable:
        tl.store(out_rows[:, None] + d[None, :], tl.full([BLOCK_ROWS, BLOCK_D], float("nan"), tl.float32).to(tl.bfloat16),
                 mask=row_ok[:, None])
        tl.store(lse_rows, tl.full([BLOCK_ROWS], float("nan"), tl.float32), mask=row_ok & (tl.program_id(2) == 0))
    elif n_splits != 1:
        # one pass over the pieces, STEP_SPLITS at a time, rescaling the running sums when a step raises a row's
        # max. The step's lse and O loads are unrolled and all issued before any is used, so that they are in
        # flight together (a loop over single pieces waits on each: b=1 h_q=128 cut into 33 pieces took 11.6 µs
        # that way, 8.0 µs in steps; O loaded after the max: 5.9 µs vs 4.6 at b=1 s_q=2 h_q=64, bf16 partials);
        # the max is taken from each piece's lse in the rows' own layout, registers only (a [pieces, rows] tile's
        # max went through shared memory and a barrier each step: 10.3 µs vs 8.5 with 65 pieces)
        lse_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK_ROWS], tl.int1)   # a NaN piece (the max below would skip it)
        total = tl.zeros([BLOCK_ROWS], tl.float32)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
        for j0 in range(0, n_splits, STEP_SPLITS):
            lses = ()
            parts_o = ()
            new_max = lse_max
            for k in tl.static_range(STEP_SPLITS):
                part_rows = (split0 + j0 + k).to(tl.int64) * R + rows
                ok_k = row_ok & (j0 + k < n_splits)
                lse_k = tl.load(lse_part_ptr + part_rows, mask=ok_k, other=float("-inf"))
                o_k = tl.load(o_part_ptr + part_rows[:, None] * D_LATENT + d[None, :], mask=ok_k[:, None], other=0.0)
                lses = lses + (lse_k,)
                parts_o = parts_o + (o_k,)
                new_max = tl.maximum(new_max, lse_k)
                nan |= lse_k != lse_k
            base = tl.where(new_max > float("-inf"), new_max, 0.0)   # a row with no key so far: weights 0
            alpha = tl.exp(lse_max - base)
            total = total * alpha
            acc = acc * alpha[:, None]
            for k in tl.static_range(STEP_SPLITS):
                w = tl.exp(lses[k] - base)
                total += w
                acc += w[:, None] * parts_o[k].to(tl.float32)
            lse_max = new_max
        seen = lse_max > float("-inf")
        o = acc * tl.where(nan, float("nan"), tl.where(seen, 1.0 / total, 0.0))[:, None]
        lse = tl.where(nan, float("nan"), tl.where(seen, lse_max + tl.log(total), float("inf")))
        tl.store(out_rows[:, None] + d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
        tl.store(lse_rows, lse, mask=row_ok & (tl.program_id(2) == 0))


_launch = CachedLauncher(mla_combine_kernel)


def plan_combine(b: int, s_q: int, h_q: int, parts: int, max_pages: int, device):
    """``combine(out, lse, o_part, lse_part, num_splits, cache_seqlens, key=None, site=ASK)`` for b requests of s_q
    * h_q query rows after a schedule of ``parts`` parts, block tables of ``max_pages`` columns."""
    row_blocks, slices, consts = combine_plan(b, s_q * h_q, parts, runtime.sm_count(device))
    variant = _launch.variant(consts, num_warps=4)
    grid = (b, row_blocks, slices)

    def combine(out, lse, o_part, lse_part, num_splits, cache_seqlens, key=None, site=ASK):
        variant(grid, (out, lse, o_part, lse_part, num_splits, cache_seqlens, max_pages, h_q, s_q), key, site)
    return combine


def launch_combine(out, lse, o_part, lse_part, num_splits, cache_seqlens, max_pages, key=None, site=ASK):
    b, s_q, h_q, _ = out.shape
    parts = o_part.shape[0] - b   # o_part has b + parts rows
    plan_combine(b, s_q, h_q, parts, max_pages, out.device)(out, lse, o_part, lse_part, num_splits, cache_seqlens,
                                                           key, site)
