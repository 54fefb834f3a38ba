"""Combine step of split-KV decode: merges each request's partial results by their log-sum-exp.

Requests with one split were written directly by the decode kernel: one program each checks them; requests with no key
(seqlen 0) get out 0 and lse +inf here. Partial O comes in bf16 or fp32 (``partial_dtype``), merged in fp32.
A request's out and lse become NaN where a piece of it is NaN (the decode kernels mark bad pages and stale
schedules so), where its seqlen is one the kernels could not use (negative, beyond the block table), and where the
schedule does not give it its pages as the decode kernels walk them (``_schedule_fits``: a schedule planned for
other seqlens, or one get_mla_metadata did not write). Every program runs after the decode kernel, so this also
overwrites what the decode wrote for such a request.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import runtime
from ..schedule import combine_plan
from . import sparse_constexprs
from .constants import BEGIN_PAGE, BEGIN_REQ, BEGIN_SPLIT, D_LATENT, END_PAGE, END_REQ, METADATA_WIDTH, PAGE_SIZE
from .launcher import ASK, CachedLauncher

CHECK_STEP = tl.constexpr(256)   # parts (and requests) _schedule_fits reads at a time: the default parts in one


@triton.jit
def _schedule_at(meta_ptr, num_splits_ptr, i, parts):
    """What _schedule_fits reads at indices i (parts, and requests): parts i's and i - 1's (begin request, begin
    page, end request, end page, first piece), and num_splits[i], [i + 1] for i < b."""
    b = tl.num_programs(0)
    row = meta_ptr + i.to(tl.int64) * METADATA_WIDTH
    now = (tl.load(row + BEGIN_REQ, mask=i < parts, other=b), tl.load(row + BEGIN_PAGE, mask=i < parts, other=0),
           tl.load(row + END_REQ, mask=i < parts, other=-1), tl.load(row + END_PAGE, mask=i < parts, other=0),
           tl.load(row + BEGIN_SPLIT, mask=i < parts, other=0))
    row -= METADATA_WIDTH
    live = (i >= 1) & (i <= parts)
    before = (tl.load(row + BEGIN_REQ, mask=live, other=b), tl.load(row + BEGIN_PAGE, mask=live, other=0),
              tl.load(row + END_REQ, mask=live, other=-1), tl.load(row + END_PAGE, mask=live, other=0),
              tl.load(row + BEGIN_SPLIT, mask=live, other=0))
    splits = (tl.load(num_splits_ptr + i, mask=i < b, other=0), tl.load(num_splits_ptr + i + 1, mask=i < b, other=0))
    return now, before, splits


@triton.jit
def _claim(row, req, pages, max_pages):
    """(first page, end page, whether it has any, piece) of request req in parts of these ``row`` values, as the
    decode kernels take them (hopper/ring.py: indices clamped, a middle request whole); the piece is which of the
    request's split slots the part stores to."""
    b = tl.num_programs(0)
    begin_req, begin_page, end_req, end_page, begin_split = row
    begin_req = tl.maximum(begin_req, 0)
    end_req = tl.minimum(end_req, b - 1)
    lo = tl.where(req == begin_req, tl.maximum(begin_page, 0), 0)
    hi = tl.minimum(tl.where(req == end_req, end_page, pages), max_pages)
    piece = tl.where(req == begin_req, begin_split, 0)
    return lo, hi, (begin_req <= req) & (req <= end_req) & (lo < hi), piece


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _fits_step(read, req, pages, max_pages):
    """_schedule_fits's sums over one step of indices (read by _schedule_at): (pages covered, parts that have pages
    of req, of which start a run, parts or requests out of order)."""
    now, before, splits = read
    split, split_after = splits
    lo, hi, has, piece = _claim(now, req, pages, max_pages)
    _, hi_before, had, piece_before = _claim(before, req, pages, max_pages)
    wrong = tl.where(had, (lo != hi_before) | (piece != piece_before + 1), (lo != 0) | (piece != 0))
    return tl.reduce((tl.where(has, hi - lo, 0).to(tl.int64), has.to(tl.int32), (has & ~had).to(tl.int32),
                      ((has & wrong) | (split_after < split)).to(tl.int32)), 0, _add4)


@triton.jit
def _schedule_fits(req, seqlen, n_splits, first, meta_ptr, parts, num_splits_ptr, max_pages):
    """Whether the schedule gives request req (seqlen >= 0) exactly its pages, each once: the parts that have any
    of its pages are consecutive, the first starts at page 0 with piece 0 and each next one where the one before
    ended with the next piece, n_splits of them, covering the request's pages; and num_splits gives every request
    a range of split slots apart from the others' (it never decreases). The decode kernels store a partial result
    only into a slot of its own request's range, so a request that fits reads only its own parts' results. One pass
    over the parts, each against the part before it, CHECK_STEP at a time (``first``: the first step's reads,
    issued early); one reduction a step."""
    pages = (seqlen + PAGE_SIZE - 1) // PAGE_SIZE
    covered, count, starts, broken = _fits_step(first, req, pages, max_pages)
    for i0 in range(CHECK_STEP, tl.maximum(parts, tl.num_programs(0)), CHECK_STEP):
        step = _fits_step(_schedule_at(meta_ptr, num_splits_ptr, i0 + tl.arange(0, CHECK_STEP), parts), req, pages,
                          max_pages)
        covered, count, starts, broken = _add4(covered, count, starts, broken, *step)
    return (broken == 0) & (starts == (pages > 0)) & (count == n_splits) & (covered == pages)


@triton.jit
def lse_offsets(req, rows, H, S_Q, Q_GROUP):
    """Where request req's query rows (row = s * H + h) have their lse in lse [b, h_q, s_q]: a dense request is a
    batch entry (Q_GROUP 1); a sparse call's is one query token, Q_GROUP = s_q of them a batch entry (and S_Q 1)."""
    R = H * S_Q
    entry = req // Q_GROUP
    return entry.to(tl.int64) * (R * Q_GROUP) + (req - entry * Q_GROUP) + ((rows % H) * S_Q + rows // H) * Q_GROUP


@triton.jit
def sink_factor(lse, sink_ptr, h, row_ok):
    """out's factor exp(lse) / (exp(lse) + exp(sink[h])) for an attention sink; lse natural (+inf for a row that
    saw no key, whose out is 0 anyway)."""
    return 1.0 / (1.0 + tl.exp(tl.load(sink_ptr + h, mask=row_ok, other=0.0) - lse))


@triton.jit
def _mark_request(out_ptr, lse_ptr, req, R, Q_GROUP, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """All of request req's out and lse := NaN (its lse rows in any order: a sparse call's strided by Q_GROUP)."""
    entry = req // Q_GROUP
    lse_rows = lse_ptr + entry.to(tl.int64) * (R * Q_GROUP) + (req - entry * Q_GROUP)
    for r0 in range(0, R, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        for c0 in tl.static_range(0, D_LATENT, BLOCK_D):
            d = c0 + tl.arange(0, BLOCK_D)
            tl.store(out_ptr + (req.to(tl.int64) * R + rows[:, None]) * D_LATENT + d[None, :],
                     tl.full([BLOCK_ROWS, BLOCK_D], float("nan"), tl.float32).to(tl.bfloat16), mask=rows[:, None] < R)
        tl.store(lse_rows + rows * Q_GROUP, tl.full([BLOCK_ROWS], float("nan"), tl.float32), mask=rows < R)


@triton.jit
def mla_combine_kernel(out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, meta_ptr, parts, num_splits_ptr, seqlens_ptr,
                       max_pages, H, S_Q, Q_GROUP, sink_ptr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                       STEP_SPLITS: tl.constexpr, HAS_SINK: tl.constexpr):
    req = tl.program_id(0)
    R = H * S_Q
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < R
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    out_rows = out_ptr + (req.to(tl.int64) * R + rows) * D_LATENT
    lse_rows = lse_ptr + lse_offsets(req, rows, H, S_Q, Q_GROUP)
    split0 = tl.load(num_splits_ptr + req)
    split_end = tl.load(num_splits_ptr + req + 1)
    n_splits = split_end - split0
    seqlen = tl.load(seqlens_ptr + req)
    first = _schedule_at(meta_ptr, num_splits_ptr, tl.arange(0, CHECK_STEP), parts)   # in flight during the merge
    # (compared as loaded: the difference of two far-apart int32s wraps around)
    in_buffers = (0 <= split0) & (split0 <= split_end) & (split_end <= tl.num_programs(0) + parts)
    usable = in_buffers & (seqlen >= 0) & ((seqlen + PAGE_SIZE - 1) // PAGE_SIZE <= max_pages)
    # one pass over the pieces (none for a request the decode kernel wrote whole), STEP_SPLITS at a time, rescaling
    # the running sums when a step raises a row's max. The step's lse and O loads are unrolled and all issued before
    # any is used, so that they are in flight together (a loop over single pieces waits on each, as does loading O
    # after the max); the max is taken from each piece's lse in the rows' own layout, registers only (a [pieces,
    # rows] tile's max goes through shared memory and a barrier each step). docs/design.md has the numbers.
    lse_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_ROWS], tl.int1)   # a NaN piece (the max below would skip it)
    total = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    for j0 in range(0, tl.where(usable & (n_splits != 1), n_splits, 0), STEP_SPLITS):
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
    # the schedule checked after the merge (its loads in flight during it), in one place: by every program of a split
    # request, and by one program of a request the decode kernel wrote whole (which marks all of it, lse in any order)
    checker = (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    fits = True
    if (n_splits != 1) | checker:
        fits = usable & _schedule_fits(req, seqlen, n_splits, first, meta_ptr, parts, num_splits_ptr, max_pages)
    if n_splits == 1:
        if not fits:
            _mark_request(out_ptr, lse_ptr, req, R, Q_GROUP, BLOCK_ROWS, BLOCK_D)
    else:
        nan |= not fits
        seen = lse_max > float("-inf")
        o = acc * tl.where(nan, float("nan"), tl.where(seen, 1.0 / total, 0.0))[:, None]
        lse = tl.where(nan, float("nan"), tl.where(seen, lse_max + tl.log(total), float("inf")))
        if HAS_SINK:
            o = o * sink_factor(lse, sink_ptr, rows % H, row_ok)[:, None]
        tl.store(out_rows[:, None] + d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
        tl.store(lse_rows, lse, mask=row_ok & (tl.program_id(2) == 0))


_launch = CachedLauncher(mla_combine_kernel)


def plan_combine(b: int, s_q: int, h_q: int, parts: int, max_pages: int, device, gather=None):
    """``combine(out, lse, o_part, lse_part, meta, num_splits, cache_seqlens, sink=None, key=None, site=ASK)`` for b
    requests of s_q * h_q query rows after a schedule of ``parts`` parts (meta), block tables of ``max_pages``
    columns; o_part and lse_part have b + parts rows. ``gather``: a sparse call's (checks.Gather): b is then its
    query tokens, s_q 1, and its attention sink (``sink``, a [h_q] fp32 tensor) applies."""
    row_blocks, slices, consts = combine_plan(b, s_q * h_q, parts, runtime.sm_count(device))
    has_sink = sparse_constexprs(gather)["HAS_SINK"]
    variant = _launch.variant({**consts, "HAS_SINK": has_sink}, num_warps=4)
    grid = (b, row_blocks, slices)
    q_group = 1 if gather is None else gather.s_q

    def combine(out, lse, o_part, lse_part, meta, num_splits, cache_seqlens, sink=None, key=None, site=ASK):
        variant(grid, (out, lse, o_part, lse_part, meta, parts, num_splits, cache_seqlens, max_pages, h_q, s_q, q_group,
                       sink if has_sink else cache_seqlens), key, site)   # (never read without a sink)
    return combine
