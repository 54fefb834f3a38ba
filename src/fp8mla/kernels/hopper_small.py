"""Hopper (sm_90a) MLA decode kernel for few query rows (s_q * h_q <= 32) and the FP8 cache formats.

hopper.py runs a wgmma of 64 query rows whatever the call has: with 16 rows (s_q=1, h_q=16, the memory-bound
case) three quarters of its Q.K^T, P.V and softmax work is padding. Here the products are transposed so the
rows are the wgmma's N (16 or 32) and the 64 tokens of a page its M:

  S^T [64 tokens, ROWS] = K [64, 576] . Q^T       (K from the ring as the A operand, q from shared memory as B)
  O^T [512 dims, ROWS] += V^T [512, 64] . P^T      (V^T as hopper.py's transposes build it, now the A operand)

Everything else is hopper.py's: the schedule, the softmax and two PV warpgroups and their handshakes, the TMA
ring (three or four pages deep here, ring_pages: q takes 10-20 KB instead of 40), the V transposes; but the TMA
loads come from a load warp of their own, off the softmax warpgroup's chain (the 128-register cap of a fourth
warpgroup is no constraint with O^T at 32-64 registers). The softmax reduces over tokens, i.e. across the softmax
warpgroup's four warps: they meet once per page, for the row maxima (and fp8_rope_bf16's largest token scale);
the row sums stay per thread until the request's end. O^T's rows are V^T's permuted dims, so the epilogue stores
each to its dim.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from .constants import BEGIN_REQ, D_LATENT, END_REQ, FP8, FP8_ROPE_BF16, LOG2_FP8_MAX, METADATA_WIDTH, PAGE_SIZE
from .hopper import (SCALE_COLS, V_CHUNK, _load_page, allocate_operands, hand_p, init_barriers, o_scale,
                     score_scale_log2, token_scales, transpose_next)
from .hopper_common import (HALF, LEFT, Q_AS_IS, Q_QUANTIZE, RIGHT, dim_bit as _d, token_bit as _t, VEC_SMEM,
                            exp_step, key_limits, load_cursor_start, load_cursor_step, load_q, mask_keys, part_start,
                            request_range, softmax_epilogue, split_slot)
from .launcher import CachedLauncher
from .triton_compat import barrier

PV_REGS_SMALL = gl.constexpr(128)   # registers per thread: 65536 / 512 (the load warp is padded to a warpgroup)
LOAD_REGS = gl.constexpr(24)   # the load warp's (setmaxnreg's least)
MAX_ROWS = 32                # calls with more query rows (s_q * h_q) use hopper.py
RED_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))  # [4 warps, ROWS]
# A page's [64 tokens, SCALE_COLS] scale tile, each token held by the threads that hold its score row in S^T
# (wgmma accumulator: token bits 0-2 in lanes 2-4, bit 3 in a register, bits 4-5 in the warps), so the [64] scale
# vector needs no layout conversion; the padding columns sit in registers and are never read.
SCALE_LOAD_T = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_d(0), _d(1), _t(3)],
                                                       lane_bases=[[0, 0], [0, 0], _t(0), _t(1), _t(2)],
                                                       warp_bases=[_t(4), _t(5)], block_bases=[],
                                                       shape=[PAGE_SIZE, SCALE_COLS.value]))


@triton.constexpr_function
def ring_pages(rows, kv_format):
    """KV pages in flight per CTA: 4 where they fit in shared memory (16 rows with the fp8 cache: 220 KB), else
    3."""
    return 4 if rows == 16 and kv_format == FP8 else 3


@triton.constexpr_function
def _warp_rows_layout(rows):
    """[4 warps, rows]: every thread holds the four warps' values of the query rows it holds in S^T (wgmma
    accumulator: row bit 0 and bits 3+ in registers, bits 1-2 in lanes 0-1), so a max over the warps is in-thread
    and leaves S^T's own row layout."""
    row_regs = [[0, 1]] + [[0, r] for r in (8, 16) if r < rows]
    return gl.DistributedLinearLayout(reg_bases=row_regs + [[1, 0], [2, 0]],
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, rows])


@gluon.jit
def _page_max(sc, k_scale, red, red_scale, pt, KV_FORMAT: gl.constexpr):
    """(each query row's max score, the largest token scale) of the page. Tokens span the four warps: each warp
    reduces its 16, and the warps meet in shared memory at one barrier (double-buffered by page, so a warp a
    page ahead cannot overwrite what another still reads)."""
    ROWS: gl.constexpr = sc.shape[1]
    buf = red.index(pt % 2)
    buf.store(gl.max(gl.reshape(sc, [4, PAGE_SIZE // 4, ROWS]), axis=1))
    if KV_FORMAT == FP8_ROPE_BF16:
        red_scale.index(pt % 2).store(gl.max(gl.reshape(k_scale, [4, PAGE_SIZE // 4]), axis=1))
    barrier()
    m = gl.convert_layout(gl.max(buf.load(_warp_rows_layout(ROWS)), axis=0), gl.SliceLayout(0, sc.type.layout),
                          assert_trivial=True)
    if KV_FORMAT == FP8_ROPE_BF16:
        scale_max = gl.max(red_scale.index(pt % 2).load(gl.BlockedLayout([4], [32], [4], [0])), axis=0)
    else:
        scale_max = 1.0
    return m, scale_max


@gluon.jit
def _softmax_page(sc, k_scale, blk, key_limit, min_key_limit, m_i, l_acc, v_unit, pt, sm_scale_log2, p_smem,
                  alpha_smem, red, red_scale, p_ready, p_free, KV_FORMAT: gl.constexpr):
    """hopper.py's _softmax_page on S^T: rows are tokens, columns query rows; P^T goes to shared memory as P
    [ROWS, 64] (tokens contiguous: P.V's B operand). The row sums stay per thread (l_acc, S^T's shape) until the
    request's end: a sum over tokens would cost the page another meeting of the warps."""
    sc = mask_keys(sc, blk, key_limit, min_key_limit, 0)
    page_max, scale_max = _page_max(sc, k_scale, red, red_scale, pt, KV_FORMAT)
    m_new = gl.maximum(m_i, page_max)
    p, alpha = exp_step(sc, m_i, m_new, sm_scale_log2, LOG2_FP8_MAX, 0)
    l_acc = l_acc * alpha[None, :] + p
    page_unit = hand_p(p, alpha, k_scale, scale_max, v_unit, pt, p_smem, alpha_smem, p_ready, p_free, 0, KV_FORMAT)
    return m_new, l_acc, page_unit


@gluon.jit
def _softmax_wg(q_ptr, stride_qb, stride_qs, stride_qh, seqlens_ptr, max_pages, meta_ptr, num_splits_ptr, lse_ptr,
                lse_part_ptr, descale_q_ptr, descale_k_ptr, sm_scale_log2, H, S_Q, R, q_lat, q_rope, k_lat, k_rope,
                k_scale_smem, p_smem, alpha_smem, norm_smem, red, red_scale, kv_ready, kv_empty, p_ready,
                p_free, epi_ready, epi_free, KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr):
    ROWS: gl.constexpr = q_lat.shape[0]
    RING: gl.constexpr = k_lat.shape[0]
    ST: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 32])
    ST_BF16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, ROWS, 16])
    row_l: gl.constexpr = gl.SliceLayout(0, ST)   # query rows are S^T's columns
    tok_l: gl.constexpr = gl.SliceLayout(1, ST)
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, row_l)
    s_idx = rows // H
    sm_scale_log2 = score_scale_log2(sm_scale_log2, descale_q_ptr, descale_k_ptr, KV_FORMAT, Q_FP8)
    begin_req = gl.load(meta_ptr + BEGIN_REQ)
    end_req = gl.load(meta_ptr + END_REQ)
    it = 0
    n_req = 0
    for req in range(begin_req, end_req + 1):
        seqlen, lo, hi = request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req)
        if lo < hi:
            q_scale = gl.convert_layout(
                load_q(q_ptr + req * stride_qb, stride_qs, stride_qh, H, R, q_lat, q_rope, descale_q_ptr,
                       Q_AS_IS if Q_FP8 else Q_QUANTIZE), row_l)
            key_limit, min_key_limit = key_limits(seqlen, s_idx, S_Q, CAUSAL)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
            l_acc = gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST)
            v_unit = gl.to_tensor(1.0)
            prev_s = gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST)
            prev_scale = gl.full([PAGE_SIZE], 1.0, gl.float32, tok_l)
            for blk in range(lo, hi):
                # ---- S^T = k_lat.q_lat^T * scales + k_rope.q_rope^T for this page ... ----
                s = it % RING
                mbarrier.wait(kv_ready.index(s), (it // RING) & 1)
                acc = warpgroup_mma(k_lat.index(s), q_lat.permute((1, 0)),
                                    gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST), use_acc=False, is_async=True)
                if KV_FORMAT == FP8:
                    acc = warpgroup_mma(k_rope.index(s), q_rope.permute((1, 0)), acc, is_async=True)
                else:
                    acc_rope = warpgroup_mma(k_rope.index(s), q_rope.permute((1, 0)),
                                             gl.zeros([PAGE_SIZE, ROWS], gl.float32, ST_BF16), use_acc=False,
                                             is_async=True)
                # ---- ... while the previous page's softmax runs ----
                if blk > lo:
                    m_i, l_acc, v_unit = _softmax_page(prev_s, prev_scale, blk - 1, key_limit, min_key_limit,
                                                       m_i, l_acc, v_unit, it - 1, sm_scale_log2, p_smem, alpha_smem,
                                                       red, red_scale, p_ready, p_free, KV_FORMAT)
                k_scale = token_scales(k_scale_smem.index(s), blk, seqlen, SCALE_LOAD_T, tok_l, KV_FORMAT)
                if KV_FORMAT == FP8:
                    acc = warpgroup_mma_wait(0, deps=[acc, q_lat, q_rope, k_lat.index(s), k_rope.index(s)])[0]
                    if not Q_FP8:   # a scale per query row (an e4m3 q's is per tensor, in sm_scale_log2)
                        acc = acc * q_scale[None, :]
                else:
                    acc, acc_rope = warpgroup_mma_wait(0, deps=[acc, acc_rope, q_lat, q_rope, k_lat.index(s),
                                                                k_rope.index(s)])[:2]
                    acc = acc * k_scale[:, None] * q_scale[None, :] + gl.convert_layout(acc_rope, ST,
                                                                                        assert_trivial=True)
                mbarrier.arrive(kv_empty.index(s))
                prev_s = acc
                prev_scale = k_scale
                it += 1
            m_i, l_acc, v_unit = _softmax_page(prev_s, prev_scale, hi - 1, key_limit, min_key_limit, m_i, l_acc,
                                               v_unit, it - 1, sm_scale_log2, p_smem, alpha_smem, red, red_scale,
                                               p_ready, p_free, KV_FORMAT)
            l_i = gl.sum(l_acc, axis=0)

            # ---- epilogue: 1/l and the FP8 unit to the PV warpgroups; lse ----
            softmax_epilogue(o_scale(v_unit, descale_k_ptr, KV_FORMAT), m_i, l_i, rows, req, begin_req, R, H, S_Q,
                             sm_scale_log2, meta_ptr, num_splits_ptr, lse_ptr, lse_part_ptr, norm_smem, epi_ready,
                             epi_free, n_req, LOG2_FP8_MAX)
            n_req += 1


@gluon.jit
def _load_wg(lat_desc, rope_desc, scale_desc, block_table_ptr, stride_bt, seqlens_ptr, max_pages, meta_ptr, k_lat,
             k_rope, k_scale_smem, kv_ready, kv_empty, KV_FORMAT: gl.constexpr):
    """TMA: every page of the part into the ring, as soon as its slot is released (kv_empty)."""
    begin_req = gl.load(meta_ptr + BEGIN_REQ)
    end_req = gl.load(meta_ptr + END_REQ)
    load_req, load_blk, load_ok, load_len, load_hi, load_page = load_cursor_start(
        meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, begin_req, end_req)
    loaded = 0
    while load_ok:
        _load_page(lat_desc, rope_desc, scale_desc, k_lat, k_rope, k_scale_smem, kv_ready, kv_empty, load_page,
                   loaded, KV_FORMAT)
        loaded += 1
        load_req, load_blk, load_ok, load_len, load_hi, load_page = load_cursor_step(
            meta_ptr, seqlens_ptr, block_table_ptr, stride_bt, max_pages, load_req, load_blk, load_len, load_hi,
            begin_req, end_req)


@gluon.jit
def _pv_wg(max_pages, seqlens_ptr, meta_ptr, num_splits_ptr, out_ptr, o_part_ptr, H, S_Q, R, k_lat, vt, p_smem,
           alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free, WG: gl.constexpr):
    """O^T[256 WG : 256 (WG + 1), :] for every page of the part (hopper.py's _pv_wg, transposed)."""
    ROWS: gl.constexpr = p_smem.shape[1]
    OT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 32])
    begin_req = gl.load(meta_ptr + BEGIN_REQ)
    end_req = gl.load(meta_ptr + END_REQ)
    t_req, t_blk, t_ok, t_len, t_hi = transpose_next(
        k_lat, vt, kv_ready, kv_empty, 0, meta_ptr, seqlens_ptr, max_pages,
        *part_start(meta_ptr, seqlens_ptr, max_pages, begin_req, end_req), begin_req, end_req, WG)
    it = 0
    n_req = 0
    # nothing hoisted out of the request loop: with 32 rows, under the 128 registers a PV warpgroup gets, a value
    # kept across all requests was spilled to local memory
    for req in tl.range(begin_req, end_req + 1, disable_licm=True):
        seqlen, lo, hi = request_range(meta_ptr, seqlens_ptr, max_pages, req, begin_req, end_req)
        if lo < hi:
            o = warpgroup_mma_init(gl.zeros([HALF, ROWS], gl.float32, OT))
            for blk in range(lo, hi):
                pb = it % 2
                o = warpgroup_mma_wait(0, deps=[o])
                if blk > lo:
                    mbarrier.arrive(p_free.index(1 - pb))
                t_req, t_blk, t_ok, t_len, t_hi = transpose_next(k_lat, vt, kv_ready, kv_empty, it + 1, meta_ptr,
                                                                 seqlens_ptr, max_pages, t_req, t_blk, t_ok, t_len,
                                                                 t_hi, begin_req, end_req, WG)
                mbarrier.wait(p_ready.index(pb), (it // 2) & 1)
                alpha = alpha_smem.index(pb).load(gl.SliceLayout(0, OT))
                o = warpgroup_mma(vt.index(2 * WG + pb), p_smem.index(pb).permute((1, 0)), o * alpha[None, :],
                                  is_async=True)
                it += 1
            o = warpgroup_mma_wait(0, deps=[o])
            mbarrier.arrive(p_free.index((it - 1) % 2))

            # ---- epilogue: O^T * norm -> out (a request with one split) or its partial slot ----
            mbarrier.wait(epi_ready, n_req & 1)
            norm = norm_smem.load(gl.SliceLayout(0, OT))
            mbarrier.arrive(epi_free)
            direct, split = split_slot(meta_ptr, num_splits_ptr, req, begin_req)
            rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(0, OT))
            # O^T row n holds V dim WG * 256 + the transposes' d(n) (see hopper._transpose_chunk)
            n = gl.arange(0, HALF, gl.SliceLayout(1, OT))
            c = n % V_CHUNK
            dim = WG * HALF + (n - c) + ((c & 0xE0) | ((c & 7) << 2) | ((c >> 3) & 3))
            o = o * norm[None, :]
            ok = (rows < R)[None, :]
            if direct:
                gl.store(out_ptr + (req * R + rows).to(gl.int64)[None, :] * D_LATENT + dim[:, None],
                         o.to(gl.bfloat16), mask=ok)
            else:
                gl.store(o_part_ptr + (split.to(gl.int64) * R + rows)[None, :] * D_LATENT + dim[:, None], o,
                         mask=ok)
            n_req += 1


@gluon.jit
def mla_decode_hopper_small_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, scale_desc,
        block_table_ptr, stride_bt, max_pages, seqlens_ptr, meta_ptr, num_splits_ptr,
        out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, descale_q_ptr, descale_k_ptr, sm_scale_log2, H, S_Q, R,
        KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr):
    meta = meta_ptr + gl.program_id(0) * METADATA_WIDTH
    q_lat, q_rope, k_lat, k_rope, k_scale, vt, p_smem, alpha_smem, norm_smem = allocate_operands(
        ROWS, ring_pages(ROWS, KV_FORMAT), rope_desc, KV_FORMAT)
    red = gl.allocate_shared_memory(gl.float32, [2, 4, ROWS], RED_SMEM)    # per page parity, warp: row maxima
    red_scale = gl.allocate_shared_memory(gl.float32, [2, 4], VEC_SMEM)    # ... and the largest token scale
    kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free = init_barriers(k_lat.shape[0])

    gl.warp_specialize([
        (_softmax_wg, (q_ptr, stride_qb, stride_qs, stride_qh, seqlens_ptr, max_pages, meta, num_splits_ptr, lse_ptr,
                       lse_part_ptr, descale_q_ptr, descale_k_ptr, sm_scale_log2, H, S_Q, R, q_lat, q_rope, k_lat,
                       k_rope, k_scale, p_smem, alpha_smem, norm_smem, red, red_scale, kv_ready, kv_empty,
                       p_ready, p_free, epi_ready, epi_free, KV_FORMAT, Q_FP8, CAUSAL)),
        (_pv_wg, (max_pages, seqlens_ptr, meta, num_splits_ptr, out_ptr, o_part_ptr, H, S_Q, R, k_lat, vt, p_smem,
                  alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free, LEFT)),
        (_pv_wg, (max_pages, seqlens_ptr, meta, num_splits_ptr, out_ptr, o_part_ptr, H, S_Q, R, k_lat, vt, p_smem,
                  alpha_smem, norm_smem, kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free, RIGHT)),
        (_load_wg, (lat_desc, rope_desc, scale_desc, block_table_ptr, stride_bt, seqlens_ptr, max_pages, meta, k_lat,
                    k_rope, k_scale, kv_ready, kv_empty, KV_FORMAT)),
    ], [4, 4, 1], [PV_REGS_SMALL, PV_REGS_SMALL, LOAD_REGS])


_launch = CachedLauncher(mla_decode_hopper_small_kernel)


def rows_per_cta(rows: int) -> int | None:
    """The kernel's N for a call with `rows` = s_q * h_q query rows, None if it is hopper.py's (whose
    launch_hopper launches this kernel too, with the same arguments and ROWS)."""
    return 16 if rows <= 16 else 32 if rows <= MAX_ROWS else None

