"""What the Hopper kernels (hopper.py and hopper_small.py: FP8 caches, hopper_bf16.py: bf16) share: the shapes of
their warpgroups' work, the page cursors that walk a part of the split-KV schedule (the TMA issuer's reads each
block-table entry one load ahead), q into shared memory, the online softmax, and both warpgroups' ends of a
request (lse, and O out of the PV warpgroups)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .constants import BEGIN_PAGE, BEGIN_SPLIT, D_LATENT, D_ROPE, END_PAGE, FP8_MAX, LN2, PAGE_SIZE
from .triton_compat import cp_async_load, reinterpret

BLOCK_M = gl.constexpr(64)   # query rows per CTA (one wgmma M)
HALF = gl.constexpr(256)     # output columns per PV warpgroup
LEFT, RIGHT = gl.constexpr(0), gl.constexpr(1)  # the PV warpgroups' halves
PV_REGS = gl.constexpr(168)  # registers per thread: 65536 / 384, every warpgroup gets the same
Q_CHUNK = gl.constexpr(128)  # q columns copied at a time

ROPE_BF16_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
VEC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
Q_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                       order=[1, 0]))
# S [64 rows, 64 tokens] of a BF16 wgmma (k = 16)
S_BF16 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))


def token_bit(i):  # token (or O row) bit i of a [64, n] register layout's basis
    return [1 << i, 0]


def dim_bit(i):  # dim (column) bit i
    return [0, 1 << i]


# One 32-column group of O in dim order (see _store_group): each thread's 8 consecutive dims in register order, so
# the stores vectorize; these are the registers O_ACC holds the group in, so converting to it moves nothing.
O_GROUP = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[dim_bit(0), dim_bit(1), dim_bit(2), token_bit(3)],
    lane_bases=[dim_bit(3), dim_bit(4), token_bit(0), token_bit(1), token_bit(2)],
    warp_bases=[token_bit(4), token_bit(5)], block_bases=[], shape=[64, 32]))


# what load_q finds at q_ptr
Q_AS_IS = gl.constexpr(0)         # q in q_lat's dtype (an e4m3 q in hopper.py, a bf16 q in hopper_bf16.py): copied
Q_QUANTIZE = gl.constexpr(1)      # a bf16 q (hopper_small): quantized here
Q_PREQUANTIZED = gl.constexpr(2)  # a bf16 q quantized before the launch (hopper.py): q_quant's packed rows


@gluon.jit
def load_q(q_ptr, stride_qs, stride_qh, H, R, q_lat, q_rope, descale_ptr, SOURCE: gl.constexpr):
    """One request's query rows (as many as q_lat has) into shared memory; returns each row's descale.

    SOURCE: Q_AS_IS, Q_QUANTIZE (each row to e4m3 with a scale per row, amax / 448, as q_quant.py does it: the
    latent part, and the RoPE part too where q_rope is e4m3) or Q_PREQUANTIZED (q_quant's packed rows: e4m3 latent,
    then the RoPE part in q_rope's dtype; the request's descales at descale_ptr).
    This code is on the critical path of every request's start: Q_QUANTIZE (up to 32 rows) reads the latent tile
    once, whole (at most 128 values a thread); the other sources are copied by cp.async, every copy issued before the
    one wait (one trip to memory, no registers held).
    """
    ROWS: gl.constexpr = q_lat.shape[0]
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, Q_LOAD))
    if SOURCE == Q_QUANTIZE:
        gl.static_assert(ROWS <= 32, "the whole latent tile in registers")
        row_ptr = (q_ptr + (rows // H) * stride_qs + (rows % H) * stride_qh)[:, None]
        ok = (rows < R)[:, None]
        x = gl.load(row_ptr + gl.arange(0, D_LATENT, gl.SliceLayout(0, Q_LOAD))[None, :], mask=ok, other=0.0)
        rope_ptr = row_ptr + D_LATENT + gl.arange(0, D_ROPE, gl.SliceLayout(0, Q_LOAD))[None, :]
        amax = gl.max(gl.abs(x.to(gl.float32)), axis=1)
        ROPE_FP8: gl.constexpr = q_rope.dtype == gl.float8e4nv   # one scale for the whole row: see q_quant.py
        if ROPE_FP8:
            x_rope = gl.load(rope_ptr, mask=ok, other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(x_rope.to(gl.float32)), axis=1))
        descale = gl.where(amax > 0, amax / FP8_MAX, 1.0)
        q_lat.store((x.to(gl.float32) * (1.0 / descale)[:, None]).to(gl.float8e4nv))
        if ROPE_FP8:
            q_rope.store((x_rope.to(gl.float32) * (1.0 / descale)[:, None]).to(gl.float8e4nv))
        else:
            q_rope.store(gl.load(rope_ptr, mask=ok, other=0.0))
    else:
        if SOURCE == Q_PREQUANTIZED:
            descale = gl.load(descale_ptr + rows, mask=rows < R, other=1.0)
        else:
            descale = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, Q_LOAD))
        # q_lat as its column chunks (a swizzled tile is stored swizzle-width column block by block, so chunk c is
        # [c]), indexed at run time so that the loop stays a loop (once-per-request code runs from a cold
        # instruction cache: ncu at b=8 s_q=2 h_q=64 showed "no instruction" stalls when it was unrolled)
        N_CHUNKS: gl.constexpr = D_LATENT // Q_CHUNK
        chunks = reinterpret(q_lat, q_lat.dtype, [N_CHUNKS, ROWS, Q_CHUNK], q_lat.layout)
        for c in range(N_CHUNKS):
            _copy_rows_async(chunks.index(c), q_ptr, stride_qs, stride_qh, H, R, c * Q_CHUNK)
        _copy_rows_async(q_rope, q_ptr, stride_qs, stride_qh, H, R, D_LATENT)
        async_copy.commit_group()
        async_copy.wait_group(0)
    fence_async_shared()
    return descale


@gluon.jit
def _copy_rows_async(dst, q_ptr, stride_qs, stride_qh, H, R, col0):
    """cp.async of the CTA's query rows into dst, 16 bytes a copy, from column col0 (of q's element type) on, read
    as dst's dtype (q_quant's packed rows: bf16 RoPE after the e4m3 latent part); rows >= R are zero-filled."""
    ROWS: gl.constexpr = dst.shape[0]
    COLS: gl.constexpr = dst.shape[1]
    VEC: gl.constexpr = 128 // dst.dtype.primitive_bitwidth
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 * VEC // COLS, COLS // VEC],
                                            warps_per_cta=[4, 1], order=[1, 0])
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    row_ptr = (q_ptr + (rows // H) * stride_qs + (rows % H) * stride_qh + col0).to(gl.pointer_type(dst.dtype))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    cp_async_load(dst, row_ptr[:, None] + cols[None, :], mask=(rows < R)[:, None])


@gluon.jit
def request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req):
    """(seqlen, first page, end page) of request req within this CTA's part (no pages if the part is empty:
    then req is one past the last request, and seqlens is not read)."""
    seqlen = gl.load(seqlens_ptr + req, mask=req <= end_req, other=0)
    lo = gl.where(req == begin_req, gl.load(meta_ptr + BEGIN_PAGE), 0)
    hi = gl.where(req == end_req, gl.load(meta_ptr + END_PAGE), (seqlen + PAGE_SIZE - 1) // PAGE_SIZE)
    return seqlen, lo, gl.minimum(hi, max_pages)


@gluon.jit
def split_slot(meta_ptr, num_splits_ptr, req, begin_req):
    """(True if the request has a single split, its partial-result slot)."""
    split0 = gl.load(num_splits_ptr + req)
    direct = gl.load(num_splits_ptr + req + 1) - split0 == 1
    split = split0 + gl.where(req == begin_req, gl.load(meta_ptr + BEGIN_SPLIT), 0)
    return direct, split


@gluon.jit
def _seek(meta_ptr, seqlens_ptr, max_pages, req, blk, begin_req, end_req):
    """The first page of the part at or after (req, blk), requests past their last page skipped:
    (req, blk, whether there is one, the request's seqlen, its end page)."""
    seqlen, lo, hi = request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req)
    while (blk >= hi) & (req < end_req):
        req += 1
        seqlen, lo, hi = request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req)
        blk = lo
    return req, blk, blk < hi, seqlen, hi


@gluon.jit
def advance(meta_ptr, seqlens_ptr, max_pages, req, blk, seqlen, hi, begin_req, end_req):
    """The page after (req, blk), as _seek returns it; reads metadata only when the request ends, so a
    cursor's step costs no global-memory round trip."""
    blk += 1
    ok = blk < hi
    if blk >= hi:
        req, blk, ok, seqlen, hi = _seek(meta_ptr, seqlens_ptr, max_pages, req, blk, begin_req, end_req)
    return req, blk, ok, seqlen, hi


@gluon.jit
def _page_of(block_table_ptr, stride_bt, req, blk, ok):
    """Block-table entry of (req, blk), read only if the cursor is on a page (ok): past its part's end it may point
    one past the table's row, and a table may have no columns at all."""
    return gl.load(block_table_ptr + req * stride_bt + blk, mask=ok, other=0)


@gluon.jit
def part_start(meta_ptr, seqlens_ptr, max_pages, begin_req, end_req):
    """The part's first page, as _seek returns it."""
    return _seek(meta_ptr, seqlens_ptr, max_pages, begin_req, gl.load(meta_ptr + BEGIN_PAGE), begin_req, end_req)


@gluon.jit
def load_cursor_start(meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, begin_req, end_req):
    """The TMA cursor on the part's first page: part_start's (req, blk, ok, seqlen, hi) and that page's
    block-table entry. The cursor reads each entry one load ahead, so that read's latency hides behind a page of
    work."""
    req, blk, ok, seqlen, hi = part_start(meta_ptr, seqlens_ptr, max_pages, begin_req, end_req)
    return req, blk, ok, seqlen, hi, _page_of(block_table_ptr, stride_bt, req, blk, ok)


@gluon.jit
def load_cursor_step(meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, req, blk, seqlen, hi, begin_req,
                     end_req):
    """The TMA cursor on the next page (advance), with that page's block-table entry."""
    req, blk, ok, seqlen, hi = advance(meta_ptr, seqlens_ptr, max_pages, req, blk, seqlen, hi, begin_req, end_req)
    return req, blk, ok, seqlen, hi, _page_of(block_table_ptr, stride_bt, req, blk, ok)


@gluon.jit
def mask_keys(sc, blk, key_limit, min_key_limit, TOKEN_AXIS: gl.constexpr):
    """Scores sc of the keys [n blk, n (blk + 1)) (n tokens on TOKEN_AXIS, query rows on the other) with the keys a
    row must not see at -inf. Only steps with such keys pay for the mask, which also drops NaN slots past the
    sequence's end."""
    N: gl.constexpr = sc.shape[TOKEN_AXIS]
    if (blk + 1) * N > min_key_limit:
        tok = blk * N + gl.arange(0, N, gl.SliceLayout(1 - TOKEN_AXIS, sc.type.layout))
        sc = gl.where(gl.expand_dims(tok, 1 - TOKEN_AXIS) < gl.expand_dims(key_limit, TOKEN_AXIS), sc,
                      float("-inf"))
    return sc


@gluon.jit
def exp_step(sc, m_i, m_new, sm_scale_log2, P_LOG2: gl.constexpr, TOKEN_AXIS: gl.constexpr):
    """(p, alpha) of an online softmax step, given the rows' new max m_new (TOKEN_AXIS: sc's token axis): p in
    units of 2^-P_LOG2. Scores and m stay unscaled (softmax_scale > 0, checked by the API): the scale goes into
    the exp2's FFMA, and so does P's unit (for FP8 P, 1 / 448: p up to 448 fills e4m3's range without a multiply
    per element). Base 2; a row that has seen no key yet keeps m = -inf and p = 0."""
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc * sm_scale_log2 - gl.expand_dims(m_safe * sm_scale_log2 - P_LOG2, TOKEN_AXIS))
    alpha = gl.exp2((m_i - m_safe) * sm_scale_log2)
    return p, alpha


@gluon.jit
def softmax_step(sc, blk, key_limit, min_key_limit, m_i, sm_scale_log2, P_LOG2: gl.constexpr):
    """One step of online softmax over scores sc [rows, n tokens] of the keys [n blk, n (blk + 1)) (a page, or a
    part of pages): (p, alpha, new m), p in units of 2^-P_LOG2 (exp_step); the row sums are the caller's
    (online_softmax)."""
    sc = mask_keys(sc, blk, key_limit, min_key_limit, 1)
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    p, alpha = exp_step(sc, m_i, m_new, sm_scale_log2, P_LOG2, 1)
    return p, alpha, m_new


@gluon.jit
def online_softmax(sc, blk, key_limit, min_key_limit, m_i, l_i, sm_scale_log2, P_LOG2: gl.constexpr):
    """softmax_step and the rows' sums: (p, alpha, new m, new l), l in P's units."""
    p, alpha, m_new = softmax_step(sc, blk, key_limit, min_key_limit, m_i, sm_scale_log2, P_LOG2)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def key_limits(seqlen, s_idx, S_Q, CAUSAL: gl.constexpr):
    """(each query row's key limit, the smallest of them): causal query token s (s_idx) sees keys
    [0, seqlen - (S_Q - 1 - s)), bottom-right aligned; without CAUSAL every row sees [0, seqlen)."""
    if CAUSAL:
        key_limit = gl.minimum(seqlen - (S_Q - 1 - s_idx), seqlen)
        min_key_limit = seqlen - (S_Q - 1)
    else:
        key_limit = gl.zeros_like(s_idx) + seqlen
        min_key_limit = seqlen
    return key_limit, min_key_limit


@gluon.jit
def softmax_epilogue(o_scale, m_i, l_i, rows, req, begin_req, R, H, S_Q, sm_scale_log2, meta_ptr, num_splits_ptr,
                     lse_ptr, lse_part_ptr, norm_smem, epi_ready, epi_free, n_req, P_LOG2: gl.constexpr):
    """The softmax warpgroup's end of a request: o_scale / l per row to the PV warpgroups (request n_req's
    handoff; pv_epilogue takes it), and the lse to the output's lse (a request with one split) or to its partial
    slot. l is in P's units, 2^-P_LOG2 (online_softmax)."""
    seen = l_i > 0
    mbarrier.wait(epi_free, (n_req & 1) ^ 1)
    norm_smem.store(gl.where(seen, o_scale / l_i, 0.0))
    mbarrier.arrive(epi_ready)
    direct, split = split_slot(meta_ptr, num_splits_ptr, req, begin_req)
    lse = gl.where(seen, (m_i * sm_scale_log2 + gl.log2(l_i) - P_LOG2) * LN2, float("inf"))
    row_ok = rows < R
    if direct:
        gl.store(lse_ptr + req * R + (rows % H) * S_Q + rows // H, lse, mask=row_ok)
    else:
        gl.store(lse_part_ptr + split.to(gl.int64) * R + rows, gl.where(seen, lse, float("-inf")), mask=row_ok)


@gluon.jit
def pv_epilogue(o, req, begin_req, R, meta_ptr, num_splits_ptr, out_ptr, o_part_ptr, norm_smem, epi_ready, epi_free,
                n_req, WG: gl.constexpr, VT_ORDER: gl.constexpr):
    """A PV warpgroup's end of a request: its [64, 256] O times the softmax warpgroup's norm, to out (a request
    with one split) or to its partial slot (see _store_o)."""
    mbarrier.wait(epi_ready, n_req & 1)
    norm = norm_smem.load(gl.SliceLayout(1, O_GROUP))   # O's rows, held as the accumulator holds them
    mbarrier.arrive(epi_free)
    direct, split = split_slot(meta_ptr, num_splits_ptr, req, begin_req)
    rows = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, O_GROUP))
    _store_o(out_ptr + (req * R + rows).to(gl.int64) * D_LATENT + WG * HALF,
             o_part_ptr + (split.to(gl.int64) * R + rows) * D_LATENT + WG * HALF, direct, o, norm, rows < R, VT_ORDER)


@gluon.jit
def _store_o(out_row, part_row, direct, o, norm, ok, VT_ORDER: gl.constexpr):
    """This warpgroup's [64, 256] O times norm (per row): to out (bf16) if direct, else to its partial slot (bf16
    for the FP8 formats, fp32 for bf16: the store casts), at X_row[row] + dim. One 32-column group a (column
    32a + n) at a time, so few registers are in flight.
    VT_ORDER: O's columns are in V^T's permuted dim order (see _store_group)."""
    x = gl.permute(gl.reshape(o, [BLOCK_M, 2, 2, 2, 32]), (0, 4, 3, 2, 1))   # [row, n, a bit 0, bit 1, bit 2]
    x0, x1 = gl.split(x)
    x00, x01 = gl.split(x0)
    x10, x11 = gl.split(x1)
    g0, g1 = gl.split(x00)
    g2, g3 = gl.split(x01)
    g4, g5 = gl.split(x10)
    g6, g7 = gl.split(x11)
    _store_group(out_row, part_row, direct, g0, 0, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g1, 32, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g2, 64, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g3, 96, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g4, 128, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g5, 160, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g6, 192, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g7, 224, norm, ok, VT_ORDER)


@gluon.jit
def _store_group(out_row, part_row, direct, g, col0: gl.constexpr, norm, ok, VT_ORDER: gl.constexpr):
    """One 32-column group. With VT_ORDER its accumulator column 8b + 2q + e holds V dim 8q + 4e + b (V^T's row
    order), so a register relabel puts each thread's 8 dims in order for 16-byte stores; without, column n is dim
    n and each thread stores pairs of dims. Row vectors come in SliceLayout(1, O_GROUP), which holds O's rows as
    the accumulator does (converting them moves nothing)."""
    if VT_ORDER:
        g = gl.reshape(gl.permute(gl.reshape(g, [BLOCK_M, 4, 4, 2]), (0, 2, 3, 1)), [BLOCK_M, 32])
        g = gl.convert_layout(g, O_GROUP, assert_trivial=True)
    layout: gl.constexpr = g.type.layout
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    g = g * gl.convert_layout(norm, row_l, assert_trivial=True)[:, None]
    ok = gl.convert_layout(ok, row_l, assert_trivial=True)[:, None]
    cols = (col0 + gl.arange(0, 32, gl.SliceLayout(0, layout)))[None, :]
    if direct:
        gl.store(gl.convert_layout(out_row, row_l, assert_trivial=True)[:, None] + cols, g.to(gl.bfloat16), mask=ok)
    else:
        gl.store(gl.convert_layout(part_row, row_l, assert_trivial=True)[:, None] + cols, g, mask=ok)
