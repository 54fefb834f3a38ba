"""The Hopper kernel for few query rows (s_q * h_q <= 32) and the FP8 cache formats.

fp8.py runs a wgmma of 64 query rows whatever the call has: with 16 rows (s_q=1, h_q=16, the memory-bound case)
three quarters of its Q.K^T, P.V and softmax work is padding. Here the products are transposed so the rows are the
wgmma's N (16 or 32) and the 64 tokens of a page its M:

  S^T [64 tokens, ROWS] = K [64, 576] . Q^T       (K from the ring as the A operand, q from shared memory as B)
  O^T [512 dims, ROWS] += V^T [512, 64] . P^T      (V^T as transpose.py builds it, now the A operand)

Everything else is fp8.py's: the schedule, the softmax and two PV warpgroups and their handshakes, the ring (three
or four pages deep here, ring_pages: q takes 10-20 KB instead of 40), the V transposes; but the TMA loads come from
a load warp of their own, off the softmax warpgroup's chain (the 128-register cap of a fourth warpgroup is no
constraint with O^T at 32-64 registers). The softmax reduces over tokens, i.e. across the softmax warpgroup's four
warps: they meet once per page, for the row maxima (and fp8_rope_bf16's largest token scale); the row sums stay per
thread until the request's end. A bf16 q is quantized here, per row (load_q's Q_QUANTIZE).
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait

from ..constants import D_LATENT, FP8, FP8_DS_MLA, GROUP, LOG2_FP8_MAX, METADATA_WIDTH, PAGE_SIZE
from .epilogue import pieces_wait, pv_epilogue_t
from .handshakes import P_BUFFERS, Handoff, init_barriers
from .layouts import HALF, LAT_SMEM, LEFT, RIGHT, SCALE_COLS, VEC_SMEM, dim_bit as _d, token_bit as _t
from .operands import Q_AS_IS, Q_QUANTIZE, allocate_operands, load_q, q_base
from .ring import (GATHER_WARPS, Ring, fill_ring, open_part, part_start, planned_for, request_range,
                   topk_length_bad)
from .softmax import (key_limits, largest_scale, no_scales, o_scale, score_scale_log2, softmax_epilogue,
                      softmax_page_t, token_scales)
from .transpose import transpose_next

PV_REGS_SMALL = gl.constexpr(128)   # registers per thread: 65536 / 512 (the load warp is padded to a warpgroup)
LOAD_REGS = gl.constexpr(24)   # the load warp's (setmaxnreg's least)
# the gather ring's load warps hold 4 rows' addresses a thread (64 rows over 4 lanes x 4 warps down) and their
# indices, and the next page's; the softmax warpgroup gets 256 - this, which spills least at 64 (docs/design.md)
GATHER_LOAD_REGS = gl.constexpr(64)


@triton.constexpr_function
def scores_t_layout(rows, k=32):
    """S^T [64 tokens, rows]: the wgmma accumulator (k = 32: e4m3 operands; 16: bf16, the same registers)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, k])


RED_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))  # [4 warps, ROWS]
# A page's [64 tokens, SCALE_COLS] scale tile, each token held by the threads that hold its score row in S^T
# (wgmma accumulator: token bits 0-2 in lanes 2-4, bit 3 in a register, bits 4-5 in the warps), so the [64] scale
# vector needs no layout conversion; the padding columns sit in registers and are never read.
SCALE_LOAD_T = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_d(0), _d(1), _t(3)],
                                                       lane_bases=[[0, 0], [0, 0], _t(0), _t(1), _t(2)],
                                                       warp_bases=[_t(4), _t(5)], block_bases=[],
                                                       shape=[PAGE_SIZE, SCALE_COLS.value]))


def rows_per_cta(rows: int) -> int:
    """The kernel's N (ROWS) for a call with `rows` = s_q * h_q <= 32 query rows."""
    return 16 if rows <= 16 else 32


@triton.constexpr_function
def q_low_part(rows, kv_format, q_fp8, gather):
    """Whether a bf16 q goes in as two e4m3 parts, q = (hi + lo) * its row's descale (load_q's q_lo), both parts'
    products in the latent accumulators: in the sparse call's fp8_ds_mla reading, whose error is otherwise q's e4m3
    rounding (lo: 8 KB at 16 rows; 16 KB at 32, for a ring of two pages: ring_pages). (The fp8_rope_bf16 reading
    took 18% longer so, its one latent accumulator a chain of 32 wgmmas: docs/design.md.)"""
    return gather and not q_fp8 and kv_format == FP8_DS_MLA


@triton.constexpr_function
def ring_pages(rows, kv_format, q_lo):
    """KV pages in flight per CTA: 4 where they fit in shared memory (16 rows with the fp8 cache: 220 KB), else 3;
    2 at 32 rows with q's second part (16 KB)."""
    return 4 if rows == 16 and kv_format == FP8 else 2 if rows == 32 and q_lo else 3


@gluon.jit
def _issue_scores_t(ring, s, q_lat, q_rope, q_lo, KV_FORMAT: gl.constexpr, Q_LO: gl.constexpr):
    """Ring slot s's page's S^T products, issued (async): k_lat.q_lat^T (fp8_ds_mla: one a latent group, to scale
    by its tokens' scales, each with k_lat.q_lo^T in the same accumulator where Q_LO) and k_rope.q_rope^T (in the
    latent's accumulator with the fp8 cache, else its own BF16 one); a tuple of the accumulators, _scores_t's."""
    ROWS: gl.constexpr = q_lat.shape[0]
    ST: gl.constexpr = scores_t_layout(ROWS)
    ST_BF16: gl.constexpr = scores_t_layout(ROWS, 16)
    k_lat = ring.lat.index(s)
    if KV_FORMAT == FP8_DS_MLA:   # the first two groups' (_scores_t issues the others')
        lat = (_group_scores_t(k_lat, q_lat, q_lo, 0, Q_LO), _group_scores_t(k_lat, q_lat, q_lo, 1, Q_LO))
    else:
        lat = (warpgroup_mma(k_lat, q_lat.permute((1, 0)), gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST),
                             use_acc=False, is_async=True), )
    if KV_FORMAT == FP8:
        return (warpgroup_mma(ring.rope.index(s), q_rope.permute((1, 0)), lat[0], is_async=True), )
    else:
        return lat + (warpgroup_mma(ring.rope.index(s), q_rope.permute((1, 0)),
                                    gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST_BF16), use_acc=False, is_async=True), )


@gluon.jit
def _group_scores_t(k_lat, q_lat, q_lo, g: gl.constexpr, Q_LO: gl.constexpr):
    """k_lat.q_lat^T (+ k_lat.q_lo^T) over latent group g's dims, issued."""
    ROWS: gl.constexpr = q_lat.shape[0]
    ST: gl.constexpr = scores_t_layout(ROWS)
    k = k_lat.slice(g * GROUP, GROUP, dim=1)
    acc = warpgroup_mma(k, q_lat.slice(g * GROUP, GROUP, dim=1).permute((1, 0)),
                        gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST), use_acc=False, is_async=True)
    if Q_LO:
        acc = warpgroup_mma(k, q_lo.slice(g * GROUP, GROUP, dim=1).permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _scores_t(acc, ring, s, q_lat, q_rope, q_lo, k_scale, q_scale, KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr,
              Q_LO: gl.constexpr):
    """S^T of _issue_scores_t's products, once done: the latent products times their token scales and the rows'
    q scales, plus the RoPE product."""
    k_lat = ring.lat.index(s)
    k_rope = ring.rope.index(s)
    if KV_FORMAT == FP8:
        sc = warpgroup_mma_wait(0, deps=[acc[0], q_lat, q_rope, k_lat, k_rope])[0]
        if not Q_FP8:   # a scale per query row (an e4m3 q's is per tensor, in sm_scale_log2)
            sc = sc * q_scale[None, :]
    else:
        if KV_FORMAT == FP8_DS_MLA:   # two groups at a time: four accumulators live through the softmax spill
            a0, a1, rope = warpgroup_mma_wait(0, deps=[acc[0], acc[1], acc[2], q_lat, q_lo, q_rope, k_lat,
                                                       k_rope])[:3]
            sc = a0 * k_scale[0][:, None] + a1 * k_scale[1][:, None]
            a2 = _group_scores_t(k_lat, q_lat, q_lo, 2, Q_LO)
            a3 = _group_scores_t(k_lat, q_lat, q_lo, 3, Q_LO)
            a2, a3 = warpgroup_mma_wait(0, deps=[a2, a3, q_lat, q_lo, k_lat])[:2]
            sc = sc + a2 * k_scale[2][:, None] + a3 * k_scale[3][:, None]
        else:
            a0, rope = warpgroup_mma_wait(0, deps=[acc[0], acc[1], q_lat, q_lo, q_rope, k_lat, k_rope])[:2]
            sc = a0 * k_scale[:, None]
        sc = sc * q_scale[None, :] + gl.convert_layout(rope, a0.type.layout, assert_trivial=True)
    return sc


@gluon.jit
def _softmax_wg(query, shape, sched, lse_outs, scales, sparse, q_smem, ring, hand, red, red_scale,
                KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr, GATHER: gl.constexpr,
                HAS_TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr):
    """fp8.py's softmax warpgroup on S^T, without the loads (the load warp's); red, red_scale: the warps' meeting
    buffers of page_max_t. A sparse call (GATHER) as in fp8.py: a token not gathered has descale 0 and is masked."""
    q_ptr, stride_qb, stride_qs, stride_qh = query
    H, S_Q, R = shape
    descale_q_ptr, descale_k_ptr, sm_scale_log2 = scales
    q_lat, q_rope, q_lo = q_smem   # (q_lo: q_lat where the kernel has no Q_LO)
    ROWS: gl.constexpr = q_lat.shape[0]
    RING: gl.constexpr = ring.lat.shape[0]
    Q_LO: gl.constexpr = q_low_part(ROWS, KV_FORMAT, Q_FP8, GATHER)
    ST: gl.constexpr = scores_t_layout(ROWS)
    row_l: gl.constexpr = gl.SliceLayout(0, ST)   # query rows are S^T's columns
    tok_l: gl.constexpr = gl.SliceLayout(1, ST)
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, row_l)
    s_idx = rows // H
    sm_scale_log2 = score_scale_log2(sm_scale_log2, descale_q_ptr, descale_k_ptr, KV_FORMAT, Q_FP8)
    part = open_part(sched)
    begin_req = part[3]
    it = 0
    n_req = 0
    for req in tl.range(begin_req, part[4] + 1, disable_licm=True):
        seqlen, lo, hi = request_range(part, req)
        if lo < hi:
            q_scale = gl.convert_layout(
                load_q((q_base(query, req, sparse, GATHER), stride_qs, stride_qh, H, R), q_lat, q_rope,
                       Q_AS_IS if Q_FP8 else Q_QUANTIZE, q_lo if Q_LO else None), row_l)
            limits = key_limits(seqlen, s_idx, S_Q, CAUSAL)
            bad = not planned_for(part, req, seqlen)   # or, below, a page outside the cache
            if HAS_TOPK_LENGTH:
                bad |= topk_length_bad(sparse, req, seqlen)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
            l_acc = gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST)
            v_unit = gl.to_tensor(1.0)
            state = (m_i, l_acc, v_unit)
            prev = (gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST), no_scales(tok_l, KV_FORMAT))
            for blk in tl.range(lo, hi, disable_licm=True):
                # ---- S^T = k_lat.q_lat^T * scales + k_rope.q_rope^T for this page ... ----
                s = it % RING
                ring.wait(it, GATHER)
                acc = _issue_scores_t(ring, s, q_lat, q_rope, q_lo, KV_FORMAT, Q_LO)
                # ---- ... while the previous page's softmax runs ----
                if blk > lo:
                    state = softmax_page_t(prev, blk - 1, limits, state, it - 1, sm_scale_log2, hand, red, red_scale,
                                           LOG2_FP8_MAX, KV_FORMAT)
                k_scale = token_scales(ring.scale.index(s), blk, seqlen, SCALE_LOAD_T, tok_l, KV_FORMAT)
                acc = _scores_t(acc, ring, s, q_lat, q_rope, q_lo, k_scale, q_scale, KV_FORMAT, Q_FP8, Q_LO)
                if GATHER:   # a token not gathered (-1, past topk_length) has its descale zero-filled
                    acc = gl.where((largest_scale(k_scale, KV_FORMAT) > 0)[:, None], acc, float("-inf"))
                bad |= ring.page_outside(it)
                ring.release(it)
                prev = (acc, k_scale)
                it += 1
            m_i, l_acc, v_unit = softmax_page_t(prev, hi - 1, limits, state, it - 1, sm_scale_log2, hand, red,
                                                red_scale, LOG2_FP8_MAX, KV_FORMAT)
            l_i = gl.sum(l_acc, axis=0)

            # ---- a request's end: its O scale to the PV warpgroups; lse ----
            softmax_epilogue(o_scale(v_unit, descale_k_ptr, KV_FORMAT), m_i, l_i, rows, req, begin_req, bad, shape,
                             sm_scale_log2, sched, lse_outs, hand, n_req, LOG2_FP8_MAX, sparse, GATHER, HAS_SINK)
            n_req += 1


@gluon.jit
def _pv_wg(sched, outs, R, ring, vt, hand, WG: gl.constexpr):
    """O^T[256 WG : 256 (WG + 1), :] for every page of the part (fp8.py's _pv_wg, transposed); fp8_ds_mla's as two
    accumulators, one a latent group, each with its group's P."""
    ROWS: gl.constexpr = hand.p.shape[1]
    OT: gl.constexpr = scores_t_layout(ROWS)
    PIECES: gl.constexpr = 1 if hand.p.shape[0] == P_BUFFERS else HALF // GROUP
    part = open_part(sched)
    begin_req = part[3]
    t_cursor = transpose_next(ring, vt, 0, part, part_start(part), WG)
    it = 0
    n_req = 0
    # nothing hoisted out of the request loop: with 32 rows, under the 128 registers a PV warpgroup gets, a value
    # kept across all requests was spilled to local memory
    for req in tl.range(begin_req, part[4] + 1, disable_licm=True):
        seqlen, lo, hi = request_range(part, req)
        if lo < hi:
            o = _o_init(ROWS, PIECES)
            for blk in range(lo, hi):
                pb = it % 2
                o = pieces_wait(o)
                if blk > lo:
                    hand.free_p(1 - pb)
                t_cursor = transpose_next(ring, vt, it + 1, part, t_cursor, WG)
                alpha = hand.wait_p(it, gl.SliceLayout(0, OT))
                o = _pv_mma(o, alpha, vt.index(2 * WG + pb), hand.p, pb, WG)
                it += 1
            o = pieces_wait(o)
            hand.free_p((it - 1) % 2)
            pv_epilogue_t(o, req, begin_req, R, sched, outs, hand, n_req, WG)
            n_req += 1


@gluon.jit
def _o_init(ROWS: gl.constexpr, PIECES: gl.constexpr):
    """A PV warpgroup's O^T, zero: a tuple of PIECES accumulators, together its 256 dims."""
    OT: gl.constexpr = scores_t_layout(ROWS)
    if PIECES == 1:
        return (warpgroup_mma_init(gl.zeros([HALF, ROWS], gl.float32, OT)), )
    else:
        return (warpgroup_mma_init(gl.zeros([GROUP, ROWS], gl.float32, OT)),
                warpgroup_mma_init(gl.zeros([GROUP, ROWS], gl.float32, OT)))


@gluon.jit
def _pv_mma(o, alpha, vt_page, p, pb, WG: gl.constexpr):
    """O^T = O^T * alpha + V^T.P^T for this warpgroup's V^T of a page and P buffer pb, issued (async); fp8_ds_mla:
    each latent group's V^T rows (a transpose keeps its rows in their 128-dim group) with that group's P."""
    if len(o) == 1:
        return (warpgroup_mma(vt_page, p.index(pb).permute((1, 0)), o[0] * alpha[None, :], is_async=True), )
    else:
        G: gl.constexpr = p.shape[0] // P_BUFFERS
        return (warpgroup_mma(vt_page.slice(0, GROUP), p.index(pb * G + 2 * WG).permute((1, 0)),
                              o[0] * alpha[None, :], is_async=True),
                warpgroup_mma(vt_page.slice(GROUP, GROUP), p.index(pb * G + 2 * WG + 1).permute((1, 0)),
                              o[1] * alpha[None, :], is_async=True))


@gluon.jit
def mla_decode_hopper_small_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, scale_desc,
        block_table_ptr, stride_bt, max_pages, num_pages, seqlens_ptr, meta_ptr, num_splits_ptr, B, SLOTS,
        out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, descale_q_ptr, descale_k_ptr, sm_scale_log2, H, S_Q, R,
        kv_ptr, Q_GROUP, topk_length_ptr, sink_ptr,
        KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr, GATHER: gl.constexpr,
        HAS_TOPK_LENGTH: gl.constexpr, HAS_SINK: gl.constexpr, ROWS: gl.constexpr):
    """fp8.py's parameters, and ROWS; a sparse call (GATHER) as fp8.py's, its pages gathered by the load warp."""
    meta = meta_ptr + gl.program_id(0) * METADATA_WIDTH
    Q_LO: gl.constexpr = q_low_part(ROWS, KV_FORMAT, Q_FP8, GATHER)
    q_lat, q_rope, k_lat, k_rope, k_scale, vt, p_smem, alpha_smem, norm_smem = allocate_operands(
        ROWS, ring_pages(ROWS, KV_FORMAT, Q_LO), rope_desc, KV_FORMAT)
    if Q_LO:
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, D_LATENT], LAT_SMEM)
    else:
        q_lo = q_lat
    red = gl.allocate_shared_memory(gl.float32, [2, 4, ROWS], RED_SMEM)    # per page parity, warp: row maxima
    red_scale = gl.allocate_shared_memory(gl.float32, [2, 4], VEC_SMEM)    # ... and the largest token scale
    kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free, bad = init_barriers(
        k_lat.shape[0], GATHER_WARPS if GATHER else 0)   # (the load warps issue the gathers)
    ring = Ring(k_lat, k_rope, k_scale, kv_ready, kv_empty, bad)
    hand = Handoff(p_smem, alpha_smem, norm_smem, p_ready, p_free, epi_ready, epi_free)
    sched = (meta, seqlens_ptr, max_pages, num_splits_ptr, B, SLOTS)
    sparse = (Q_GROUP, topk_length_ptr, sink_ptr)
    gl.warp_specialize([
        (_softmax_wg, ((q_ptr, stride_qb, stride_qs, stride_qh), (H, S_Q, R), sched, (lse_ptr, lse_part_ptr),
                       (descale_q_ptr, descale_k_ptr, sm_scale_log2), sparse, (q_lat, q_rope, q_lo), ring, hand, red,
                       red_scale, KV_FORMAT, Q_FP8, CAUSAL, GATHER, HAS_TOPK_LENGTH, HAS_SINK)),
        (_pv_wg, (sched, (out_ptr, o_part_ptr), R, ring, vt, hand, LEFT)),
        (_pv_wg, (sched, (out_ptr, o_part_ptr), R, ring, vt, hand, RIGHT)),
        (fill_ring, (sched, (block_table_ptr, stride_bt, num_pages), (lat_desc, rope_desc, scale_desc),
                     (kv_ptr, num_pages * PAGE_SIZE), sparse, ring, KV_FORMAT, GATHER, HAS_TOPK_LENGTH)),
    ], [4, 4, GATHER_WARPS if GATHER else 1], [PV_REGS_SMALL, PV_REGS_SMALL, GATHER_LOAD_REGS if GATHER else LOAD_REGS])
