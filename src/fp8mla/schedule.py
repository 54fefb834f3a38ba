"""The split-KV schedule and its cost model: how a batch's KV pages are spread over the SMs, and how the combine
step merges the pieces a request was cut into.

All requests' pages are laid end to end on one timeline, each request followed by ``FIXED_COST`` virtual pages that
stand for its per-split overhead (loading q, writing a partial result). The timeline is cut into ``num_parts`` equal
pieces; a piece that starts or ends inside a request splits it. A split request costs the combine step its partial
results' round trip through memory, so when the batch has no more requests than parts and one request per part is
not slower than the equal pieces plus that cost (``COMBINE_ROWS_PER_PAGE`` query rows merged per page of time), each
request gets a part of its own and nothing is split (a batch of equal lengths, the common case, costs one part 2-3%
more pages and saves the combine's traffic). A batch whose requests all have the same number of pages is cut
by default (no ``num_parts`` given) into at most ``b * (num_parts // b)`` parts when that leaves at most
``ALIGN_SLACK`` of the parts empty: every request then splits into the same number of pieces and no part holds the
end of one request and the start of the next (measured on the H200 for b = 4-128: 2-9% faster with the FP8
formats, ~1% with bf16; b=64 with 128 rows already gets a request per part). Small batches of long requests get
fewer pieces still where that saves the combine a step (``_pieces_per_request``; b=1-4: up to 1.29x faster), and
so do small batches of different lengths (at most half as many requests as parts; ``_pieces_for_steps``: the
request cut into the most pieces sets the combine's steps).
What does not depend on the seqlens' values (the number of parts, which of the cuts above apply, the combine's
step) is decided on the host (``cut``); the rest on the device: by one kernel launch (kernels/planner.py), or by
``plan``, the same schedule in torch ops, which the tests take as the kernel's reference.

``tile_scheduler_metadata`` is ``[num_parts, METADATA_WIDTH]`` int32; part ``p`` covers, in order, the pages

    (begin_req, begin_page) .. (end_req, end_page)      end_page exclusive, within end_req

and its first request's partial result is split number ``begin_split`` of that request (the following requests
of a part start with split 0). A part with ``begin_req > end_req`` is empty. The part also records the page count
its first and last requests were planned with (``begin_req_pages``, ``end_req_pages``): a decode whose seqlens
give those requests other counts marks them NaN (a stale schedule), as the requests in between are covered
whatever their length. ``num_splits`` is ``[b + 1]`` int32 prefix sums: request i's partial results live at rows
``num_splits[i] .. num_splits[i + 1]`` of the split buffers; a request with a single split writes the output
directly and needs no combine, one with none (seqlen 0) gets its zeros from the combine. A negative seqlen counts
as no pages (the decode marks it NaN). Every part also records the query rows per request the schedule was planned
for (``planned_rows``, ``num_q_tokens_per_head_k``), which the decode does not read: the schedule cuts pages, and
each part's pages are decoded for all of a call's row blocks, so a call of other rows (another s_q) decodes right
with it, only on a cut made for the other rows' number of parts (SMs / 64-row blocks). ``validate=True`` reads it to
say so (checks.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .formats import D_LATENT, PAGE_SIZE
from . import runtime

METADATA_WIDTH = 8
BEGIN_REQ, BEGIN_PAGE, END_REQ, END_PAGE, BEGIN_SPLIT, BEGIN_REQ_PAGES, END_REQ_PAGES, PLANNED_ROWS = range(8)
FIXED_COST = 2        # a split's overhead, in pages
COMBINE_ROWS_PER_PAGE = 16  # query rows whose partial results the combine step merges in about a page's time
COMBINE_STEP_PAGES = 2  # one more step of the combine costs about as much as two pages more per piece
ALIGN_SLACK = 0.04    # equal-length batches: the share of parts that may stay empty for aligned pieces
ROWS_PER_BLOCK = 64   # query rows one program handles (num_parts keeps all row blocks inside one wave)

# the combine step (kernels/combine.py): its programs and the pieces one of its steps merges
COMBINE_ROWS = 8         # query rows per program
SPREAD_SLICES = 4        # column slices when (request, row block) programs are few
MIN_COMBINE_DIMS = 64    # the narrowest slice of the 512 columns a program merges (when most SMs would idle still)
STEP_ELEMENTS = 16384    # at most this many partial-O elements a program loads per step (128 per thread)


def _sm_parts(sms: int, rows: int, block_rows: int = ROWS_PER_BLOCK) -> int:
    return max(sms // -(-rows // block_rows), 1)


def num_sm_parts(device: torch.device, num_q_tokens_per_head_k: int, block_rows: int = ROWS_PER_BLOCK) -> int:
    """How many parts the schedule has by default: one per SM, shared by the request's row blocks (of block_rows
    query rows: a CTA's)."""
    return _sm_parts(runtime.sm_count(torch.device(device)), num_q_tokens_per_head_k, block_rows)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def combine_tile(slices: int, pieces: int) -> dict:
    """The combine kernel's tile constants when the 512 columns are cut into ``slices`` and a split request has about
    ``pieces`` pieces: a step loads them all if it can (no second step's wait), but not many more (masked loads)."""
    width = D_LATENT // slices
    step = min(_next_power_of_2(pieces), STEP_ELEMENTS // (COMBINE_ROWS * width))
    return dict(BLOCK_ROWS=COMBINE_ROWS, BLOCK_D=width, STEP_SPLITS=max(step, 2))


@functools.lru_cache(maxsize=1024)   # once per batch shape: this is on every decode call's host path
def combine_plan(b: int, rows: int, parts: int, sms: int) -> tuple[int, int, dict]:
    """(row blocks, slices of the 512 columns, tile constants) that merge the partial results of ``b`` requests of
    ``rows`` query rows after a schedule of ``parts`` parts on ``sms`` SMs. The constants are shared: not to be
    changed."""
    row_blocks = -(-rows // COMBINE_ROWS)
    # few (request, row block) programs, e.g. one request cut into many pieces: the columns are split too (up to
    # 4 ways) so that the merge's reads come from enough SMs; 8 ways if that leaves most SMs idle still
    slices = 1
    while slices < SPREAD_SLICES and b * row_blocks * slices < 2 * sms:
        slices *= 2
    if 2 * b * row_blocks * slices <= sms:
        slices = D_LATENT // MIN_COMBINE_DIMS
    return row_blocks, slices, combine_tile(slices, max(1, parts // b))   # about parts / b pieces a request


def step_splits(b: int, rows: int, parts: int, sms: int) -> int:
    """How many pieces of a request one step of the combine merges (the cut fits whole steps)."""
    return combine_plan(b, rows, parts, sms)[2]["STEP_SPLITS"]


class MLASchedule:
    """FlashMLA's current calling convention: ``get_mla_metadata()`` with no arguments returns an empty schedule;
    the first decode call it is passed to plans it for that call's batch (one launch), and later calls reuse it
    while the batch's configuration (requests, query rows a request, device) holds; a call with another plans it
    anew. Make one per decode step and pass it to every layer's call, with ``num_splits=None``."""
    __slots__ = ("config", "tile_scheduler_metadata", "num_splits")

    def __init__(self):
        self.config = None
        self.tile_scheduler_metadata = self.num_splits = None


@dataclass(frozen=True)
class Cut:
    """The host's share of a step's schedule: what does not depend on the seqlens' values."""
    parts: int
    steps: bool      # few requests of different lengths: as many pieces as fit the combine's steps best
    align: bool      # if the requests are of one length: each in the same number of equal pieces (at most `most`)
    most: int        # parts // b
    step: int        # pieces one step of the combine merges
    combine: int     # what merging split partial results costs, in pages (the whole-request alternative's bar)


@functools.lru_cache(maxsize=1024)   # once per batch shape: this is on every step's host path
def _cut(b: int, rows: int, sms: int, num_parts: int | None) -> Cut:
    parts = num_parts or _sm_parts(sms, rows)
    choose = num_parts is None and b > 0
    align = choose and parts * (1 - ALIGN_SLACK) <= b * (parts // b)
    steps = choose and 1 < b and 2 * b <= parts
    step = step_splits(b, rows, parts, sms) if align or steps else 2
    return Cut(parts, steps, align, parts // b if b else 0, step, -(-rows // COMBINE_ROWS_PER_PAGE))


def cut(b: int, rows: int, device: torch.device, num_parts: int | None = None) -> Cut:
    """The cut for ``b`` requests of ``rows`` query rows on ``device``; ``num_parts`` (default: one per SM and row
    block) fixes the number of parts and turns off the choice of pieces (module docstring)."""
    return _cut(b, rows, runtime.sm_count(device), num_parts)


def plan(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_parts: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_scheduler_metadata [num_parts, 8] int32, num_splits [b + 1] int32)`` for one decode step, computed
    with torch ops on ``cache_seqlens``'s device (its inputs checked by the caller): the reference of the planner
    kernel (kernels/planner.py)."""
    return _plan(cache_seqlens, num_q_tokens_per_head_k, cut(len(cache_seqlens), num_q_tokens_per_head_k,
                                                              cache_seqlens.device, num_parts))


@functools.lru_cache(maxsize=1024)   # once per shape: asked when a sparse call's launches are planned
def _most_splits(b: int, rows: int, seqlen: int, sms: int, num_parts: int | None) -> int:
    _, num_splits = _plan(torch.full((b,), seqlen, dtype=torch.int32), rows, _cut(b, rows, sms, num_parts))
    return int(num_splits.diff().max()) if b else 0


def most_splits(b: int, rows: int, seqlen: int, device: torch.device, num_parts: int | None = None) -> int:
    """The most pieces ``plan`` cuts any of ``b`` requests of ``seqlen`` tokens each into on ``device`` (worked out
    on the host: a sparse call's requests all have topk tokens, so its schedule is known without reading it)."""
    return _most_splits(b, rows, seqlen, runtime.sm_count(device), num_parts)


def _plan(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, c: Cut) -> tuple[torch.Tensor, torch.Tensor]:
    device = cache_seqlens.device
    b = len(cache_seqlens)
    if b == 0:
        meta = torch.zeros(c.parts, METADATA_WIDTH, dtype=torch.int32, device=device)
        meta[:, END_REQ] = -1
        meta[:, PLANNED_ROWS] = num_q_tokens_per_head_k
        return meta, torch.zeros(1, dtype=torch.int32, device=device)

    pages = (cache_seqlens.to(torch.int64).clamp(min=0) + PAGE_SIZE - 1) // PAGE_SIZE
    pieces = _pieces_for_steps(pages, c.parts, c.step) if c.steps else c.parts   # the other parts stay empty
    if c.align:
        pieces = torch.where((pages == pages[0]).all(), b * _pieces_per_request(pages[0], c.most, c.step), pieces)
    meta, num_splits = _schedule(pages, c.parts, pieces, c.combine)
    meta[:, PLANNED_ROWS] = num_q_tokens_per_head_k
    return meta.to(torch.int32), num_splits.to(torch.int32)


def _pieces_per_request(pages: torch.Tensor, most: int, step: int) -> torch.Tensor:
    """How many equal pieces to cut each of equal requests of ``pages`` pages into (at most ``most``): the fewest
    page-times of the longest piece plus ``COMBINE_STEP_PAGES`` for each step the combine takes over ``step`` pieces
    at a time; ties go to more pieces. (On the H200 at b=1 s_q=2 h_q=64 sk=8192, 64 pieces in two steps took 16.4
    us, 65 pieces of fewer pages in three 18.5.)"""
    cost = pages + FIXED_COST
    n = torch.arange(most, 0, -1, device=pages.device)   # the candidates, most pieces first
    splits = -(-n * pages // cost)   # pieces that start before the request's overhead positions
    t = -(-cost // n) + COMBINE_STEP_PAGES * -(-splits // step)
    return most - torch.where(n <= cost, t, t.max() + 1).argmin()   # (not n[...]: a 0-d index is read back)


def _pieces_for_steps(pages: torch.Tensor, parts: int, step: int) -> torch.Tensor:
    """How many equal pieces (at most ``parts``) to cut the timeline of requests of ``pages`` pages into: the fewest
    page-times of the longest piece plus ``COMBINE_STEP_PAGES`` for each step the combine takes over ``step``
    pieces at a time on the request cut into the most pieces (as _pieces_per_request does for equal requests);
    ties go to more pieces. Every candidate's cut is counted as _schedule makes it ([candidates, b] positions)."""
    cost = pages + FIXED_COST * (pages > 0)
    start = torch.cumsum(cost, 0) - cost
    total = cost.sum().clamp(min=1)   # (no pages at all: one piece, empty)
    n = torch.arange(parts, 0, -1, device=pages.device)[:, None]   # the candidates, most pieces first

    def piece(pos):  # the piece of n equal ones (boundaries k * total // n) that holds timeline position pos
        return ((pos + 1) * n + total - 1) // total - 1

    splits = torch.where(pages > 0, piece(start + pages - 1) - piece(start) + 1, 0).amax(dim=1)
    steps = torch.where(splits > 1, -(-splits // step), 0)
    t = -(-total // n[:, 0]) + COMBINE_STEP_PAGES * steps
    return parts - torch.where(n[:, 0] <= total, t, t.max() + 1).argmin()   # (not n[...]: a 0-d index is read back)


def _schedule(pages: torch.Tensor, parts: int, pieces, combine: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The timeline cut into ``pieces`` (an int or a 0-d tensor, <= parts) equal pieces, or, when that is not
    cheaper, one request per part: (metadata [parts, METADATA_WIDTH], num_splits [b + 1]), int64."""
    i64 = dict(dtype=torch.int64, device=pages.device)
    cost = pages + FIXED_COST * (pages > 0)
    end = torch.cumsum(cost, 0)
    start = end - cost
    total = end[-1]
    p = torch.arange(parts + 1, **i64)
    # equal pieces; with fewer pages than parts, one page a part; the empty parts last
    bounds = torch.minimum(torch.where(total >= pieces, p * total // pieces, p), total)

    def locate(pos):  # timeline position -> (request, page); overhead positions map to page == pages[req]
        req = torch.searchsorted(end, pos, right=True).clamp(max=len(pages) - 1)
        return req, torch.minimum(pos - start[req], pages[req])

    lo, hi = bounds[:-1], bounds[1:]
    begin_req, begin_page = locate(lo)
    in_overhead = begin_page >= pages[begin_req]     # a piece starting in overhead begins with the next request
    begin_req = begin_req + in_overhead
    begin_page = torch.where(in_overhead, 0, begin_page)
    last_req, last_page = locate((hi - 1).clamp(min=0))
    end_page = torch.minimum(last_page + 1, pages[last_req])
    empty = (hi <= lo) | (begin_req > last_req) | ((begin_req == last_req) & (begin_page >= end_page))

    # parts touching request i: first_part[i] .. last_part[i]
    first_part = torch.searchsorted(hi, start, right=True)
    last_part = torch.searchsorted(lo, start + pages, right=False) - 1
    splits = torch.where(pages > 0, last_part - first_part + 1, 0)
    num_splits = torch.zeros(len(pages) + 1, **i64)
    num_splits[1:] = torch.cumsum(splits, 0)
    begin_split = torch.arange(parts, **i64) - first_part[begin_req.clamp(max=len(pages) - 1)]

    meta = torch.zeros(parts, METADATA_WIDTH, **i64)
    meta[:, BEGIN_REQ] = torch.where(empty, len(pages), begin_req)
    meta[:, BEGIN_PAGE] = torch.where(empty, 0, begin_page)
    meta[:, END_REQ] = torch.where(empty, -1, last_req)
    meta[:, END_PAGE] = torch.where(empty, 0, end_page)
    meta[:, BEGIN_SPLIT] = torch.where(empty, 0, begin_split)
    meta[:, BEGIN_REQ_PAGES] = torch.where(empty, 0, pages[begin_req.clamp(max=len(pages) - 1)])
    meta[:, END_REQ_PAGES] = torch.where(empty, 0, pages[last_req])

    if len(pages) <= parts:  # the alternative: request i alone in part i, nothing split (chosen on the device)
        whole = torch.zeros(parts, METADATA_WIDTH, **i64)
        req = torch.arange(parts, **i64)
        own_pages = torch.zeros(parts, **i64)
        own_pages[:len(pages)] = pages
        used = own_pages > 0
        whole[:, BEGIN_REQ] = torch.where(used, req, len(pages))
        whole[:, END_REQ] = torch.where(used, req, -1)
        whole[:, END_PAGE] = torch.where(used, own_pages, 0)
        whole[:, BEGIN_REQ_PAGES] = whole[:, END_REQ_PAGES] = whole[:, END_PAGE]
        whole_splits = torch.zeros_like(num_splits)
        whole_splits[1:] = torch.cumsum((pages > 0).to(torch.int64), 0)
        any_split = (splits > 1).any()
        pieces_cost = -(-total // pieces) + torch.where(any_split, combine, 0)
        take_whole = cost.max() <= pieces_cost
        meta = torch.where(take_whole, whole, meta)
        num_splits = torch.where(take_whole, whole_splits, num_splits)
    return meta, num_splits
