"""Portable split-KV MLA decode kernel in plain Triton (``tl``).

It runs on any NVIDIA GPU with FP8 tensor cores (and in the Triton interpreter), and is the fallback when the
Hopper kernel cannot be used. One program handles one part of the split-KV schedule (see ``schedule.py``) for
one block of query rows; rows fold as ``m = s * h_q + h`` so that all ``s_q * h_q`` query rows of a request share
each KV page it loads.

Arithmetic, per 64-token page:
  S  = q_lat . k_lat^T   (FP8 dot, scales applied after)  +  q_rope . k_rope^T   (BF16 dot; with the fp8 cache,
                                                             whose RoPE keys are e4m3, FP8 in the same dot)
  online softmax in fp32, base 2
  O += P . V             (FP8 dot; P is multiplied by each token's V scale and by 448 / max scale of the page
                          before the e4m3 cast, so it uses the whole FP8 range; the factor is undone in fp32)
``bf16`` caches run the same algorithm with BF16 dots and P in BF16. An ``fp8_ds_mla`` row's four descales (one
per 128 latent dims) become one per token as the page is loaded: each group is rescaled to the token's largest
descale and rounded to e4m3 again, exact for power-of-two descales but where a value falls to e4m3's subnormals
(below 2^-6 of the token's unit, a few thousandths of the group's largest value at a ratio of 32), and the page then
runs as ``fp8_rope_bf16``'s.

The sparse call (GATHER) is the same walk over a schedule whose requests are query tokens: a "page" is 64 of the
token's indices, each a cache row (page * 64 + offset), -1 skipped; only the first topk_length indices count.

Bad input never makes a load leave its tensor: pages past the block table's columns are not read, a block-table
entry outside the cache (an index below -1 or past the cache's rows, a topk_length outside [0, topk]) reads
nothing and, like a request whose page count is not what the schedule was planned for (hopper/ring.py's
planned_for), makes the request's out and lse NaN. A schedule get_mla_metadata did not write is clamped as
ring.py says.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import sparse_constexprs
from .combine import lse_offsets, sink_factor
from .constants import (BEGIN_PAGE, BEGIN_REQ, BEGIN_REQ_PAGES, BEGIN_SPLIT, BF16, D_LATENT, D_QK, D_ROPE, END_PAGE,
                        END_REQ, END_REQ_PAGES, FORMAT_CODE, FP8, FP8_DS_MLA, FP8_MAX, FP8_ROPE_BF16, GROUP, LN2, LOG2E,
                        METADATA_WIDTH, PAGE_SIZE, ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET)
from .launcher import CachedLauncher, planned

# Promote FP8 partial sums to fp32 every this many products: Hopper's FP8 MMA accumulates in reduced
# precision, which long contractions (and long contexts) would otherwise pay for.
FP8_PROMOTE_K = tl.constexpr(128)


@triton.jit
def quantize_rows(x, x_rope, ROPE_FP8: tl.constexpr):
    """A bf16 q's rows [rows, 512] and their RoPE part [rows, 64] to e4m3 with a descale per row, amax / 448 (1 for
    a row of zeros), over the latent part and, with ROPE_FP8, the RoPE part too (which is otherwise left as it is),
    as the Hopper kernels do it (hopper/operands.py): (latent e4m3, RoPE, descale [rows])."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if ROPE_FP8:
        amax = tl.maximum(amax, tl.max(tl.abs(x_rope.to(tl.float32)), axis=1))
    descale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    x = (x * (1.0 / descale)[:, None]).to(tl.float8e4nv)
    if ROPE_FP8:
        x_rope = (x_rope.to(tl.float32) * (1.0 / descale)[:, None]).to(tl.float8e4nv)
    return x, x_rope, descale


@triton.jit
def _load_rows(kv_ptr, row, tok_ok, KV_FORMAT: tl.constexpr):
    """64 cache rows (a page, or a sparse call's gathered tokens): (latent [64, 512], rope [64, 64], per-token
    latent descale [64] (1 if none))."""
    d = tl.arange(0, D_LATENT)
    r = tl.arange(0, D_ROPE)
    if KV_FORMAT >= FP8_ROPE_BF16:   # a 656-byte row with its descales
        base = kv_ptr + row * ROW_BYTES
        lat = tl.load((base[:, None] + d[None, :]).to(tl.pointer_type(tl.float8e4nv)), mask=tok_ok[:, None],
                      other=0.0)
        descales = (base + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
        rope = tl.load((base[:, None] + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16)) + r[None, :],
                       mask=tok_ok[:, None], other=0.0)
        if KV_FORMAT == FP8_DS_MLA:   # each dim's group descale, rescaled to the token's largest
            group = tl.load(descales[:, None] + (d // GROUP)[None, :], mask=tok_ok[:, None], other=0.0)
            unit = tl.max(group, axis=1)   # (0 for a token not read, as the other formats have it)
            lat = (lat.to(tl.float32) * (group / tl.where(unit > 0, unit, 1.0)[:, None])).to(tl.float8e4nv)
            return lat, rope, unit
        else:
            return lat, rope, tl.load(descales, mask=tok_ok, other=0.0)
    else:
        base = kv_ptr + row * D_QK
        lat = tl.load(base[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        rope = tl.load(base[:, None] + D_LATENT + r[None, :], mask=tok_ok[:, None], other=0.0)
        return lat, rope, tl.full([PAGE_SIZE], 1.0, tl.float32)


@triton.jit
def mla_decode_split_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh,
        kv_ptr, block_table_ptr, stride_bt, max_pages, num_pages, seqlens_ptr,
        meta_ptr, num_splits_ptr, B, SLOTS,
        out_ptr, lse_ptr, o_part_ptr, lse_part_ptr,
        descale_q_ptr, descale_k_ptr, sm_scale_log2,
        H, S_Q, Q_GROUP, topk_length_ptr, sink_ptr,
        KV_FORMAT: tl.constexpr, Q_FP8: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
        GATHER: tl.constexpr, HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr):
    """Q_GROUP: requests a batch entry of q, out and lse holds (1; a sparse call's s_q, its requests being query
    tokens, S_Q 1). GATHER: block_table is a sparse call's indices [requests, topk] (stride_bt its row stride), and
    seqlens topk each."""
    part = tl.program_id(0)
    R = H * S_Q
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    s_idx = rows // H
    h_idx = rows % H
    d = tl.arange(0, D_LATENT)
    r = tl.arange(0, D_ROPE)
    t = tl.arange(0, PAGE_SIZE)

    meta = meta_ptr + part * METADATA_WIDTH
    # (clamped: a schedule get_mla_metadata did not write reads no row outside its tensor)
    begin_req = tl.maximum(tl.load(meta + BEGIN_REQ), 0)
    begin_page = tl.maximum(tl.load(meta + BEGIN_PAGE), 0)
    end_req = tl.minimum(tl.load(meta + END_REQ), B - 1)
    end_page = tl.load(meta + END_PAGE)
    begin_split = tl.load(meta + BEGIN_SPLIT)
    begin_req_pages = tl.load(meta + BEGIN_REQ_PAGES)
    end_req_pages = tl.load(meta + END_REQ_PAGES)
    if KV_FORMAT == FP8:
        descale_k = tl.load(descale_k_ptr)
    else:
        descale_k = 1.0

    for req in range(begin_req, end_req + 1):
        seqlen = tl.load(seqlens_ptr + req)
        lo = tl.where(req == begin_req, begin_page, 0)
        hi = tl.minimum(tl.where(req == end_req, end_page, tl.cdiv(seqlen, PAGE_SIZE)), max_pages)
        if lo < hi:
            # a stale schedule (this part's first or last request of another page count) or, below, a page
            # outside the cache: the request's out and lse become NaN
            pages = tl.where(seqlen > 0, tl.cdiv(seqlen, PAGE_SIZE), 0)
            planned = tl.where(req == end_req, end_req_pages, tl.where(req == begin_req, begin_req_pages, pages))
            bad = planned != pages
            # ---- this request's query rows, quantized once ----
            entry = req // Q_GROUP
            q_rows = q_ptr + entry * stride_qb + (req - entry * Q_GROUP + s_idx) * stride_qs + h_idx * stride_qh
            q_lat = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
            q_rope = tl.load(q_rows[:, None] + D_LATENT + r[None, :], mask=row_ok[:, None], other=0.0)
            if Q_FP8:
                q_scale = tl.load(descale_q_ptr) * descale_k + tl.zeros([BLOCK_M], tl.float32)
            elif KV_FORMAT == BF16:
                q_scale = tl.full([BLOCK_M], 1.0, tl.float32)
            else:  # each row to e4m3 with its own scale; with the fp8 cache (e4m3 RoPE keys) the RoPE part too
                q_lat, q_rope, q_descale = quantize_rows(q_lat, q_rope, KV_FORMAT == FP8)
                q_scale = q_descale * descale_k

            counted = seqlen   # (GATHER: the indices that count)
            if HAS_TOPK_LENGTH:
                length = tl.load(topk_length_ptr + entry)
                bad |= (length < 0) | (length > seqlen)
                counted = tl.minimum(tl.maximum(length, 0), seqlen)
            # causal, bottom-right aligned: query token s sees keys [0, seqlen - (S_Q - 1 - s))
            if CAUSAL:
                key_limit = seqlen - (S_Q - 1 - s_idx)
            else:
                key_limit = tl.zeros([BLOCK_M], tl.int32) + seqlen
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_LATENT], tl.float32)
            v_unit = 1.0  # the V descale the accumulator is currently expressed in (FP8 formats)

            for blk in range(lo, hi):
                tok = blk * PAGE_SIZE + t
                if GATHER:   # each token's own row; -1 skipped, anything else outside the cache marks the request
                    idx = tl.load(block_table_ptr + req * stride_bt + tok, mask=tok < counted, other=-1)
                    outside = (idx < -1) | (idx >= num_pages.to(tl.int64) * PAGE_SIZE)
                    bad |= tl.max(outside.to(tl.int32), axis=0) > 0
                    tok_ok = (idx >= 0) & ~outside
                    row = tl.where(tok_ok, idx, 0).to(tl.int64)
                else:
                    page = tl.load(block_table_ptr + req * stride_bt + blk)
                    outside = (page < 0) | (page >= num_pages)
                    bad |= outside
                    tok_ok = (tok < seqlen) & ~outside
                    row = tl.where(outside, 0, page).to(tl.int64) * PAGE_SIZE + t
                k_lat, k_rope, k_scale = _load_rows(kv_ptr, row, tok_ok, KV_FORMAT)

                # ---- scores, in log2 units ----
                if KV_FORMAT == BF16:
                    s = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_rope, tl.trans(k_rope))
                else:
                    s = tl.dot(q_lat, tl.trans(k_lat), max_num_imprecise_acc=FP8_PROMOTE_K)
                    if KV_FORMAT >= FP8_ROPE_BF16:
                        s = s * q_scale[:, None] * k_scale[None, :] + tl.dot(q_rope, tl.trans(k_rope))
                    else:  # e4m3 q and cache throughout: one FP8 product
                        s = (s + tl.dot(q_rope, tl.trans(k_rope))) * q_scale[:, None]
                if GATHER:
                    visible = tok_ok[None, :] & row_ok[:, None]
                else:
                    visible = tok[None, :] < key_limit[:, None]
                s = tl.where(visible, s * sm_scale_log2, float("-inf"))

                # ---- online softmax (a row that has seen no key yet keeps m = -inf, p = 0) ----
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new

                # ---- O += P . V ----
                if KV_FORMAT == BF16:
                    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k_lat)
                else:
                    if KV_FORMAT >= FP8_ROPE_BF16:
                        page_unit = tl.maximum(tl.max(k_scale, axis=0), 1e-30)
                        p8 = (p * (k_scale * (FP8_MAX / page_unit))[None, :]).to(tl.float8e4nv)
                    else:
                        page_unit = 1.0
                        p8 = (p * FP8_MAX).to(tl.float8e4nv)
                    acc = acc * (alpha * (v_unit / page_unit))[:, None]
                    acc += tl.dot(p8, k_lat, max_num_imprecise_acc=PAGE_SIZE)
                    v_unit = page_unit

            # ---- write: the final result if this is the request's only split, else a partial ----
            if KV_FORMAT == BF16:
                o_scale = 1.0
            else:
                o_scale = v_unit * descale_k / FP8_MAX
            seen = l_i > 0
            o = acc * tl.where(bad, float("nan"), tl.where(seen, o_scale / l_i, 0.0))[:, None]
            lse = tl.where(seen, (m_i + tl.log2(l_i)) * LN2, float("inf"))
            split0 = tl.load(num_splits_ptr + req)
            n_splits = tl.load(num_splits_ptr + req + 1) - split0
            if n_splits == 1:
                if HAS_SINK:
                    o = o * sink_factor(lse, sink_ptr, h_idx, row_ok)[:, None]
                out_rows = out_ptr + (req * R + rows) * D_LATENT
                tl.store(out_rows[:, None] + d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
                tl.store(lse_ptr + lse_offsets(req, rows, H, S_Q, Q_GROUP), tl.where(bad, float("nan"), lse),
                         mask=row_ok)
            else:
                piece = tl.where(req == begin_req, begin_split, 0)
                split = split0 + piece
                # the request's own slot (none: a schedule planned for no pages, or not get_mla_metadata's, whose
                # request the combine marks)
                owned = (piece >= 0) & (piece < n_splits) & (split >= 0) & (split < SLOTS)
                part_rows = split.to(tl.int64) * R + rows
                tl.store(o_part_ptr + part_rows[:, None] * D_LATENT + d[None, :], o, mask=row_ok[:, None] & owned)
                lse = tl.where(bad, float("nan"), tl.where(seen, lse, float("-inf")))
                tl.store(lse_part_ptr + part_rows, lse, mask=row_ok & owned)


def block_m_for(rows: int) -> int:
    """Query rows per program: 64, or the next power of two >= 16 for fewer rows."""
    return 64 if rows >= 64 else max(16, 1 << (rows - 1).bit_length())   # (triton.next_power_of_2: ~3-5 us)


_launch = CachedLauncher(mla_decode_split_kernel)


def _plan_portable(call, parts):
    b, s_q, h_q = call.shape
    gather = call.gather
    block_m = block_m_for(call.rows)
    grid = (parts, -(-call.rows // block_m))   # (triton.cdiv: ~3-5 us a call on the host)
    variant = _launch.variant(dict(KV_FORMAT=FORMAT_CODE[call.kv_format], Q_FP8=call.q.dtype != call.out.dtype,
                                   CAUSAL=call.causal, BLOCK_M=block_m, **sparse_constexprs(gather)),
                              num_warps=8 if block_m == 64 else 4, num_stages=1)
    q_strides = call.q.stride()[:3]
    table = (call.block_table.stride(0), call.max_pages, call.k_cache.shape[0])
    batch = (b, b + parts)   # requests, split slots
    sizes = (call.softmax_scale * LOG2E.value, h_q, s_q, 1 if gather is None else gather.s_q)

    def launch(call, o_part, lse_part, site):
        dummy = call.cache_seqlens  # never read: placeholders for absent tensors
        gather = call.gather or (None, None, None)
        variant(grid, (call.q, *q_strides, call.k_cache, call.block_table, *table, call.cache_seqlens, call.meta,
                       call.num_splits, *batch, call.out, call.lse, o_part, lse_part,
                       dummy if call.descale_q is None else call.descale_q,
                       dummy if call.descale_k is None else call.descale_k, *sizes,
                       *(dummy if t is None else t for t in gather[1:])), call.signature, site)
    return launch


def launch_portable(call, o_part, lse_part, site):
    planned(_plan_portable, call, call.meta.shape[0])(call, o_part, lse_part, site)
