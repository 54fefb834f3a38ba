"""Hopper (sm_90a) split-KV MLA decode kernel in Gluon, for the FP8 cache formats.

One CTA handles one part of the split-KV schedule for 64 query rows, with three warp-specialised warpgroups
(12 warps: ptxas compiles every partition under the launch's 65536 / 384 = 168-register cap, and a PV
warpgroup's 64 x 256 fp32 accumulator alone takes 128):

  softmax WG (4 warps)  issues the TMA loads of each KV page's latent [64, 512], RoPE [64, 64] (and per-token
                        scales) into a STAGES-deep shared-memory ring; copies q into shared memory (a bf16 q
                        arrives quantized by q_quant.py with a scale per row: for fp8_rope_bf16 its latent part,
                        RoPE kept bf16; for the fp8 cache, whose RoPE keys are e4m3, the whole row, and its
                        latent part then held in registers as the Q.K^T wgmma's A operand);
                        per page: S = q_lat.k_lat^T (FP8 wgmma) scaled + q_rope.k_rope^T (fp8_rope_bf16: BF16
                        wgmma, its own accumulator; fp8: the same FP8 accumulation); online softmax; P (in units
                        of 1 / 448, times each token's V scale / the page's largest scale) -> e4m3 -> shared
                        memory, with the row rescale factor. A page's Q.K^T products run on the tensor cores while
                        the previous page's softmax runs.
  2 PV WGs (4 warps)    each owns 256 of the 512 output columns: transposes its half of the page's latent tile
                        into V^T (tokens contiguous: FP8 wgmma wants its B operand K-major), zeroing slots past the
                        sequence end, then O = O * alpha + P.V^T. Transposes run one page ahead of the wgmma, so
                        a ring slot is released early and the transpose overlaps the softmax of the page before.

V^T rows are stored in a permuted dim order that makes both the LDSM reads and the 16-byte stores bank-conflict
free; the epilogue relabels O's registers back to dim order. Schedule, partial results and their
combine are those of the portable kernel (scheduler.py, combine.py).

The handshakes (mbarriers; a waiter's phase is (position // buffers) & 1, positions counted across requests):
  kv_ready[slot]   TMA byte count of the page in the slot                 waited by all three warpgroups
  kv_empty[slot]   3 arrivals: softmax WG after the page's Q.K^T, each     waited by the TMA issuer before it
                   PV WG after its transpose                              refills the slot
  p_ready[page%2]  1: softmax WG wrote P and alpha                        waited by both PV WGs
  p_free[page%2]   2: each PV WG after the P.V wgmma that read them       waited by the softmax WG before it writes
  epi_ready        1: softmax WG wrote the request's 1 / l               waited by both PV WGs
  epi_free         2: each PV WG read it                                  waited by the softmax WG (next request)
"""
from __future__ import annotations

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import formats
from .constants import (BEGIN_REQ, D_LATENT, D_ROPE, END_REQ, FORMAT_CODE, FP8, FP8_ROPE_BF16, LOG2_FP8_MAX,
                        LOG2E, METADATA_WIDTH, PAGE_SIZE)
from .hopper_common import (BLOCK_M, HALF, LEFT, PV_REGS, Q_AS_IS, Q_PREQUANTIZED, RIGHT, ROPE_BF16_SMEM,
                            S_BF16, VEC_SMEM, advance, dim_bit as _d, key_limits, load_cursor_start, load_cursor_step,
                            load_q, part_start, pv_epilogue, request_range, softmax_epilogue, softmax_step,
                            token_bit as _t)
from .launcher import CachedLauncher
from .q_quant import quantize_q
from .triton_compat import tma_load

V_CHUNK = gl.constexpr(128)  # V dims transposed at a time
STAGES = gl.constexpr(2)     # KV pages in flight per CTA
SCALE_COLS = gl.constexpr(4)  # fp32 columns TMA fetches from each token's scale (16 bytes: TMA's narrowest box)
# fp8_rope_bf16's PV warpgroups give 8 registers each to the softmax warpgroup (168 + 16 = 184), which holds the
# BF16 RoPE product's own accumulator: without them ptxas keeps a request's value in local memory
ROPE_PV_REGS = gl.constexpr(160)
SUPPORTED_FORMATS = ("bf16", "fp8", "fp8_rope_bf16")   # bf16: hopper_bf16.py

# ---- layouts ----
LAT_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))  # [64, 512] e4m3
ROPE_FP8_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
SCALE_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))  # [64, 4] fp32
VT_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))  # [256, 64] e4m3
P_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))  # [64, 64] e4m3
# S [64 rows, 64 tokens] of the fp8 wgmma (k = 32); it converts to S_BF16's (k = 16) for free
S_FP8 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
O_ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32]))
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


# The rows' running sums of P per lane [64 rows, ROW_LANES]: the lanes that hold a row in S_FP8 (token bits 1-2)
# each sum the 16 tokens they hold; their sums meet once, at the request's end, instead of by shuffles every page
# (which wait behind the PV warps' shared-memory traffic).
ROW_LANES = gl.constexpr(4)
L_LANES = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_t(3)], lane_bases=[_d(0), _d(1), _t(0), _t(1), _t(2)],
                                                  warp_bases=[_t(4), _t(5)], block_bases=[],
                                                  shape=[64, ROW_LANES.value]))


@gluon.jit
def _lane_sums(p):
    """Each thread's sum of the tokens it holds in each of its rows of p [64 rows, 64 tokens] (S_FP8): [64, 4]."""
    x = gl.reshape(p, [BLOCK_M, 8, ROW_LANES, 2])   # token bits 3-5 (registers), 1-2 (lanes), 0 (registers)
    return gl.convert_layout(gl.sum(gl.sum(x, axis=3), axis=1), L_LANES, assert_trivial=True)


# A [64 tokens, 128 dims] chunk of V as read for the transpose: each thread holds 4 dims x 16 tokens, so the LDSM
# reads and (after the dim relabel) the 16-byte stores are both bank-conflict free.
V_LOAD = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_d(0), _d(1), _t(0), _t(1), _t(2), _t(3)],
                                                 lane_bases=[_d(2), _d(3), _d(4), _d(5), _d(6)],
                                                 warp_bases=[_t(4), _t(5)], block_bases=[], shape=[64, 128]))


@gluon.jit
def _transpose_chunk(src, dst, valid_tokens, MASK: gl.constexpr):
    """dst[n, t] = src[t, d(n)] for a [64, 128] e4m3 chunk, d(n) = (n & 0xE0) | ((n & 7) << 2) | ((n >> 3) & 3);
    tokens >= valid_tokens become 0 if MASK.

    The 4x4 byte transposes are 8 PRMT per 4 words (inline asm; each asm operand is the 32-bit word holding 4
    consecutive dims of one token). Every reshape/permute/split/join here only relabels registers.
    """
    # (token // 4, dim, token bit 1, bit 0): split on its last two axes, the asm's input words, 4 tokens each
    x = gl.permute(gl.reshape(src.load(V_LOAD), [PAGE_SIZE // 4, 2, 2, V_CHUNK]), (0, 3, 1, 2))
    xa, xb = gl.split(x)
    x0, x2 = gl.split(xa)
    x1, x3 = gl.split(xb)
    # 4 words of 4 dims of tokens 4i .. 4i + 3 -> 4 words of those tokens, one dim each
    TRANSPOSE: gl.constexpr = """
        prmt.b32 lo01, $4, $5, 0x5140;
        prmt.b32 hi01, $4, $5, 0x7362;
        prmt.b32 lo23, $6, $7, 0x5140;
        prmt.b32 hi23, $6, $7, 0x7362;
        prmt.b32 $0, lo01, lo23, 0x5410;
        prmt.b32 $1, lo01, lo23, 0x7632;
        prmt.b32 $2, hi01, hi23, 0x5410;
        prmt.b32 $3, hi01, hi23, 0x7632;
        """
    if MASK:  # cache slots past the sequence end may hold anything, NaN included, and P * NaN = NaN: each output
        # word (tokens 4i .. 4i + 3) keeps the bytes of tokens < valid_tokens, ANDed with 0xFFFFFFFF >> shift,
        # shift = 32 - 8 * clamp(valid_tokens - 4i, 0, 4) (no predicate per token: those cost the PV warpgroups
        # registers)
        word = gl.arange(0, PAGE_SIZE // 4, gl.SliceLayout(1, x0.type.layout))
        shift = gl.expand_dims(32 - 8 * gl.minimum(gl.maximum(valid_tokens - 4 * word, 0), 4), 1)
        y0, y1, y2, y3 = gl.inline_asm_elementwise(
            "{ .reg .b32 lo01, hi01, lo23, hi23, m;" + TRANSPOSE + """
            shr.b32 m, 0xFFFFFFFF, $8;
            and.b32 $0, $0, m;
            and.b32 $1, $1, m;
            and.b32 $2, $2, m;
            and.b32 $3, $3, m;
            }""", "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [x0, x1, x2, x3, shift],
            dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
    else:
        y0, y1, y2, y3 = gl.inline_asm_elementwise(
            "{ .reg .b32 lo01, hi01, lo23, hi23;" + TRANSPOSE + "}", "=r,=r,=r,=r,r,r,r,r", [x0, x1, x2, x3],
            dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
    # y_j[i, 4q + e] = V[4i + e, 4q + j]
    w = gl.join(gl.join(y0, y1), gl.join(y2, y3))
    w = gl.permute(gl.reshape(w, [16, V_CHUNK // 4, 4, 2, 2]), (0, 2, 1, 4, 3))
    z = gl.reshape(w, [PAGE_SIZE, V_CHUNK])                                    # z[token, dim]
    z = gl.reshape(gl.permute(gl.reshape(z, [PAGE_SIZE, V_CHUNK // 32, 8, 4]), (0, 1, 3, 2)),
                   [PAGE_SIZE, V_CHUNK])                                       # dim relabel
    dst.store(gl.permute(z, (1, 0)))


@gluon.jit
def _load_page(lat_desc, rope_desc, scale_desc, k_lat, k_rope, k_scale, kv_ready, kv_empty, page, slot,
               KV_FORMAT: gl.constexpr):
    """TMA cache page `page` into ring slot `slot` (ring position `slot`; waits until the slot's last page is
    released)."""
    RING: gl.constexpr = k_lat.shape[0]
    s = slot % RING
    mbarrier.wait(kv_empty.index(s), ((slot // RING) & 1) ^ 1)
    row = page * PAGE_SIZE
    page_bytes: gl.constexpr = lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
    if KV_FORMAT == FP8_ROPE_BF16:
        mbarrier.expect(kv_ready.index(s), page_bytes + scale_desc.block_type.nbytes)
        tma_load(scale_desc, [row, 0], kv_ready.index(s), k_scale.index(s))
    else:
        mbarrier.expect(kv_ready.index(s), page_bytes)
    tma_load(lat_desc, [row, 0], kv_ready.index(s), k_lat.index(s))
    tma_load(rope_desc, [row, 0], kv_ready.index(s), k_rope.index(s))


@gluon.jit
def score_scale_log2(sm_scale_log2, descale_q_ptr, descale_k_ptr, KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr):
    """The scores' exp2 scale: softmax_scale * log2(e), times the "fp8" format's per-tensor descales, which multiply
    every score."""
    if KV_FORMAT == FP8:
        sm_scale_log2 = sm_scale_log2 * gl.load(descale_k_ptr)
        if Q_FP8:
            sm_scale_log2 = sm_scale_log2 * gl.load(descale_q_ptr)
    return sm_scale_log2


@gluon.jit
def o_scale(v_unit, descale_k_ptr, KV_FORMAT: gl.constexpr):
    """What O is multiplied by at a request's end, besides 1 / l (P and l share their unit, 1 / 448): the V scale,
    the "fp8" format's per-tensor descale or fp8_rope_bf16's current page unit."""
    if KV_FORMAT == FP8:
        scale = gl.load(descale_k_ptr)
    else:
        scale = v_unit
    return scale


@gluon.jit
def token_scales(scale_tile, blk, seqlen, LOAD: gl.constexpr, TOK: gl.constexpr, KV_FORMAT: gl.constexpr):
    """fp8_rope_bf16: page blk's per-token scales (column 0 of its [64, SCALE_COLS] tile), read with LOAD straight
    into TOK, the scores' token layout; 0 past the sequence's end, whose slots may hold NaN. Other formats: 1."""
    if KV_FORMAT == FP8_ROPE_BF16:
        x = scale_tile.load(LOAD).reshape([PAGE_SIZE, 2, 2])
        k_scale = gl.convert_layout(gl.split(gl.split(x)[0])[0], TOK, assert_trivial=True)
        if (blk + 1) * PAGE_SIZE > seqlen:
            tok = blk * PAGE_SIZE + gl.arange(0, PAGE_SIZE, TOK)
            k_scale = gl.where(tok < seqlen, k_scale, 0.0)
    else:
        k_scale = gl.full([PAGE_SIZE], 1.0, gl.float32, TOK)
    return k_scale


@gluon.jit
def hand_p(p, alpha, k_scale, scale_max, v_unit, pt, p_smem, alpha_smem, p_ready, p_free, TOKEN_AXIS: gl.constexpr,
           KV_FORMAT: gl.constexpr):
    """A page's P, as e4m3, and the rows' rescale factor to the PV warpgroups (P buffer pt % 2); returns the V unit
    the page's P is in. p comes in units of 1 / 448 (up to 448: e4m3's range); for fp8_rope_bf16 it is times each
    token's V scale in units of the page's largest scale (scale_max), so e4m3 keeps its whole range; fp8 has one
    unit throughout. TOKEN_AXIS: p's token axis (1; 0 for hopper_small's P^T, stored transposed): P goes to
    shared memory as [rows, tokens]."""
    if KV_FORMAT == FP8_ROPE_BF16:
        page_unit = gl.maximum(scale_max, 1e-30)
        p = p * gl.expand_dims(k_scale * (1.0 / page_unit), 1 - TOKEN_AXIS)
    else:
        page_unit = v_unit
    alpha = alpha * (v_unit / page_unit)
    pb = pt % 2
    mbarrier.wait(p_free.index(pb), ((pt // 2) & 1) ^ 1)
    p = p.to(gl.float8e4nv)
    if TOKEN_AXIS == 0:
        p = gl.permute(p, (1, 0))
    p_smem.index(pb).store(p)
    alpha_smem.index(pb).store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_ready.index(pb))
    return page_unit


@gluon.jit
def _softmax_page(sc, k_scale, scale_max, blk, key_limit, min_key_limit, m_i, l_lanes, v_unit, pt, sm_scale_log2,
                  p_smem, alpha_smem, p_ready, p_free, KV_FORMAT: gl.constexpr):
    """Online softmax of one page's scores (token scales k_scale, their largest scale_max); hands P and the row
    rescale factor to the PV warpgroups. Returns the new (m, per-lane row sums, V unit)."""
    p, alpha, m_new = softmax_step(sc, blk, key_limit, min_key_limit, m_i, sm_scale_log2, LOG2_FP8_MAX)
    alpha_lanes = gl.convert_layout(alpha, gl.SliceLayout(1, L_LANES), assert_trivial=True)
    l_lanes = l_lanes * alpha_lanes[:, None] + _lane_sums(p)
    page_unit = hand_p(p, alpha, k_scale, scale_max, v_unit, pt, p_smem, alpha_smem, p_ready, p_free, 1, KV_FORMAT)
    return m_new, l_lanes, page_unit


@gluon.jit
def _softmax_wg(q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, scale_desc, block_table_ptr, stride_bt,
                seqlens_ptr, max_pages, meta_ptr, num_splits_ptr, lse_ptr, lse_part_ptr, descale_q_ptr, descale_k_ptr,
                sm_scale_log2, H, S_Q, R, q_lat, q_rope, k_lat, k_rope, k_scale_smem, p_smem, alpha_smem,
                norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free,
                KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr):
    row_l: gl.constexpr = gl.SliceLayout(1, S_FP8)
    col_l: gl.constexpr = gl.SliceLayout(0, S_FP8)
    rows = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, row_l)
    s_idx = rows // H
    sm_scale_log2 = score_scale_log2(sm_scale_log2, descale_q_ptr, descale_k_ptr, KV_FORMAT, Q_FP8)
    begin_req = gl.load(meta_ptr + BEGIN_REQ)
    end_req = gl.load(meta_ptr + END_REQ)
    # the TMA cursor runs STAGES pages ahead of the consumer, across request boundaries
    load_req, load_blk, load_ok, load_len, load_hi, load_page = load_cursor_start(
        meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, begin_req, end_req)
    loaded = 0
    # a loop with a run-time condition, so it is not unrolled: this once-per-CTA code runs from a cold instruction
    # cache, once per copy
    while (loaded < STAGES) & load_ok:
        _load_page(lat_desc, rope_desc, scale_desc, k_lat, k_rope, k_scale_smem, kv_ready, kv_empty, load_page,
                   loaded, KV_FORMAT)
        loaded += 1
        load_req, load_blk, load_ok, load_len, load_hi, load_page = load_cursor_step(
            meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, load_req, load_blk, load_len,
            load_hi, begin_req, end_req)
    it = 0       # pages consumed (KV ring position)
    n_req = 0    # requests finished (epilogue barrier phase)
    for req in tl.range(begin_req, end_req + 1, disable_licm=True):  # nothing hoisted: fewer spilled values
        seqlen, lo, hi = request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req)
        if lo < hi:
            q_scale = gl.convert_layout(
                load_q(q_ptr + req * stride_qb, stride_qs, stride_qh, H, R, q_lat, q_rope, descale_q_ptr + req * R,
                       Q_AS_IS if Q_FP8 else Q_PREQUANTIZED), row_l)
            if KV_FORMAT == FP8:  # (Triton's barrier after load_q's cp.async wait: every thread's copies are in)
                q_a = q_lat.load(Q_REGS)
            else:
                q_a = q_lat
            key_limit, min_key_limit = key_limits(seqlen, s_idx, S_Q, CAUSAL)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
            l_lanes = gl.zeros([BLOCK_M, ROW_LANES], gl.float32, L_LANES)
            v_unit = gl.to_tensor(1.0)  # the V scale O is expressed in (page-local for fp8_rope_bf16)
            prev_s = gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8)
            prev_scale = gl.full([PAGE_SIZE], 1.0, gl.float32, col_l)
            prev_max = 1.0   # fp8: hand_p keeps one unit throughout
            for blk in range(lo, hi):
                # ---- S = q_lat.k_lat^T * scales + q_rope.k_rope^T for this page ... ----
                s = it % STAGES
                mbarrier.wait(kv_ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(q_a, k_lat.index(s).permute((1, 0)),
                                    gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_FP8), use_acc=False, is_async=True)
                if KV_FORMAT == FP8:  # e4m3 q and cache throughout: one FP8 accumulation, scaled afterwards
                    acc = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)), acc, is_async=True)
                else:  # BF16 RoPE product in its own accumulator, so both products run during the softmax
                    acc_rope = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)),
                                             gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_BF16), use_acc=False,
                                             is_async=True)
                # ---- ... while the previous page's softmax runs ----
                if blk > lo:
                    m_i, l_lanes, v_unit = _softmax_page(prev_s, prev_scale, prev_max, blk - 1, key_limit,
                                                         min_key_limit, m_i, l_lanes, v_unit, it - 1, sm_scale_log2,
                                                         p_smem, alpha_smem, p_ready, p_free, KV_FORMAT)
                k_scale = token_scales(k_scale_smem.index(s), blk, seqlen, SCALE_LOAD, col_l, KV_FORMAT)
                if KV_FORMAT == FP8_ROPE_BF16:  # the scales' max here, while the wgmma runs, not in the softmax
                    k_max = gl.max(k_scale, axis=0)
                else:
                    k_max = 1.0
                if KV_FORMAT == FP8:
                    acc = warpgroup_mma_wait(0, deps=[acc, q_rope, k_lat.index(s), k_rope.index(s)])[0]
                    if not Q_FP8:   # a scale per query row (an e4m3 q's is per tensor, in sm_scale_log2)
                        acc = acc * q_scale[:, None]
                else:
                    acc, acc_rope = warpgroup_mma_wait(0, deps=[acc, acc_rope, q_lat, q_rope, k_lat.index(s),
                                                                k_rope.index(s)])[:2]
                    acc = acc * q_scale[:, None] * k_scale[None, :] + gl.convert_layout(acc_rope, S_FP8,
                                                                                        assert_trivial=True)
                mbarrier.arrive(kv_empty.index(s))
                prev_s = acc
                prev_scale = k_scale
                prev_max = k_max
                it += 1
                if load_ok:  # refill this page's slot once the PV warpgroups have transposed it
                    _load_page(lat_desc, rope_desc, scale_desc, k_lat, k_rope, k_scale_smem, kv_ready, kv_empty,
                               load_page, loaded, KV_FORMAT)
                    loaded += 1
                    load_req, load_blk, load_ok, load_len, load_hi, load_page = load_cursor_step(
                        meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, load_req, load_blk, load_len,
                        load_hi, begin_req, end_req)
            m_i, l_lanes, v_unit = _softmax_page(prev_s, prev_scale, prev_max, hi - 1, key_limit, min_key_limit,
                                                 m_i, l_lanes, v_unit, it - 1, sm_scale_log2, p_smem, alpha_smem,
                                                 p_ready, p_free, KV_FORMAT)

            # ---- epilogue: 1/l and the FP8 unit to the PV warpgroups; lse ----
            l_i = gl.convert_layout(gl.sum(l_lanes, axis=1), row_l, assert_trivial=True)
            softmax_epilogue(o_scale(v_unit, descale_k_ptr, KV_FORMAT), m_i, l_i, rows, req, begin_req, R, H, S_Q,
                             sm_scale_log2, meta_ptr, num_splits_ptr, lse_ptr, lse_part_ptr, norm_smem, epi_ready,
                             epi_free, n_req, LOG2_FP8_MAX)
            n_req += 1


@gluon.jit
def _transpose_page(k_lat, vt, kv_ready, kv_empty, slot, valid, WG: gl.constexpr):
    """This warpgroup's half of ring slot `slot`'s latent tile -> V^T buffer slot % 2; then releases the slot."""
    RING: gl.constexpr = k_lat.shape[0]
    s = slot % RING
    mbarrier.wait(kv_ready.index(s), (slot // RING) & 1)
    for c in gl.static_range(HALF // V_CHUNK):
        src = k_lat.index(s).slice(WG * HALF + c * V_CHUNK, V_CHUNK, dim=1)
        dst = vt.index(2 * WG + slot % 2).slice(c * V_CHUNK, V_CHUNK, dim=0)
        if valid < PAGE_SIZE:
            _transpose_chunk(src, dst, valid, True)
        else:
            _transpose_chunk(src, dst, valid, False)
    fence_async_shared()
    mbarrier.arrive(kv_empty.index(s))


@gluon.jit
def transpose_next(k_lat, vt, kv_ready, kv_empty, slot, meta_ptr, seqlens_ptr, max_pages, t_req, t_blk, t_ok, t_len,
                   t_hi, begin_req, end_req, WG: gl.constexpr):
    """A PV warpgroup's transpose cursor (a page cursor, see hopper_common.advance): if it is on a page, that
    page's V^T half into ring position `slot`'s buffer, and the cursor one page on."""
    if t_ok:
        _transpose_page(k_lat, vt, kv_ready, kv_empty, slot, t_len - t_blk * PAGE_SIZE, WG)
        t_req, t_blk, t_ok, t_len, t_hi = advance(meta_ptr, seqlens_ptr, max_pages, t_req, t_blk, t_len, t_hi,
                                                  begin_req, end_req)
    return t_req, t_blk, t_ok, t_len, t_hi


@gluon.jit
def _pv_wg(max_pages, seqlens_ptr, meta_ptr, num_splits_ptr, out_ptr, o_part_ptr, H,
           S_Q, R, k_lat, vt, p_smem, alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free,
           WG: gl.constexpr):
    """O[:, 256 WG : 256 (WG + 1)] for every page of the part.

    The transposes run one page ahead of the P.V wgmma (across request boundaries), so a ring slot is released
    without waiting for the softmax of the page before it.
    """
    begin_req = gl.load(meta_ptr + BEGIN_REQ)
    end_req = gl.load(meta_ptr + END_REQ)
    t_req, t_blk, t_ok, t_len, t_hi = transpose_next(
        k_lat, vt, kv_ready, kv_empty, 0, meta_ptr, seqlens_ptr, max_pages,
        *part_start(meta_ptr, seqlens_ptr, max_pages, begin_req, end_req), begin_req, end_req, WG)
    it = 0
    n_req = 0
    for req in tl.range(begin_req, end_req + 1, disable_licm=True):  # nothing hoisted: fewer spilled values
        seqlen, lo, hi = request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req)
        if lo < hi:
            o = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, O_ACC))
            for blk in range(lo, hi):
                pb = it % 2
                o = warpgroup_mma_wait(0, deps=[o])   # the previous page's P.V: its P and V^T buffers are free
                if blk > lo:
                    mbarrier.arrive(p_free.index(1 - pb))
                # the next page's V^T, into the buffer that P.V just released
                t_req, t_blk, t_ok, t_len, t_hi = transpose_next(k_lat, vt, kv_ready, kv_empty, it + 1, meta_ptr,
                                                                 seqlens_ptr, max_pages, t_req, t_blk, t_ok, t_len,
                                                                 t_hi, begin_req, end_req, WG)
                mbarrier.wait(p_ready.index(pb), (it // 2) & 1)
                alpha = alpha_smem.index(pb).load(gl.SliceLayout(1, O_ACC))
                o = warpgroup_mma(p_smem.index(pb), vt.index(2 * WG + pb).permute((1, 0)), o * alpha[:, None],
                                  is_async=True)
                it += 1
            o = warpgroup_mma_wait(0, deps=[o])
            mbarrier.arrive(p_free.index((it - 1) % 2))

            # ---- epilogue: O * norm -> out (a request with one split) or its partial slot ----
            pv_epilogue(o, req, begin_req, R, meta_ptr, num_splits_ptr, out_ptr, o_part_ptr, norm_smem, epi_ready,
                        epi_free, n_req, WG, True)
            n_req += 1


@gluon.jit
def allocate_operands(ROWS: gl.constexpr, RING: gl.constexpr, rope_desc, KV_FORMAT: gl.constexpr):
    """Shared memory of the FP8 kernels' operands (this kernel's and hopper_small's): q (latent e4m3; RoPE e4m3
    with the fp8 cache, bf16 with fp8_rope_bf16), a ring of RING pages (latent, RoPE, fp8_rope_bf16's token
    scales), V^T (2 halves x 2 pages), and the softmax warpgroup's handoffs: P as [rows, tokens] and the rows'
    rescale factors (2 pages), the rows' 1 / l. Unused operands alias a used one."""
    q_lat = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, D_LATENT], LAT_SMEM)
    q_rope = gl.allocate_shared_memory(rope_desc.dtype, [ROWS, D_ROPE], rope_desc.layout)
    k_lat = gl.allocate_shared_memory(gl.float8e4nv, [RING, PAGE_SIZE, D_LATENT], LAT_SMEM)
    k_rope = gl.allocate_shared_memory(rope_desc.dtype, [RING, PAGE_SIZE, D_ROPE], rope_desc.layout)
    if KV_FORMAT == FP8_ROPE_BF16:
        k_scale = gl.allocate_shared_memory(gl.float32, [RING, PAGE_SIZE, SCALE_COLS], SCALE_SMEM)
    else:
        k_scale = k_rope
    vt = gl.allocate_shared_memory(gl.float8e4nv, [4, HALF, PAGE_SIZE], VT_SMEM)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, ROWS, PAGE_SIZE], P_SMEM)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS], VEC_SMEM)
    norm_smem = gl.allocate_shared_memory(gl.float32, [ROWS], VEC_SMEM)
    return q_lat, q_rope, k_lat, k_rope, k_scale, vt, p_smem, alpha_smem, norm_smem


@gluon.jit
def init_barriers(RING: gl.constexpr):
    """The FP8 kernels' mbarriers (the module docstring's handshakes), initialised."""
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_l)
    kv_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    epi_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    for i in gl.static_range(RING):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=3)   # softmax WG after Q.K^T, each PV WG after its transpose
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=2)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=2)
    return kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free


@gluon.jit
def mla_decode_hopper_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, scale_desc,
        block_table_ptr, stride_bt, max_pages, seqlens_ptr, meta_ptr, num_splits_ptr,
        out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, descale_q_ptr, descale_k_ptr, sm_scale_log2, H, S_Q, R,
        KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr):
    """R = H * S_Q, the query rows per request, comes as a parameter: computed in the partitions, LLVM made it
    one value before warp_specialize's branch, which ptxas kept in local memory."""
    meta = meta_ptr + gl.program_id(0) * METADATA_WIDTH
    q_lat, q_rope, k_lat, k_rope, k_scale, vt, p_smem, alpha_smem, norm_smem = allocate_operands(
        BLOCK_M, STAGES, rope_desc, KV_FORMAT)
    kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free = init_barriers(STAGES)

    gl.warp_specialize([
        (_softmax_wg, (q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, scale_desc, block_table_ptr,
                       stride_bt, seqlens_ptr, max_pages, meta, num_splits_ptr, lse_ptr, lse_part_ptr, descale_q_ptr,
                       descale_k_ptr, sm_scale_log2, H, S_Q, R, q_lat, q_rope, k_lat, k_rope, k_scale,
                       p_smem, alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free,
                       KV_FORMAT, Q_FP8, CAUSAL)),
        (_pv_wg, (max_pages, seqlens_ptr, meta, num_splits_ptr, out_ptr, o_part_ptr, H,
                  S_Q, R, k_lat, vt, p_smem, alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready,
                  epi_free, LEFT)),
        (_pv_wg, (max_pages, seqlens_ptr, meta, num_splits_ptr, out_ptr, o_part_ptr, H,
                  S_Q, R, k_lat, vt, p_smem, alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready,
                  epi_free, RIGHT)),
    ], [4, 4], [ROPE_PV_REGS if KV_FORMAT == FP8_ROPE_BF16 else PV_REGS] * 2)


# ---- host side ----
_descriptors: dict = {}
_launch = CachedLauncher(mla_decode_hopper_kernel)


def _cache_descriptors(k_cache: torch.Tensor, kv_format: str):
    """TMA descriptors of a cache's latent, RoPE (and scale) columns, built once per cache tensor."""
    key = (k_cache.data_ptr(), tuple(k_cache.shape), kv_format)
    if key not in _descriptors:
        rows = k_cache.shape[0] * formats.PAGE_SIZE
        lat_cols = formats.D_LATENT   # the latent part's columns per TMA box
        if kv_format == "bf16":
            from .hopper_bf16 import K_BOX, LAT_BF16_SMEM
            flat = k_cache.view(rows, formats.D_QK)
            lat, rope = flat[:, :formats.D_LATENT], flat[:, formats.D_LATENT:]
            scale = None
            lat_layout, rope_layout = LAT_BF16_SMEM, ROPE_BF16_SMEM
            lat_cols = K_BOX.value   # loaded box by box (hopper_bf16._load_page)
        elif kv_format == "fp8_rope_bf16":
            row = k_cache.view(rows, formats.ROW_BYTES)
            lat = row.view(torch.float8_e4m3fn)[:, :formats.D_LATENT]
            rope = row.view(torch.bfloat16)[:, formats.ROPE_OFFSET // 2:formats.ROW_BYTES // 2]
            scale = row.view(torch.float32)[:, formats.SCALE_OFFSET // 4:formats.SCALE_OFFSET // 4 + SCALE_COLS.value]
            lat_layout, rope_layout = LAT_SMEM, ROPE_BF16_SMEM
        else:
            flat = k_cache.view(rows, formats.D_QK)
            lat, rope = flat[:, :formats.D_LATENT], flat[:, formats.D_LATENT:]
            scale = None
            lat_layout, rope_layout = LAT_SMEM, ROPE_FP8_SMEM
        if len(_descriptors) > 64:
            _descriptors.clear()
        lat_desc = TensorDescriptor.from_tensor(lat, [formats.PAGE_SIZE, lat_cols], lat_layout.value)
        rope_desc = TensorDescriptor.from_tensor(rope, [formats.PAGE_SIZE, formats.D_ROPE], rope_layout.value)
        scale_desc = (TensorDescriptor.from_tensor(scale, [formats.PAGE_SIZE, SCALE_COLS.value], SCALE_SMEM.value)
                      if scale is not None else rope_desc)
        _descriptors[key] = (lat_desc, rope_desc, scale_desc)
    return _descriptors[key]


def supports(q: torch.Tensor, kv_format: str) -> bool:
    """Whether the Hopper kernels handle the call (a bf16 q; an e4m3 q only with "fp8"); the portable one does the
    rest."""
    return kv_format in SUPPORTED_FORMATS and (q.dtype == torch.bfloat16 or kv_format == "fp8")


def launch_hopper(q, k_cache, kv_format, block_table, cache_seqlens, meta, num_splits, out, lse, o_part, lse_part,
                  descale_q, descale_k, softmax_scale, causal):
    _, s_q, h_q, _ = q.shape
    lat_desc, rope_desc, scale_desc = _cache_descriptors(k_cache, kv_format)
    if kv_format == "bf16":
        from .hopper_bf16 import launch_hopper_bf16
        return launch_hopper_bf16(q, lat_desc, rope_desc, block_table, cache_seqlens, meta, num_splits, out, lse,
                                  o_part, lse_part, softmax_scale, causal)
    from . import hopper_small
    rows = s_q * h_q
    dummy = cache_seqlens  # never read: placeholders for absent scales
    q_fp8 = q.dtype != torch.bfloat16
    small_rows = hopper_small.rows_per_cta(rows)
    if not q_fp8 and not small_rows:  # the 64-row kernel takes a bf16 q quantized (packed rows, a scale per row)
        q, descale_q = quantize_q(q, rope_fp8=kv_format == "fp8")
    args = (q, q.stride(0), q.stride(1), q.stride(2), lat_desc, rope_desc, scale_desc,
            block_table, block_table.stride(0), block_table.shape[1], cache_seqlens, meta, num_splits,
            out, lse, o_part, lse_part, descale_q if descale_q is not None else dummy,
            descale_k if descale_k is not None else dummy, softmax_scale * LOG2E.value, h_q, s_q, rows)
    constexprs = dict(KV_FORMAT=FORMAT_CODE[kv_format], Q_FP8=q_fp8, CAUSAL=causal)
    if small_rows:  # few query rows: the transposed kernel (same parameters), with no rows of padding to 64
        hopper_small._launch((meta.shape[0], 1), args, {**constexprs, "ROWS": small_rows}, num_warps=4)
    else:
        _launch((meta.shape[0], -(-rows // BLOCK_M)), args, constexprs, num_warps=4)
