"""The 64-row Hopper kernel for the FP8 cache formats: one CTA works through one part of the split-KV schedule for
64 query rows, with three warp-specialised warpgroups (12 warps, 65536 / 384 = 168 registers a thread on
average; a PV warpgroup's 64 x 256 fp32 accumulator alone takes 128, and its one m64n256 wgmma needs the launch's
cap to be >= 154), and for a sparse call a fourth that issues the gathers (the cap then 128: each P.V is two
m64n128 wgmmas; docs/design.md):

  softmax WG   issues the TMA loads of each page into the STAGES-slot ring (ring.py; a sparse call's gather
               warpgroup fills the gather ring instead); per page:
               S = q_lat.k_lat^T (FP8 wgmma) scaled + q_rope.k_rope^T (fp8_rope_bf16: BF16 wgmma, its own
               accumulator; fp8: the same FP8 accumulation), then the online softmax of the page before, whose
               Q.K^T it overlaps; hands P (e4m3) and the row rescale factor to the PV warpgroups (softmax.py).
  2 PV WGs     each owns 256 of the 512 output columns: transposes its half of each page into V^T (transpose.py),
               one page ahead of the P.V wgmma, so a ring slot is released early; then O = O * alpha + P.V^T, and
               at a request's end O times the O scale to out or to the partial slot (epilogue.py).

A bf16 q is quantized here with a scale per row (for fp8_rope_bf16 its latent part, RoPE kept bf16; for the fp8
cache, whose RoPE keys are e4m3, the whole row), at each request's start, by the PV warpgroups, half the rows each,
while the softmax warpgroup waits: every CTA of a split request repeats it, which costs less than a launch that
quantizes q first (docs/design.md); an e4m3 q comes with one scale. With the fp8 cache the latent q is then held
in registers as the Q.K^T wgmma's A operand. The handshakes are handshakes.py's.

A sparse call's fp8_ds_mla reading (a descale per token and 128-dim latent group): the latent Q.K^T is four
wgmmas, one a group, in two chains of two (groups 0-1, 2-3), each accumulator rescaled between its groups from one
group's descales to the next's, then the two summed in the second's unit (_grouped_scores); the V transposes fold
each group's descales into V (transpose.py), so P is one tile, as with fp8_rope_bf16 (each token in its largest
descale). A bf16 q goes in as two e4m3 parts, q = (hi + lo) * its row's descale (operands.load_q's q_lo), whose
32 KB take a P buffer's place: P is single-buffered here.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from ..constants import (D_LATENT, FP8, FP8_DS_MLA, FP8_ROPE_BF16, GROUP, LOG2_FP8_MAX, METADATA_WIDTH,
                         PAGE_SIZE)
from .ablations import SKIP_REFILLS, SKIP_RESCALE
from .epilogue import pieces_wait, pv_epilogue
from .handshakes import Handoff, init_barriers
from .layouts import (BLOCK_M, HALF, LAT_SMEM, LEFT, O_ACC, PV_REGS, RIGHT, ROPE_PV_REGS, S_BF16, S_FP8, SCALE_COLS,
                      STAGES, VEC_SMEM, dim_bit as _d, token_bit as _t)
from .operands import Q_AS_IS, Q_QUANTIZE, allocate_operands, load_q, q_base, quantize_half
from .ring import (GATHER_WARPS, Ring, fill_ring, load_cursor_start, load_cursor_step, open_part, part_start,
                   planned_for, request_range, topk_length_bad)
from .softmax import (ROW_LANES, key_limits, o_scale, score_scale_log2, softmax_epilogue, softmax_page,
                      token_scales)
from .transpose import GROUP_ROWS, RESCALE, TOP, UNIT, transpose_next

# fp8's latent q as the Q.K^T wgmma's register operand (64 registers a thread, read from shared memory once a
# request): the page's wgmmas then read only K there (fp8_rope_bf16's softmax warpgroup has no registers to spare)
Q_REGS = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_FP8, k_width=4))
# A page's [64 tokens, SCALE_COLS] scale tile, each token held by the threads that hold its score column in S_FP8
# (wgmma accumulator: token bit 0 and bits 3-5 in registers, bits 1-2 in lanes 0-1), so the [64] scale vector
# needs no layout conversion; the scale's padding columns sit in registers and are never read.
SCALE_LOAD = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_d(0), _d(1), _t(0), _t(3), _t(4), _t(5)],
                                                     lane_bases=[_t(1), _t(2), [0, 0], [0, 0], [0, 0]],
                                                     warp_bases=[[0, 0], [0, 0]], block_bases=[],
                                                     shape=[64, SCALE_COLS.value]))
# A sparse call's fourth warpgroup issues the gathers (small.py's load warps): four warpgroups share 512 registers a
# thread, and each P.V wgmma's operands must fit the launch's cap of 128, so a PV warpgroup's O is two [64, 128]
# accumulators (docs/design.md)
GATHER_PV_REGS = gl.constexpr(160)
GATHER_ISSUER_REGS = gl.constexpr(32)
# fp8_ds_mla's reading (group scales on both products) takes 8 of the issuer's registers a PV thread
DS_PV_REGS = gl.constexpr(168)
DS_ISSUER_REGS = gl.constexpr(24)
O_HALF = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))
# The rows' running sums of P per lane [64 rows, ROW_LANES]: the lanes that hold a row in S_FP8 (token bits 1-2)
# each sum the 16 tokens they hold; their sums meet once, at the request's end, instead of by shuffles every page
# (which wait behind the PV warps' shared-memory traffic).
L_LANES = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_t(3)], lane_bases=[_d(0), _d(1), _t(0), _t(1), _t(2)],
                                                  warp_bases=[_t(4), _t(5)], block_bases=[],
                                                  shape=[64, ROW_LANES.value]))


# the fp8_ds_mla reading's group factors, a PV warpgroup's: [2 pages x 2 groups x 2 halves, 16 token quads] fp16
# pairs; and its group table [2 pages x GROUP_ROWS, 64 tokens] fp32 (transpose._group_factors)
FAC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))


@gluon.jit
def _group_product(q_lat, q_lo, k_lat, acc, g: gl.constexpr, USE_ACC: gl.constexpr, Q_LO: gl.constexpr):
    """acc (+)= q_lat.k_lat^T (+ q_lo.k_lat^T) over latent group g's dims, issued (async)."""
    k = k_lat.slice(g * GROUP, GROUP, dim=1).permute((1, 0))
    acc = warpgroup_mma(q_lat.slice(g * GROUP, GROUP, dim=1), k, acc, use_acc=USE_ACC, is_async=True)
    if Q_LO:
        acc = warpgroup_mma(q_lo.slice(g * GROUP, GROUP, dim=1), k, acc, is_async=True)
    return acc


@gluon.jit
def _grouped_scores(acc, acc_rope, table, pb, q_lat, q_lo, k_lat, q_rope, k_rope, Q_LO: gl.constexpr):
    """fp8_ds_mla's latent Q.K^T, once group 0's product is in acc (issued with the RoPE product): two chains of
    two groups, each accumulator rescaled from its first group's token descales to its second's before that
    group's product goes in; group 2's product is issued with group 1's, not before the softmax, whose registers
    the second accumulator would take; the first chain's sum is rescaled into the second's unit while group 3's
    runs (the group table's RESCALE rows, which the left PV warpgroup fills, transpose._group_factors); returns
    (the latent product in the table's UNIT, the RoPE product)."""
    col_l: gl.constexpr = gl.SliceLayout(0, S_FP8)
    row = GROUP_ROWS * pb + RESCALE
    acc, acc_rope = warpgroup_mma_wait(0, deps=[acc, acc_rope, q_lat, q_lo, q_rope, k_lat, k_rope])[:2]
    acc = _group_product(q_lat, q_lo, k_lat, acc * table.index(row).load(col_l)[None, :], 1, True, Q_LO)
    acc_b = _group_product(q_lat, q_lo, k_lat, gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8), 2, False, Q_LO)
    acc, acc_b = warpgroup_mma_wait(0, deps=[acc, acc_b, q_lat, q_lo, k_lat])[:2]
    acc_b = _group_product(q_lat, q_lo, k_lat, acc_b * table.index(row + 1).load(col_l)[None, :], 3, True, Q_LO)
    acc = acc * table.index(row + 2).load(col_l)[None, :]
    acc_b = warpgroup_mma_wait(0, deps=[acc_b, q_lat, q_lo, k_lat])[0]
    return acc + acc_b, acc_rope


@gluon.jit
def _softmax_wg(query, shape, sched, table, lse_outs, descs, sparse, scales, q_smem, ring, hand, groups,
                KV_FORMAT: gl.constexpr, Q_SOURCE: gl.constexpr, CAUSAL: gl.constexpr, ABLATE: gl.constexpr,
                GATHER: gl.constexpr, HAS_TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr):
    """query: (q_ptr, its strides of b, s, h); shape: (h_q, s_q, s_q * h_q); table: (block_table_ptr, its row
    stride, the cache's pages); scales: (descale_q_ptr, descale_k_ptr, softmax_scale * log2 e); q_smem: (q_lat,
    q_rope, the rows' descales and q_ready where the PV warpgroups quantize q, q_lo where Q_LO). A sparse call
    (GATHER): the gather warpgroup fills the ring, and a page's tokens whose index is -1 (or past the request's
    topk_length), which the ring zero-fills, are masked by their descale 0 (fp8mla's writer gives a row of zeros
    descale 1). groups: (the group table, its ready barriers) of the fp8_ds_mla reading (transpose._group_factors)."""
    q_ptr, stride_qb, stride_qs, stride_qh = query
    H, S_Q, R = shape
    descale_q_ptr, descale_k_ptr, sm_scale_log2 = scales
    q_lat, q_rope, q_descale, q_ready, q_lo = q_smem
    Q_FP8: gl.constexpr = Q_SOURCE == Q_AS_IS
    GROUPED: gl.constexpr = KV_FORMAT == FP8_DS_MLA
    Q_LO: gl.constexpr = GROUPED and not Q_FP8
    P_FORMAT: gl.constexpr = FP8_ROPE_BF16 if GROUPED else KV_FORMAT   # (fp8_ds_mla's P: fp8_rope_bf16's)
    row_l: gl.constexpr = gl.SliceLayout(1, S_FP8)
    col_l: gl.constexpr = gl.SliceLayout(0, S_FP8)
    rows = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, row_l)
    s_idx = rows // H
    sm_scale_log2 = score_scale_log2(sm_scale_log2, descale_q_ptr, descale_k_ptr, KV_FORMAT, Q_FP8)
    part = open_part(sched)
    begin_req = part[3]
    if not GATHER:   # (a sparse call's gather warpgroup fills the ring)
        # the TMA cursor runs STAGES pages ahead of the consumer, across request boundaries; a loop with a run-time
        # condition, so it is not unrolled: this once-per-CTA code runs from a cold instruction cache, once per copy
        load = load_cursor_start(part, table)
        loaded = 0
        while (loaded < STAGES) & load[0][2]:
            ring.load(descs, table, load[1], loaded, KV_FORMAT)
            load = load_cursor_step(part, table, load[0])
            loaded += 1
    it = 0       # pages consumed (ring position)
    n_req = 0    # requests finished (epilogue barrier phase)
    for req in tl.range(begin_req, part[4] + 1, disable_licm=True):  # nothing hoisted: fewer spilled values
        seqlen, lo, hi = request_range(part, req)
        if lo < hi:
            if Q_SOURCE == Q_QUANTIZE:   # by the PV warpgroups, half the rows each
                mbarrier.wait(q_ready, n_req & 1)
                q_scale = q_descale.load(row_l)
            else:
                q_scale = gl.convert_layout(
                    load_q((q_base(query, req, sparse, GATHER), stride_qs, stride_qh, H, R), q_lat, q_rope, Q_SOURCE),
                    row_l)
            if KV_FORMAT == FP8:  # (q_ready, or Triton's barrier after load_q's cp.async wait: every row is in)
                q_a = q_lat.load(Q_REGS)
            else:
                q_a = q_lat
            limits = key_limits(seqlen, s_idx, S_Q, CAUSAL)
            bad = not planned_for(part, req, seqlen)   # or, below, a page outside the cache
            if HAS_TOPK_LENGTH:
                bad |= topk_length_bad(sparse, req, seqlen)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
            l_lanes = gl.zeros([BLOCK_M, ROW_LANES], gl.float32, L_LANES)
            v_unit = gl.to_tensor(1.0)  # the V scale O is expressed in (page-local for fp8_rope_bf16)
            state = (m_i, l_lanes, v_unit)
            # the page before's scores, token scales and their largest (fp8: hand_p keeps one unit throughout)
            prev = (gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8), gl.full([PAGE_SIZE], 1.0, gl.float32, col_l),
                    1.0)
            for blk in range(lo, hi):
                # ---- S = q_lat.k_lat^T * scales + q_rope.k_rope^T for this page ... ----
                s = it % STAGES
                ring.wait(it, GATHER)
                if GROUPED:   # latent group 0 now, the others after the softmax (_grouped_scores)
                    acc = _group_product(q_lat, q_lo, ring.lat.index(s), gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32,
                                                                                  S_FP8), 0, False, Q_LO)
                else:
                    acc = warpgroup_mma(q_a, ring.lat.index(s).permute((1, 0)),
                                        gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8), use_acc=False,
                                        is_async=True)
                if KV_FORMAT == FP8:  # e4m3 q and cache throughout: one FP8 accumulation, scaled afterwards
                    acc = warpgroup_mma(q_rope, ring.rope.index(s).permute((1, 0)), acc, is_async=True)
                else:  # BF16 RoPE product in its own accumulator, so both products run during the softmax
                    acc_rope = warpgroup_mma(q_rope, ring.rope.index(s).permute((1, 0)),
                                             gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_BF16), use_acc=False,
                                             is_async=True)
                # ---- ... while the previous page's softmax runs ----
                if blk > lo:
                    state = softmax_page(prev, blk - 1, limits, state, it - 1, sm_scale_log2, hand, LOG2_FP8_MAX,
                                         L_LANES, P_FORMAT, ABLATE)
                if GROUPED:   # the left PV warpgroup's table of the page (P takes each token's largest descale)
                    group_table, table_ready = groups
                    mbarrier.wait(table_ready.index(it % 2), (it // 2) & 1)
                    k_scale = group_table.index(GROUP_ROWS * (it % 2) + TOP).load(col_l)
                else:
                    k_scale = token_scales(ring.scale.index(s), blk, seqlen, SCALE_LOAD, col_l, KV_FORMAT)
                if KV_FORMAT >= FP8_ROPE_BF16:  # the scales' max here, while the wgmma runs, not in the softmax
                    k_max = gl.max(k_scale, axis=0)
                else:
                    k_max = 1.0
                if GROUPED:
                    acc, acc_rope = _grouped_scores(acc, acc_rope, group_table, it % 2, q_lat, q_lo,
                                                    ring.lat.index(s), q_rope, ring.rope.index(s), Q_LO)
                    unit = group_table.index(GROUP_ROWS * (it % 2) + UNIT).load(col_l)
                    acc = acc * q_scale[:, None] * unit[None, :] + gl.convert_layout(acc_rope, S_FP8,
                                                                                    assert_trivial=True)
                elif KV_FORMAT == FP8:
                    acc = warpgroup_mma_wait(0, deps=[acc, q_rope, ring.lat.index(s), ring.rope.index(s)])[0]
                    if not Q_FP8:   # a scale per query row (an e4m3 q's is per tensor, in sm_scale_log2)
                        acc = acc * q_scale[:, None]
                else:
                    acc, acc_rope = warpgroup_mma_wait(0, deps=[acc, acc_rope, q_lat, q_rope, ring.lat.index(s),
                                                                ring.rope.index(s)])[:2]
                    acc = acc * q_scale[:, None] * k_scale[None, :] + gl.convert_layout(acc_rope, S_FP8,
                                                                                        assert_trivial=True)
                if GATHER:   # a token not gathered (-1, past topk_length) has its descale zero-filled
                    acc = gl.where((k_scale > 0)[None, :], acc, float("-inf"))
                bad |= ring.page_outside(it)
                ring.release(it)
                prev = (acc, k_scale, k_max)
                it += 1
                if not GATHER:
                    if load[0][2]:  # refill this page's slot once the PV warpgroups have transposed it
                        if ABLATE & SKIP_REFILLS:
                            ring.fake_load(loaded)
                        else:
                            ring.load(descs, table, load[1], loaded, KV_FORMAT)
                        load = load_cursor_step(part, table, load[0])
                        loaded += 1
            m_i, l_lanes, v_unit = softmax_page(prev, hi - 1, limits, state, it - 1, sm_scale_log2, hand,
                                                LOG2_FP8_MAX, L_LANES, P_FORMAT, ABLATE)

            # ---- a request's end: its O scale to the PV warpgroups; lse ----
            l_i = gl.convert_layout(gl.sum(l_lanes, axis=1), row_l, assert_trivial=True)
            softmax_epilogue(o_scale(v_unit, descale_k_ptr, KV_FORMAT), m_i, l_i, rows, req, begin_req, bad, shape,
                             sm_scale_log2, sched, lse_outs, hand, n_req, LOG2_FP8_MAX, sparse, GATHER, HAS_SINK)
            n_req += 1


@gluon.jit
def _o_init(GATHER: gl.constexpr):
    """A PV warpgroup's O [64, 256], as pieces: one accumulator, or (GATHER: four warpgroups) two of [64, 128]."""
    if GATHER:
        return (warpgroup_mma_init(gl.zeros([BLOCK_M, HALF // 2], gl.float32, O_HALF)),
                warpgroup_mma_init(gl.zeros([BLOCK_M, HALF // 2], gl.float32, O_HALF)))
    else:
        return (warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, O_ACC)), )


@gluon.jit
def _pv_mma(o, alpha, p, v, ABLATE: gl.constexpr):
    """O = O * alpha + P.V for O's pieces (each its columns of V), issued (async)."""
    if len(o) == 1:
        a = o[0]
        if not ABLATE & SKIP_RESCALE:
            a = a * alpha[:, None]
        return (warpgroup_mma(p, v, a, is_async=True), )
    else:
        a = o[0]
        b = o[1]
        if not ABLATE & SKIP_RESCALE:
            a = a * alpha[:, None]
            b = b * alpha[:, None]
        return (warpgroup_mma(p, v.slice(0, HALF // 2, dim=1), a, is_async=True),
                warpgroup_mma(p, v.slice(HALF // 2, HALF // 2, dim=1), b, is_async=True))


@gluon.jit
def _pv_wg(query, shape, sched, outs, sparse, q_smem, ring, vt, hand, fac, WG: gl.constexpr, Q_SOURCE: gl.constexpr,
           ABLATE: gl.constexpr, GATHER: gl.constexpr, GROUPED: gl.constexpr):
    """O[:, 256 WG : 256 (WG + 1)] for every page of the part. The transposes run one page ahead of the P.V wgmma
    (across request boundaries), so a ring slot is released without waiting for the softmax of the page before
    it. A bf16 q (Q_QUANTIZE) is quantized here at each request's start, half the rows each, while the softmax
    warpgroup waits for it: the P.V wgmma waits for the softmax's first P anyway. outs: (out_ptr, o_part_ptr);
    query, shape, q_smem: as _softmax_wg has them; fac: (GROUPED, fp8_ds_mla) transpose._group_factors' groups
    (transpose.py)."""
    q_ptr, stride_qb, stride_qs, stride_qh = query
    H, S_Q, R = shape
    q_lat, q_rope, q_descale, q_ready, q_lo = q_smem
    BUFS: gl.constexpr = hand.p_ready.shape[0]
    if not GROUPED:   # (Triton 3.6 takes no None into a partition)
        fac = None
        q_lo = None   # (q in one part)
    part = open_part(sched)
    begin_req = part[3]
    t_cursor = part_start(part)
    if Q_SOURCE != Q_QUANTIZE:   # (else after the first request's q, which the softmax warpgroup waits for)
        t_cursor = transpose_next(ring, vt, 0, part, t_cursor, WG, ABLATE, fac)
    it = 0
    n_req = 0
    for req in tl.range(begin_req, part[4] + 1, disable_licm=True):  # nothing hoisted: fewer spilled values
        seqlen, lo, hi = request_range(part, req)
        if lo < hi:
            if Q_SOURCE == Q_QUANTIZE:
                quantize_half((q_base(query, req, sparse, GATHER), stride_qs, stride_qh, H, R), q_lat, q_rope,
                              q_descale, WG, q_lo)
                mbarrier.arrive(q_ready)
                if it == 0:   # the part's first page
                    t_cursor = transpose_next(ring, vt, 0, part, t_cursor, WG, ABLATE, fac)
            o = _o_init(GATHER)
            # nothing hoisted: what a page needs is recomputed, not held through the loop (at ROPE_PV_REGS, ptxas
            # kept a held address in local memory)
            for blk in tl.range(lo, hi, disable_licm=True):
                pb = it % 2
                o = pieces_wait(o)   # the previous page's P.V: its P and V^T buffers are free
                if blk > lo:
                    hand.free_p(BUFS - 1 - it % BUFS)
                # the next page's V^T, into the buffer that P.V just released
                t_cursor = transpose_next(ring, vt, it + 1, part, t_cursor, WG, ABLATE, fac)
                alpha = hand.wait_p(it, gl.SliceLayout(1, o[0].type.layout))
                o = _pv_mma(o, alpha, hand.p.index(it % BUFS), vt.index(2 * WG + pb).permute((1, 0)), ABLATE)
                it += 1
            o = pieces_wait(o)
            hand.free_p((it - 1) % BUFS)
            pv_epilogue(o, req, begin_req, R, sched, outs, hand, n_req, WG, True)
            n_req += 1


@gluon.jit
def mla_decode_hopper_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, scale_desc,
        block_table_ptr, stride_bt, max_pages, num_pages, seqlens_ptr, meta_ptr, num_splits_ptr, B, SLOTS,
        out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, descale_q_ptr, descale_k_ptr, sm_scale_log2, H, S_Q, R,
        kv_ptr, Q_GROUP, topk_length_ptr, sink_ptr,
        KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr, GATHER: gl.constexpr,
        HAS_TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, ABLATE: gl.constexpr):
    """R = H * S_Q, the query rows per request, comes as a parameter: computed in the partitions, LLVM made it
    one value before warp_specialize's branch, which ptxas kept in local memory. A sparse call (GATHER): its
    requests are query tokens, Q_GROUP (s_q) a batch entry, S_Q 1; block_table is its indices, kv_ptr the cache
    whose rows the gather ring reads; topk_length_ptr and sink_ptr are read where HAS_TOPK_LENGTH / HAS_SINK."""
    meta = meta_ptr + gl.program_id(0) * METADATA_WIDTH
    GROUPED: gl.constexpr = KV_FORMAT == FP8_DS_MLA   # (P: one tile, as fp8_rope_bf16's, one buffer)
    P_BUFS: gl.constexpr = 1 if GROUPED else 2
    q_lat, q_rope, k_lat, k_rope, k_scale, vt, p_smem, alpha_smem, norm_smem = allocate_operands(
        BLOCK_M, STAGES, rope_desc, FP8_ROPE_BF16 if GROUPED else KV_FORMAT, P_BUFS)
    kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free, bad = init_barriers(
        STAGES, GATHER_WARPS if GATHER else 0, P_BUFS)   # (the gather warpgroup issues them)
    if GROUPED and not Q_FP8:
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, D_LATENT], LAT_SMEM)
    else:
        q_lo = q_lat
    if GROUPED:   # (the PV warpgroups' group factors, the softmax's group table: transpose._group_factors)
        fac_left = gl.allocate_shared_memory(gl.int32, [4 * (HALF // GROUP), PAGE_SIZE // 4], FAC_SMEM)
        fac_right = gl.allocate_shared_memory(gl.int32, [4 * (HALF // GROUP), PAGE_SIZE // 4], FAC_SMEM)
        group_table = gl.allocate_shared_memory(gl.float32, [2 * GROUP_ROWS, PAGE_SIZE], FAC_SMEM)
        table_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(table_ready.index(i), count=1)   # the left PV warpgroup
    else:   # (not used)
        fac_left = alpha_smem
        fac_right = alpha_smem
        group_table = alpha_smem
        table_ready = p_ready
    ring = Ring(k_lat, k_rope, k_scale, kv_ready, kv_empty, bad)
    hand = Handoff(p_smem, alpha_smem, norm_smem, p_ready, p_free, epi_ready, epi_free)
    sched = (meta, seqlens_ptr, max_pages, num_splits_ptr, B, SLOTS)
    Q_SOURCE: gl.constexpr = Q_AS_IS if Q_FP8 else Q_QUANTIZE
    if Q_SOURCE == Q_QUANTIZE:   # the PV warpgroups' quantized q: its rows' descales, and q_ready (handshakes.py)
        q_descale = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC_SMEM)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=2)
    else:   # (not used)
        q_descale = norm_smem
        q_ready = epi_ready
    query = (q_ptr, stride_qb, stride_qs, stride_qh)
    q_smem = (q_lat, q_rope, q_descale, q_ready, q_lo)
    sparse = (Q_GROUP, topk_length_ptr, sink_ptr)
    table = (block_table_ptr, stride_bt, num_pages)
    descs = (lat_desc, rope_desc, scale_desc)
    if GATHER:   # (Gluon takes constexprs into a partition only as written in its argument list)
        gl.warp_specialize([
            (_softmax_wg, (query, (H, S_Q, R), sched, table, (lse_ptr, lse_part_ptr), descs, sparse,
                           (descale_q_ptr, descale_k_ptr, sm_scale_log2), q_smem, ring, hand,
                           (group_table, table_ready), KV_FORMAT, Q_SOURCE, CAUSAL, ABLATE, GATHER, HAS_TOPK_LENGTH,
                           HAS_SINK)),
            (_pv_wg, (query, (H, S_Q, R), sched, (out_ptr, o_part_ptr), sparse, q_smem, ring, vt, hand,
                      (fac_left, group_table, table_ready), LEFT, Q_SOURCE, ABLATE, GATHER, GROUPED)),
            (_pv_wg, (query, (H, S_Q, R), sched, (out_ptr, o_part_ptr), sparse, q_smem, ring, vt, hand,
                      (fac_right, group_table, table_ready), RIGHT, Q_SOURCE, ABLATE, GATHER, GROUPED)),
            (fill_ring, (sched, table, descs, (kv_ptr, num_pages * PAGE_SIZE), sparse, ring, KV_FORMAT, GATHER,
                        HAS_TOPK_LENGTH)),
        ], [4, 4, GATHER_WARPS], [DS_PV_REGS, DS_PV_REGS, DS_ISSUER_REGS] if KV_FORMAT == FP8_DS_MLA else
           [GATHER_PV_REGS, GATHER_PV_REGS, GATHER_ISSUER_REGS])
    else:
        gl.warp_specialize([
            (_softmax_wg, (query, (H, S_Q, R), sched, table, (lse_ptr, lse_part_ptr), descs, sparse,
                           (descale_q_ptr, descale_k_ptr, sm_scale_log2), q_smem, ring, hand,
                           (group_table, table_ready), KV_FORMAT, Q_SOURCE, CAUSAL, ABLATE, GATHER, HAS_TOPK_LENGTH,
                           HAS_SINK)),
            (_pv_wg, (query, (H, S_Q, R), sched, (out_ptr, o_part_ptr), sparse, q_smem, ring, vt, hand,
                      (fac_left, group_table, table_ready), LEFT, Q_SOURCE, ABLATE, GATHER, GROUPED)),
            (_pv_wg, (query, (H, S_Q, R), sched, (out_ptr, o_part_ptr), sparse, q_smem, ring, vt, hand,
                      (fac_right, group_table, table_ready), RIGHT, Q_SOURCE, ABLATE, GATHER, GROUPED)),
        ], [4, 4], [ROPE_PV_REGS if KV_FORMAT == FP8_ROPE_BF16 else PV_REGS] * 2)
