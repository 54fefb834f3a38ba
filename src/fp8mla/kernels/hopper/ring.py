"""The page ring: a CTA's walk through its part of the split-KV schedule, and the shared-memory slots its KV pages
are loaded into by TMA.

Words (docs/design.md defines them for the whole project): a *part* is one CTA's share of the schedule, a run of
pages from (begin request, begin page) to (end request, end page); a *page* is 64 tokens of one request's cache,
reached through the block table; a ring *position* counts the pages a CTA has loaded (or consumed) across all its
requests, and its *slot* is position % RING.

``sched`` is (meta, seqlens_ptr, max_pages, num_splits_ptr, b, the split buffers' rows), meta pointing at this CTA's
part of the schedule;
``part`` is (meta, seqlens_ptr, max_pages, begin request, end request), read from it by ``open_part``; a cursor
is (request, page, on a page?, the request's seqlen, its end page) and moves by ``advance``; ``table`` is
(block_table_ptr, its row stride, the cache's pages).

Bad input never makes a load leave its tensor: a seqlen beyond the block table is cut to the table's pages (the
combine marks the request NaN), and a block-table entry outside the cache loads page 0 instead and marks its ring
slot (``Ring.bad``), so that the request's consumer makes its out and lse NaN; so does a request whose page count
is not what the schedule was planned for (``planned_for``). A schedule get_mla_metadata did not write (never
written, or overwritten) cannot send a load or store outside its tensor either: a part's requests are clamped to
the batch, its first page to >= 0, and a partial result is stored only into a slot of its own request's range
inside the split buffers (``split_slot``); the combine checks the schedule for each request and marks the requests
it does not fit NaN.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..constants import (BEGIN_PAGE, BEGIN_REQ, BEGIN_REQ_PAGES, BEGIN_SPLIT, D_LATENT, END_PAGE, END_REQ,
                         END_REQ_PAGES, FP8_ROPE_BF16, PAGE_SIZE, ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET)
from ..triton_compat import aggregate, cp_async_load, reinterpret, tma_load


@gluon.jit
def open_part(sched):
    """This CTA's part: (meta, seqlens_ptr, max_pages, begin request, end request), its requests within the batch;
    a part with begin > end is empty."""
    meta, seqlens_ptr, max_pages, _, b, _ = sched
    begin_req = gl.maximum(gl.load(meta + BEGIN_REQ), 0)
    end_req = gl.minimum(gl.load(meta + END_REQ), b - 1)
    return meta, seqlens_ptr, max_pages, begin_req, end_req


@gluon.jit
def _begin_page(part):
    return gl.maximum(gl.load(part[0] + BEGIN_PAGE), 0)


@gluon.jit
def request_range(part, req):
    """(seqlen, first page, end page) of request req within this CTA's part (no pages if the part is empty:
    then req is one past the last request, and seqlens is not read)."""
    meta, seqlens_ptr, max_pages, begin_req, end_req = part
    seqlen = gl.load(seqlens_ptr + req, mask=req <= end_req, other=0)
    lo = gl.where(req == begin_req, _begin_page(part), 0)
    hi = gl.where(req == end_req, gl.load(meta + END_PAGE), (seqlen + PAGE_SIZE - 1) // PAGE_SIZE)
    return seqlen, lo, gl.minimum(hi, max_pages)


@gluon.jit
def planned_for(part, req, seqlen):
    """Whether the schedule was planned for the request's page count where it matters: for the part's first and
    last requests (the requests between are covered whatever their length)."""
    meta, _, _, begin_req, end_req = part
    pages = gl.where(seqlen > 0, (seqlen + PAGE_SIZE - 1) // PAGE_SIZE, 0)
    planned = gl.where(req == end_req, gl.load(meta + END_REQ_PAGES),
                       gl.where(req == begin_req, gl.load(meta + BEGIN_REQ_PAGES), pages))
    return planned == pages


@gluon.jit
def split_slot(sched, req, begin_req):
    """(True if the request has a single split, its partial-result slot, True if the slot is the request's own: a
    schedule planned for a request of no pages gives it none, and one get_mla_metadata did not write may give a
    slot outside the request's range or the split buffers)."""
    meta, _, _, num_splits_ptr, _, slots = sched
    split0 = gl.load(num_splits_ptr + req)
    n_splits = gl.load(num_splits_ptr + req + 1) - split0
    piece = gl.where(req == begin_req, gl.load(meta + BEGIN_SPLIT), 0)
    split = split0 + piece
    owned = (piece >= 0) & (piece < n_splits) & (split >= 0) & (split < slots)
    return n_splits == 1, split, owned


@gluon.jit
def _seek(part, req, blk):
    """The cursor on the first page of the part at or after (req, blk), requests past their last page skipped."""
    end_req = part[4]
    seqlen, lo, hi = request_range(part, req)
    while (blk >= hi) & (req < end_req):
        req += 1
        seqlen, lo, hi = request_range(part, req)
        blk = lo
    return req, blk, blk < hi, seqlen, hi


@gluon.jit
def part_start(part):
    """The cursor on the part's first page."""
    return _seek(part, part[3], _begin_page(part))


@gluon.jit
def advance(part, cursor):
    """The cursor on the page after this one; reads metadata only when the request ends, so a step costs no
    global-memory round trip."""
    req, blk, ok, seqlen, hi = cursor
    blk += 1
    ok = blk < hi
    if blk >= hi:
        req, blk, ok, seqlen, hi = _seek(part, req, blk)
    return req, blk, ok, seqlen, hi


@gluon.jit
def _page_of(table, cursor):
    """The block-table entry under the cursor, read only if it is on a page: past its part's end it may point one
    past the table's row, and a table may have no columns at all."""
    block_table_ptr, stride_bt, _ = table
    req, blk, ok, _, _ = cursor
    return gl.load(block_table_ptr + req * stride_bt + blk, mask=ok, other=0)


@gluon.jit
def load_cursor_start(part, table):
    """The TMA issuer's cursor on the part's first page, and that page's block-table entry. The issuer reads each
    entry one load ahead, so that read's latency hides behind a page of work."""
    cursor = part_start(part)
    return cursor, _page_of(table, cursor)


@gluon.jit
def load_cursor_step(part, table, cursor):
    """The TMA issuer's cursor on the next page, with that page's block-table entry."""
    cursor = advance(part, cursor)
    return cursor, _page_of(table, cursor)


# ---- the gather ring (a sparse call): a page is 64 of a request's indices, each a cache row of its own ----
# the gather ring's issuers: a page is 64 rows x 41 copies of 16 bytes, 82 cp.async a lane from one warp; four
# (the registers are the padded warpgroup's anyway) issue a quarter each
GATHER_WARPS = gl.constexpr(4)
LAT_CHUNK = gl.constexpr(128)   # latent bytes of a row per swizzle block (LAT_SMEM's 128-byte swizzle)


@triton.constexpr_function
def gather_layout(vec, warps):
    """The issuer's 16-byte copies of 64 rows, vec elements each: [64, 128] e4m3 (a latent chunk), [64, 64] bf16
    (RoPE) and [64, 4] fp32 (the descales: one copy a row, which the 8 lanes across share) take the same threads'
    rows (4 lanes x the issuer's warps down), so one index vector serves them all."""
    return gl.BlockedLayout([1, vec], [4, 8], [warps, 1], [1, 0])


@triton.constexpr_function
def gather_arrivals(warps):
    """ring.ready's arrivals in the gather ring: the issuing partition's threads, each as its copies land."""
    return 32 * warps


@gluon.jit
def gather_indices(table, sparse, cursor, LAYOUT: gl.constexpr, HAS_TOPK_LENGTH: gl.constexpr):
    """The 64 indices of the page under the cursor, in LAYOUT's rows ([64] int32, -1 where none: past topk, past the
    request's topk_length, or off a page). table: (indices_ptr, its row stride, the cache's pages); sparse: (Q_GROUP,
    topk_length_ptr, sink_ptr)."""
    indices_ptr, stride, _ = table
    req, blk, ok, seqlen, _ = cursor
    counted = seqlen
    if HAS_TOPK_LENGTH:
        counted = gl.minimum(gl.load(sparse[1] + req // sparse[0], mask=ok, other=0), seqlen)
    tok = blk * PAGE_SIZE + gl.arange(0, PAGE_SIZE, gl.SliceLayout(1, LAYOUT))
    return gl.load(indices_ptr + req * stride + tok, mask=ok & (tok < counted), other=-1)


@gluon.jit
def topk_length_bad(sparse, req, seqlen):
    """Whether a sparse call's request (a query token) has its entry's topk_length outside [0, topk] (seqlen): the
    gather ring counts only the indices within it, and the request is marked."""
    length = gl.load(sparse[1] + req // sparse[0])
    return (length < 0) | (length > seqlen)


@gluon.jit
def gather_cursor_start(part, table, sparse, HAS_TOPK_LENGTH: gl.constexpr):
    """load_cursor_start for the gather ring: the cursor and its page's indices. The issuer reads each page's
    indices one load ahead, so that read's latency hides behind a page of work."""
    cursor = part_start(part)
    return cursor, gather_indices(table, sparse, cursor, gather_layout(16, gl.num_warps()), HAS_TOPK_LENGTH)


@gluon.jit
def gather_cursor_step(part, table, sparse, cursor, HAS_TOPK_LENGTH: gl.constexpr):
    cursor = advance(part, cursor)
    return cursor, gather_indices(table, sparse, cursor, gather_layout(16, gl.num_warps()), HAS_TOPK_LENGTH)


@gluon.jit
def _gather_rows(dst, row_ptr, ok, col0: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async of [64, n] columns col0.. (of dst's dtype, 16 bytes a copy) of the rows at row_ptr (gather_layout's
    rows) into dst, in LAYOUT; rows not ok zero-filled."""
    row_ptr = gl.convert_layout(row_ptr, gl.SliceLayout(1, LAYOUT), assert_trivial=True)
    ok = gl.convert_layout(ok, gl.SliceLayout(1, LAYOUT), assert_trivial=True)
    cols = gl.arange(0, dst.shape[1], gl.SliceLayout(0, LAYOUT))
    cp_async_load(dst, (row_ptr.to(gl.pointer_type(dst.dtype)) + col0)[:, None] + cols[None, :], mask=ok[:, None])


# the latent tile [64, 512] as its four 128-byte swizzle blocks [4, 64, 128] (the same bytes: LAT_SMEM's swizzle)
LAT_CHUNKS_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))


@gluon.jit
def _gather_latent(chunks, row_ptr, ok):
    """cp.async of the rows' latent bytes into chunks [D_LATENT / LAT_CHUNK, rows, LAT_CHUNK] (LAT_SMEM's swizzle
    blocks) as one copy: a copy per block would be separate writes into one buffer, each fenced from the next by a
    barrier of the issuing warps."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [1, gl.num_warps(), 1], [2, 1, 0])
    row_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L3))
    row_ptr = gl.convert_layout(row_ptr, row_l, assert_trivial=True)
    ok = gl.convert_layout(ok, row_l, assert_trivial=True)
    c = gl.arange(0, chunks.shape[0], gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    cols = gl.arange(0, LAT_CHUNK, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    ptrs = (row_ptr.to(gl.pointer_type(chunks.dtype))[None, :, None] + (c * LAT_CHUNK)[:, None, None]
            + cols[None, None, :])
    cp_async_load(chunks, ptrs, mask=ok[None, :, None])


@gluon.jit
def _put_warp_flags(slot, outside):
    """Each issuing warp's flag word in slot [warps] := whether any of its rows (outside [N], gather_layout's rows:
    bits 0-1 in lanes, then the warps, then registers) is outside the cache: a max within each warp, no barrier
    across them."""
    W: gl.constexpr = gl.num_warps()
    x = gl.reshape(outside.to(gl.int32), [outside.shape[0] // (4 * W), W, 4])
    slot.store(gl.max(gl.max(x, axis=2), axis=0))


# [n, words]: a slot's flag words (1, or a gather ring's issuing warps')
FLAG_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))


@gluon.jit
def put_flag(slot, value):
    """A [1] int32 slot of shared memory := value (every thread of the warps storing the same)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    slot.store(gl.full([1], 0, gl.int32, layout) + value.to(gl.int32))


@gluon.jit
def get_flag(slot):
    """Whether any of a slot's flag words ([words] int32: 1, or a gather ring's issuing warps') is set; every thread
    reads every word."""
    layout: gl.constexpr = gl.BlockedLayout([slot.shape[0]], [32], [gl.num_warps()], [0])
    return gl.max(slot.load(layout), axis=0) != 0


@gluon.jit
def page_index(table, page):
    """(the page to load, whether the block-table entry was outside the cache and so replaced by page 0)."""
    outside = (page < 0) | (page >= table[2])
    return gl.where(outside, 0, page), outside


@aggregate
class Ring:
    """The FP8 kernels' KV page ring: RING slots, each holding one page's latent [64, 512] e4m3, RoPE [64, 64] and
    (fp8_rope_bf16) token scales [64, SCALE_COLS] fp32, with two barriers a slot: ready (TMA: the page's bytes
    arrived) and empty (its consumers are done with it: handshakes.py); and a flag a slot, bad: its block-table
    entry was outside the cache."""
    lat: gl.shared_memory_descriptor
    rope: gl.shared_memory_descriptor
    scale: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    bad: gl.shared_memory_descriptor

    @triton.constexpr_function
    def __init__(self, lat, rope, scale, ready, empty, bad):
        self.lat = lat
        self.rope = rope
        self.scale = scale
        self.ready = ready
        self.empty = empty
        self.bad = bad

    @gluon.jit
    def page_outside(self, pos):
        """Whether ring position pos's block-table entry (or index) was outside the cache (after wait): the slot's
        flag, or (the gather ring) any of its issuing warps' flags."""
        RING: gl.constexpr = self.lat.shape[0]
        return get_flag(self.bad.index(pos % RING))

    @gluon.jit
    def wait(self, pos, GATHERED: gl.constexpr = False):
        """Wait until ring position pos's page is in its slot. GATHERED (the gather ring's pages, by a wgmma's
        reader): cp.async wrote the page through the generic proxy, which a wgmma (async proxy) must be fenced
        from."""
        RING: gl.constexpr = self.lat.shape[0]
        mbarrier.wait(self.ready.index(pos % RING), (pos // RING) & 1)
        if GATHERED:
            fence_async_shared()

    @gluon.jit
    def release(self, pos):
        """One of the slot's consumers is done with ring position pos's page."""
        RING: gl.constexpr = self.lat.shape[0]
        mbarrier.arrive(self.empty.index(pos % RING))

    @gluon.jit
    def load(self, descs, table, page, pos, KV_FORMAT: gl.constexpr):
        """TMA the block-table entry `page` into ring position pos's slot, once the page before it there is
        released. descs: the cache's (latent, RoPE, scale) TMA descriptors."""
        lat_desc, rope_desc, scale_desc = descs
        RING: gl.constexpr = self.lat.shape[0]
        s = pos % RING
        mbarrier.wait(self.empty.index(s), ((pos // RING) & 1) ^ 1)
        page, outside = page_index(table, page)
        put_flag(self.bad.index(s), outside)   # before the arrival that publishes the slot
        row = page * PAGE_SIZE
        page_bytes: gl.constexpr = lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
        if KV_FORMAT == FP8_ROPE_BF16:
            mbarrier.expect(self.ready.index(s), page_bytes + scale_desc.block_type.nbytes)
            tma_load(scale_desc, [row, 0], self.ready.index(s), self.scale.index(s))
        else:
            mbarrier.expect(self.ready.index(s), page_bytes)
        tma_load(lat_desc, [row, 0], self.ready.index(s), self.lat.index(s))
        tma_load(rope_desc, [row, 0], self.ready.index(s), self.rope.index(s))

    @gluon.jit
    def gather(self, cache, idx, pos):
        """cp.async the 64 cache rows idx names (gather_indices') into ring position pos's slot, once the page before
        it there is released; the slot's ready barrier counts the issuing partition's threads' arrivals
        (gather_arrivals), each when its copies have landed. A row -1 is zero-filled (V 0, no NaN); one outside the
        cache too, and it flags the slot (Ring.bad: a word per issuing warp). cache: (the cache's bytes, its rows).
        The 656-byte formats."""
        kv_ptr, cache_rows = cache
        RING: gl.constexpr = self.lat.shape[0]
        s = pos % RING
        mbarrier.wait(self.empty.index(s), ((pos // RING) & 1) ^ 1)
        outside = (idx < -1) | (idx >= cache_rows)
        _put_warp_flags(self.bad.index(s), outside)   # before the arrival that publishes the slot
        ok = (idx >= 0) & (idx < cache_rows)
        row_ptr = kv_ptr + gl.where(ok, idx, 0).to(gl.int64) * ROW_BYTES
        chunks = reinterpret(self.lat.index(s), self.lat.dtype, [D_LATENT // LAT_CHUNK, PAGE_SIZE, LAT_CHUNK],
                             LAT_CHUNKS_SMEM)
        _gather_latent(chunks, row_ptr, ok)
        _gather_rows(self.rope.index(s), row_ptr, ok, ROPE_OFFSET // 2, gather_layout(8, gl.num_warps()))
        _gather_rows(self.scale.index(s), row_ptr, ok, SCALE_OFFSET // 4, gather_layout(4, gl.num_warps()))
        async_copy.mbarrier_arrive(self.ready.index(s), increment_count=False)

    @gluon.jit
    def fake_load(self, pos):
        """ablations.SKIP_REFILLS: ring position pos's slot completes at once, keeping the page it held."""
        RING: gl.constexpr = self.lat.shape[0]
        mbarrier.wait(self.empty.index(pos % RING), ((pos // RING) & 1) ^ 1)
        mbarrier.arrive(self.ready.index(pos % RING))


@gluon.jit
def fill_ring(sched, table, descs, cache, sparse, ring, KV_FORMAT: gl.constexpr, GATHER: gl.constexpr,
              HAS_TOPK_LENGTH: gl.constexpr):
    """A partition of its own (small.py's load warps, fp8.py's gather warpgroup): every page of the part into the
    ring, as soon as its slot is released: by TMA, or (GATHER) each index's row by cp.async (the gather ring; the
    warps wait for each page's indices, its ring pages ahead)."""
    part = open_part(sched)
    loaded = 0
    if GATHER:   # each page's indices read one page ahead, so their latency hides behind the page before's copies
        cursor, idx = gather_cursor_start(part, table, sparse, HAS_TOPK_LENGTH)
        while cursor[2]:
            ring.gather(cache, idx, loaded)
            loaded += 1
            cursor, idx = gather_cursor_step(part, table, sparse, cursor, HAS_TOPK_LENGTH)
    else:
        load_cursor, load_page = load_cursor_start(part, table)
        while load_cursor[2]:
            ring.load(descs, table, load_page, loaded, KV_FORMAT)
            loaded += 1
            load_cursor, load_page = load_cursor_step(part, table, load_cursor)
