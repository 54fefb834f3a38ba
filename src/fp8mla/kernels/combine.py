"""Combine step of split-KV decode: merges each request's partial results by their log-sum-exp.

Requests with one split were written directly by the decode kernel and are skipped; requests with no key
(seqlen 0) get out 0 and lse +inf here. Partial O comes in bf16 or fp32 (``partial_dtype``), merged in fp32.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from .. import scheduler
from .constants import D_LATENT
from .launcher import CachedLauncher

COMBINE_ROWS = 8        # query rows per program
SPREAD_SLICES = 4        # column slices when (request, row block) programs are few
MIN_COMBINE_DIMS = 64    # the narrowest slice of the 512 columns a program merges (when most SMs would idle still)
STEP_ELEMENTS = 16384    # at most this many partial-O elements a program loads per step (128 per thread)


@triton.jit
def mla_combine_kernel(out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, num_splits_ptr, H, S_Q,
                       BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, STEP_SPLITS: tl.constexpr):
    req = tl.program_id(0)
    R = H * S_Q
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    split0 = tl.load(num_splits_ptr + req)
    n_splits = tl.load(num_splits_ptr + req + 1) - split0
    if n_splits != 1:
        # one pass over the pieces, STEP_SPLITS at a time, rescaling the running sums when a step raises a row's
        # max. The step's lse and O loads are unrolled and all issued before any is used, so that they are in
        # flight together (a loop over single pieces waits on each: b=1 h_q=128 cut into 33 pieces took 11.6 µs
        # that way, 8.0 µs in steps; O loaded after the max: 5.9 µs vs 4.6 at b=1 s_q=2 h_q=64, bf16 partials);
        # the max is taken from each piece's lse in the rows' own layout, registers only (a [pieces, rows] tile's
        # max went through shared memory and a barrier each step: 10.3 µs vs 8.5 with 65 pieces)
        lse_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
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
        o = acc * tl.where(seen, 1.0 / total, 0.0)[:, None]
        lse = tl.where(seen, lse_max + tl.log(total), float("inf"))
        out_rows = out_ptr + (req.to(tl.int64) * R + rows) * D_LATENT
        tl.store(out_rows[:, None] + d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
        tl.store(lse_ptr + req.to(tl.int64) * R + (rows % H) * S_Q + rows // H, lse,
                 mask=row_ok & (tl.program_id(2) == 0))


_launch = CachedLauncher(mla_combine_kernel)


def tile(slices: int, pieces: int) -> dict:
    """The kernel's tile constants when the 512 columns are cut into ``slices`` and a split request has about
    ``pieces`` pieces: a step loads them all if it can (no second step's wait), but not many more (masked loads)."""
    width = D_LATENT.value // slices
    step = min(triton.next_power_of_2(pieces), STEP_ELEMENTS // (COMBINE_ROWS * width))
    return dict(BLOCK_ROWS=COMBINE_ROWS, BLOCK_D=width, STEP_SPLITS=max(step, 2))


@functools.lru_cache(maxsize=1024)   # once per batch shape: this is on every decode call's host path
def plan(b: int, rows: int, parts: int, sms: int) -> tuple[int, int, dict]:
    """(row blocks, slices of the 512 columns, tile constants) that merge the partial results of ``b`` requests of
    ``rows`` query rows after a schedule of ``parts`` parts on ``sms`` SMs. The constants are shared: not to be
    changed."""
    row_blocks = triton.cdiv(rows, COMBINE_ROWS)
    # few (request, row block) programs, e.g. one request cut into many pieces: the columns are split too (up to
    # 4 ways) so that the merge's reads come from enough SMs; 8 ways if that leaves most SMs idle still
    slices = 1
    while slices < SPREAD_SLICES and b * row_blocks * slices < 2 * sms:
        slices *= 2
    if 2 * b * row_blocks * slices <= sms:
        slices = D_LATENT.value // MIN_COMBINE_DIMS
    return row_blocks, slices, tile(slices, max(1, parts // b))   # about parts / b pieces a request


def step_splits(b: int, rows: int, parts: int, sms: int) -> int:
    """How many pieces of a request one step of the combine merges (the scheduler's cut fits whole steps)."""
    return plan(b, rows, parts, sms)[2]["STEP_SPLITS"]


def launch_combine(out, lse, o_part, lse_part, num_splits):
    b, s_q, h_q, _ = out.shape
    parts = o_part.shape[0] - b   # o_part has b + parts rows
    row_blocks, slices, consts = plan(b, s_q * h_q, parts, scheduler._sm_count(out.device))
    _launch((b, row_blocks, slices), (out, lse, o_part, lse_part, num_splits, h_q, s_q), consts, num_warps=4)
