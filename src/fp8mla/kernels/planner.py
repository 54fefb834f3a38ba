"""The split-KV schedule (schedule.py) computed on the GPU in one launch: one program walks the batch's requests in
blocks, a few times over (the timeline's length; the pieces fitted to the combine's steps; where each part begins
and ends and which parts touch each request), with every part's numbers as a vector. It writes exactly what
schedule.plan computes with torch ops (the tests compare them), without a host synchronisation, so the step's
schedule can be built eagerly for a few microseconds of host time or captured in a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..schedule import cut
from .constants import (BEGIN_PAGE, BEGIN_REQ, BEGIN_REQ_PAGES, BEGIN_SPLIT, COMBINE_STEP_PAGES, END_PAGE, END_REQ,
                        END_REQ_PAGES, FIXED_COST, METADATA_WIDTH, PAGE_SIZE, PLANNED_ROWS)
from .launcher import ASK, CachedLauncher, planned

BLOCK_B = tl.constexpr(32)   # requests per block of a walk


@triton.jit
def _pages(seqlens_ptr, i, ok):
    """(pages, timeline cost) of requests i: a negative seqlen counts as no pages."""
    n = tl.load(seqlens_ptr + i, mask=ok, other=0)
    pages = tl.where(n > 0, (n + PAGE_SIZE - 1) // PAGE_SIZE, 0)
    return pages, pages + FIXED_COST * (pages > 0)


@triton.jit
def _best(t, n, valid):
    """The candidate n of the smallest t among the valid ones; ties go to the larger n (more pieces)."""
    t = tl.where(valid, t, 1 << 62)
    return tl.max(tl.where(t == tl.min(t, axis=0), n, 0), axis=0)


@triton.jit
def _bound(k, total, pieces):
    """Where piece k of the timeline begins: k * total // pieces (one page a piece if there are fewer pages than
    pieces), at most total."""
    return tl.minimum(tl.where(total >= pieces, k.to(tl.int64) * total // pieces, k), total).to(tl.int32)


@triton.jit
def _parts_ending_by(pos, total, pieces, parts):
    """How many parts end (their bound _bound(q + 1)) at or before timeline position pos."""
    if_more = tl.where(total >= pieces, ((pos + 1).to(tl.int64) * pieces - 1) // tl.maximum(total, 1), pos)
    return tl.where(pos >= total, parts, tl.minimum(tl.maximum(if_more, 0), parts)).to(tl.int32)


@triton.jit
def _parts_starting_before(pos, total, pieces, parts):
    """How many parts begin (_bound(q)) before timeline position pos."""
    if_more = tl.where(pos >= 1, (pos.to(tl.int64) * pieces - 1) // tl.maximum(total, 1) + 1, 0)
    count = tl.where(total >= pieces, if_more, tl.maximum(pos, 0))
    return tl.where(pos > total, parts, tl.minimum(count, parts)).to(tl.int32)


@triton.jit
def _pieces_for_steps(seqlens_ptr, b, parts, total, step, BLOCK_P: tl.constexpr):
    """schedule._pieces_for_steps: for each candidate n of equal pieces, the most pieces a request is cut into."""
    n = tl.arange(0, BLOCK_P).to(tl.int64) + 1          # the candidates
    total = tl.maximum(total, 1).to(tl.int64)
    most_splits = tl.zeros([BLOCK_P], tl.int64)
    start = tl.zeros([], tl.int32)
    for i0 in range(0, b, BLOCK_B):
        i = i0 + tl.arange(0, BLOCK_B)
        pages, cost = _pages(seqlens_ptr, i, i < b)
        first = (start + tl.cumsum(cost, 0) - cost).to(tl.int64)
        start += tl.sum(cost, 0)
        # the piece of n equal ones (boundaries k * total // n) that holds timeline position pos
        lo = ((first + 1)[None, :] * n[:, None] + total - 1) // total
        hi = ((first + pages)[None, :] * n[:, None] + total - 1) // total
        splits = tl.where((pages > 0)[None, :], hi - lo + 1, 0)
        most_splits = tl.maximum(most_splits, tl.max(splits, axis=1))
    steps = tl.where(most_splits > 1, (most_splits + step - 1) // step, 0)
    t = (total + n - 1) // n + COMBINE_STEP_PAGES * steps
    return _best(t, n, (n <= total) & (n <= parts)).to(tl.int32)


@triton.jit
def _pieces_per_request(pages, most, step, BLOCK_P: tl.constexpr):
    """schedule._pieces_per_request: equal requests of ``pages`` pages, each in n of at most ``most`` pieces."""
    n = tl.arange(0, BLOCK_P).to(tl.int64) + 1
    cost = pages.to(tl.int64) + FIXED_COST
    splits = (n * pages + cost - 1) // cost
    t = (cost + n - 1) // n + COMBINE_STEP_PAGES * ((splits + step - 1) // step)
    return _best(t, n, (n <= cost) & (n <= most)).to(tl.int32)


@triton.jit
def plan_kernel(seqlens_ptr, meta_ptr, num_splits_ptr, b, parts, most, step, combine, rows,
                STEPS: tl.constexpr, ALIGN: tl.constexpr, BLOCK_P: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    p_ok = p < parts
    # ---- the timeline: its length, and whether every request has the same number of pages ----
    total = tl.zeros([], tl.int32)
    max_cost = tl.zeros([], tl.int32)
    fewest = tl.full([], 1 << 30, tl.int32)
    most_pages = tl.zeros([], tl.int32)
    for i0 in range(0, b, BLOCK_B):
        i = i0 + tl.arange(0, BLOCK_B)
        ok = i < b
        pages, cost = _pages(seqlens_ptr, i, ok)
        total += tl.sum(cost, 0)
        max_cost = tl.maximum(max_cost, tl.max(cost, 0))
        fewest = tl.minimum(fewest, tl.min(tl.where(ok, pages, 1 << 30), 0))
        most_pages = tl.maximum(most_pages, tl.max(tl.where(ok, pages, -1), 0))

    # ---- how many equal pieces the timeline is cut into (the other parts stay empty) ----
    pieces = parts
    if STEPS:
        pieces = _pieces_for_steps(seqlens_ptr, b, parts, total, step, BLOCK_P)
    if ALIGN:
        if fewest == most_pages:
            pieces = b * _pieces_per_request(fewest, most, step, BLOCK_P)
    lo = _bound(p, total, pieces)
    hi = _bound(p + 1, total, pieces)
    last_pos = tl.maximum(hi - 1, 0)

    # ---- one walk: the requests (and their cost) that end by each part's first and last position; the parts
    # touching each request, first_part .. last_part, and so its splits ----
    before_lo = tl.zeros([BLOCK_P], tl.int32)
    before_lo_cost = tl.zeros([BLOCK_P], tl.int32)
    before_last = tl.zeros([BLOCK_P], tl.int32)
    before_last_cost = tl.zeros([BLOCK_P], tl.int32)
    start = tl.zeros([], tl.int32)
    splits_done = tl.zeros([], tl.int32)
    any_split = tl.zeros([], tl.int32)
    tl.store(num_splits_ptr, 0)
    for i0 in range(0, b, BLOCK_B):
        i = i0 + tl.arange(0, BLOCK_B)
        ok = i < b
        pages, cost = _pages(seqlens_ptr, i, ok)
        first = start + tl.cumsum(cost, 0) - cost
        end = first + cost
        start += tl.sum(cost, 0)
        ends_lo = (end[None, :] <= lo[:, None]) & ok[None, :]
        ends_last = (end[None, :] <= last_pos[:, None]) & ok[None, :]
        before_lo += tl.sum(ends_lo.to(tl.int32), 1)
        before_lo_cost += tl.sum(tl.where(ends_lo, cost[None, :], 0), 1)
        before_last += tl.sum(ends_last.to(tl.int32), 1)
        before_last_cost += tl.sum(tl.where(ends_last, cost[None, :], 0), 1)
        first_part = _parts_ending_by(first, total, pieces, parts)
        last_part = _parts_starting_before(first + pages, total, pieces, parts) - 1
        splits = tl.where(ok & (pages > 0), last_part - first_part + 1, 0)
        any_split = tl.maximum(any_split, tl.max((splits > 1).to(tl.int32), 0))
        tl.store(num_splits_ptr + 1 + i, splits_done + tl.cumsum(splits, 0), mask=ok)
        splits_done += tl.sum(splits, 0)

    # ---- each part's first and last request and page ----
    last_pages, last_cost = _pages(seqlens_ptr, tl.full([BLOCK_P], b - 1, tl.int32), p_ok)
    begin_req = tl.minimum(before_lo, b - 1)
    begin_start = tl.where(before_lo < b, before_lo_cost, total - last_cost)   # the request's first position
    begin_pages, begin_cost = _pages(seqlens_ptr, begin_req, p_ok)
    begin_page = tl.minimum(lo - begin_start, begin_pages)
    in_overhead = begin_page >= begin_pages      # a piece starting in overhead begins with the next request
    next_start = tl.where(in_overhead & (begin_req + 1 < b), begin_start + begin_cost, begin_start)
    begin_req += in_overhead.to(tl.int32)
    begin_page = tl.where(in_overhead, 0, begin_page)
    last_req = tl.minimum(before_last, b - 1)
    last_start = tl.where(before_last < b, before_last_cost, total - last_cost)
    end_pages, _ = _pages(seqlens_ptr, last_req, p_ok)
    end_page = tl.minimum(tl.minimum(last_pos - last_start, end_pages) + 1, end_pages)
    empty = (hi <= lo) | (begin_req > last_req) | ((begin_req == last_req) & (begin_page >= end_page))
    # the split number of the part's first request: the parts before that touch it
    begin_split = p - _parts_ending_by(next_start, total, pieces, parts)
    first_pages, _ = _pages(seqlens_ptr, tl.minimum(begin_req, b - 1), p_ok)

    # ---- the alternative: request i alone in part i, nothing split, where that is not slower ----
    if b <= parts:
        pieces_cost = (total + pieces - 1) // pieces + tl.where(any_split > 0, combine, 0)
        if max_cost <= pieces_cost:
            own_pages, _ = _pages(seqlens_ptr, p, p < b)
            used = own_pages > 0
            begin_req = tl.where(used, p, b)
            last_req = tl.where(used, p, -1)
            begin_page = tl.zeros_like(begin_page)
            end_page = tl.where(used, own_pages, 0)
            begin_split = tl.zeros_like(begin_split)
            first_pages = own_pages
            end_pages = own_pages
            empty = ~used
            tl.store(num_splits_ptr + 1 + p, tl.cumsum(used.to(tl.int32), 0), mask=p < b)

    row = meta_ptr + p * METADATA_WIDTH
    tl.store(row + BEGIN_REQ, tl.where(empty, b, begin_req), mask=p_ok)
    tl.store(row + BEGIN_PAGE, tl.where(empty, 0, begin_page), mask=p_ok)
    tl.store(row + END_REQ, tl.where(empty, -1, last_req), mask=p_ok)
    tl.store(row + END_PAGE, tl.where(empty, 0, end_page), mask=p_ok)
    tl.store(row + BEGIN_SPLIT, tl.where(empty, 0, begin_split), mask=p_ok)
    tl.store(row + BEGIN_REQ_PAGES, tl.where(empty, 0, first_pages), mask=p_ok)
    tl.store(row + END_REQ_PAGES, tl.where(empty, 0, end_pages), mask=p_ok)
    tl.store(row + PLANNED_ROWS, tl.zeros([BLOCK_P], tl.int32) + rows, mask=p_ok)


_launch = CachedLauncher(plan_kernel)


class ScheduleCall(NamedTuple):
    cache_seqlens: torch.Tensor
    rows: int                # query rows per request
    num_parts: int | None
    signature: int | None    # checks.check_metadata's number (None: unknown)


def _plan(call: ScheduleCall):
    """``launch(call)`` for calls of ``call``'s signature: the cut, the constexprs and the sizes worked out once."""
    b = call.cache_seqlens.shape[0]
    c = cut(b, call.rows, call.cache_seqlens.device, call.num_parts)
    variant = _launch.variant(dict(STEPS=c.steps, ALIGN=c.align, BLOCK_P=max(16, 1 << c.parts.bit_length())),
                              num_warps=8)   # (BLOCK_P >= parts + 1)
    sizes = (b, c.parts, c.most, c.step, c.combine, call.rows)

    def launch(call):
        meta = call.cache_seqlens.new_empty((c.parts, METADATA_WIDTH.value), dtype=torch.int32)
        num_splits = call.cache_seqlens.new_empty((b + 1,), dtype=torch.int32)
        # the launch key: the signature's number, which fixes cache_seqlens' dtype and alignment and every int
        # argument (the outputs are new, so aligned); None: worked out from the arguments
        variant((1,), (call.cache_seqlens, meta, num_splits, *sizes), call.signature, ASK)
        return meta, num_splits
    return launch


def launch_plan(cache_seqlens: torch.Tensor, rows: int, num_parts: int | None = None,
                signature: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(metadata [parts, 8] int32, num_splits [b + 1] int32) of a non-empty batch of ``rows`` query rows a request,
    by one launch, planned once per signature (launcher.planned)."""
    call = ScheduleCall(cache_seqlens, rows, num_parts, signature)
    return planned(_plan, call)(call)
