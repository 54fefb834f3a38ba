"""The FP8 kernels' shared-memory operands, and each request's query rows into them.

A request's query rows are q's ``s_q * h_q`` rows (row r = s * h_q + h); ``q_rows`` stands for where a CTA's block
of them is: (the request's q pointer, stride of s, stride of h, h_q, s_q * h_q); rows past s_q * h_q are zeros.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from ..constants import D_LATENT, D_ROPE, FP8_DS_MLA, FP8_MAX, FP8_ROPE_BF16, GROUPS, PAGE_SIZE
from ..triton_compat import cp_async_load, reinterpret
from .layouts import HALF, LAT_SMEM, P_SMEM, Q_CHUNK, Q_LOAD, SCALE_COLS, SCALE_SMEM, VEC_SMEM, VT_SMEM

# what load_q finds at q's pointer
Q_AS_IS = gl.constexpr(0)      # q in q_lat's dtype (an e4m3 q in the FP8 kernels, a bf16 q in bf16.py): copied
Q_QUANTIZE = gl.constexpr(1)   # a bf16 q in the FP8 kernels: quantized (fp8.py's by quantize_half)


@triton.constexpr_function
def p_groups(kv_format):
    """P tiles a page: fp8_ds_mla's P.V takes one a latent group (P times that group's token scales), else one."""
    return GROUPS.value if kv_format == FP8_DS_MLA else 1


@gluon.jit
def allocate_operands(ROWS: gl.constexpr, RING: gl.constexpr, rope_desc, KV_FORMAT: gl.constexpr,
                      P_BUFS: gl.constexpr = 2):
    """Shared memory of the FP8 kernels' operands: q (latent e4m3; RoPE e4m3 with the fp8 cache, bf16 with
    fp8_rope_bf16), a ring of RING pages (latent, RoPE, fp8_rope_bf16's token scales), V^T (2 halves x 2 pages),
    and the softmax warpgroup's hand-offs: P as [rows, tokens] (p_groups a page) and the rows' rescale factors
    (P_BUFS pages), the rows' O scale. Unused operands alias a used one."""
    q_lat = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, D_LATENT], LAT_SMEM)
    q_rope = gl.allocate_shared_memory(rope_desc.dtype, [ROWS, D_ROPE], rope_desc.layout)
    k_lat = gl.allocate_shared_memory(gl.float8e4nv, [RING, PAGE_SIZE, D_LATENT], LAT_SMEM)
    k_rope = gl.allocate_shared_memory(rope_desc.dtype, [RING, PAGE_SIZE, D_ROPE], rope_desc.layout)
    if KV_FORMAT >= FP8_ROPE_BF16:
        k_scale = gl.allocate_shared_memory(gl.float32, [RING, PAGE_SIZE, SCALE_COLS], SCALE_SMEM)
    else:
        k_scale = k_rope
    vt = gl.allocate_shared_memory(gl.float8e4nv, [4, HALF, PAGE_SIZE], VT_SMEM)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [P_BUFS * p_groups(KV_FORMAT), ROWS, PAGE_SIZE], P_SMEM)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [P_BUFS, ROWS], VEC_SMEM)
    norm_smem = gl.allocate_shared_memory(gl.float32, [ROWS], VEC_SMEM)
    return q_lat, q_rope, k_lat, k_rope, k_scale, vt, p_smem, alpha_smem, norm_smem


@gluon.jit
def q_base(query, req, sparse, GATHER: gl.constexpr):
    """Where request req's query rows start: batch entry req's; a sparse call's (GATHER) query token req, Q_GROUP
    (s_q) of them an entry. sparse: (Q_GROUP, topk_length_ptr, sink_ptr)."""
    q_ptr, stride_qb, stride_qs, _ = query
    if GATHER:
        entry = req // sparse[0]
        return q_ptr + entry * stride_qb + (req - entry * sparse[0]) * stride_qs
    else:
        return q_ptr + req * stride_qb


@gluon.jit
def load_q(q_rows, q_lat, q_rope, SOURCE: gl.constexpr, q_lo=None):
    """One request's query rows (as many as q_lat has) into shared memory; returns each row's descale (1 for
    Q_AS_IS).

    SOURCE: Q_AS_IS or Q_QUANTIZE (each row to e4m3 with a scale per row, amax / 448: the latent part, and the
    RoPE part too where q_rope is e4m3; at most 32 rows, the small-rows kernel's: the 64-row kernel's PV
    warpgroups quantize its rows, half each, by quantize_half). With q_lo, Q_QUANTIZE also stores the latent
    part's rounding error in the same unit, as e4m3 (q = (hi + lo) * descale to ~7 bits, not e4m3's 4: a second
    FP8 product with the same K adds it).
    This code is on the critical path of every request's start: Q_QUANTIZE reads the tile once, whole; Q_AS_IS is
    copied by cp.async, every copy issued before the one wait (one trip to memory, no registers held).
    """
    ROWS: gl.constexpr = q_lat.shape[0]
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, Q_LOAD))
    if SOURCE == Q_QUANTIZE:
        descale = _quantize_rows(q_rows, rows, q_lat, q_rope, q_lo)
    else:
        descale = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, Q_LOAD))
        # q_lat as its column chunks (a swizzled tile is stored swizzle-width column block by block, so chunk c is
        # [c]), indexed at run time so that the loop stays a loop (once-per-request code runs from a cold
        # instruction cache)
        N_CHUNKS: gl.constexpr = D_LATENT // Q_CHUNK
        chunks = reinterpret(q_lat, q_lat.dtype, [N_CHUNKS, ROWS, Q_CHUNK], q_lat.layout)
        for c in range(N_CHUNKS):
            _copy_rows_async(chunks.index(c), q_rows, c * Q_CHUNK)
        _copy_rows_async(q_rope, q_rows, D_LATENT)
        async_copy.commit_group()
        async_copy.wait_group(0)
    fence_async_shared()
    return descale


@gluon.jit
def quantize_half(q_rows, q_lat, q_rope, descale_smem, WG: gl.constexpr, q_lo=None):
    """A PV warpgroup's share of a bf16 q's quantization in the 64-row kernel (fp8.py): the CTA's rows 32 WG to
    32 WG + 31 into those rows of q_lat and q_rope (and of q_lo, as load_q's), their descales into descale_smem;
    then fenced for the softmax warpgroup's wgmma. Two warpgroups each hold half the tile in registers, read once
    (64 rows in one warpgroup made ptxas spill, and two passes over column chunks cost the softmax warpgroup's start
    its time)."""
    ROWS: gl.constexpr = q_lat.shape[0] // 2
    rows = gl.program_id(1) * q_lat.shape[0] + WG * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, Q_LOAD))
    lo = q_lo
    if q_lo is not None:
        lo = q_lo.slice(WG * ROWS, ROWS)
    descale = _quantize_rows(q_rows, rows, q_lat.slice(WG * ROWS, ROWS), q_rope.slice(WG * ROWS, ROWS), lo)
    descale_smem.slice(WG * ROWS, ROWS).store(descale)
    fence_async_shared()


@gluon.jit
def _quantize_rows(q_rows, rows, q_lat, q_rope, q_lo=None):
    """Q_QUANTIZE of the request's query rows ``rows`` (at most 32: at most 128 latent values a thread, read once,
    whole) into q_lat and q_rope (and the latent part's rounding error into q_lo); returns their descales."""
    q_ptr, stride_qs, stride_qh, H, R = q_rows
    row_ptr = (q_ptr + (rows // H) * stride_qs + (rows % H) * stride_qh)[:, None]
    ok = (rows < R)[:, None]
    x = gl.load(row_ptr + gl.arange(0, D_LATENT, gl.SliceLayout(0, Q_LOAD))[None, :], mask=ok, other=0.0)
    rope_ptr = _rope_ptr(row_ptr)
    amax = gl.max(gl.abs(x.to(gl.float32)), axis=1)
    ROPE_FP8: gl.constexpr = q_rope.dtype == gl.float8e4nv   # (the fp8 cache: one scale for the whole row)
    if ROPE_FP8:
        x_rope = gl.load(rope_ptr, mask=ok, other=0.0)
        amax = gl.maximum(amax, gl.max(gl.abs(x_rope.to(gl.float32)), axis=1))
    descale = gl.where(amax > 0, amax / FP8_MAX, 1.0)   # (1 for a row of zeros)
    y = x.to(gl.float32) * (1.0 / descale)[:, None]
    hi = y.to(gl.float8e4nv)
    q_lat.store(hi)
    if q_lo is not None:
        q_lo.store((y - hi.to(gl.float32)).to(gl.float8e4nv))
    if ROPE_FP8:
        q_rope.store((x_rope.to(gl.float32) * (1.0 / descale)[:, None]).to(gl.float8e4nv))
    else:
        q_rope.store(gl.load(rope_ptr, mask=ok, other=0.0))
    return descale


@gluon.jit
def _rope_ptr(row_ptr):
    return row_ptr + D_LATENT + gl.arange(0, D_ROPE, gl.SliceLayout(0, Q_LOAD))[None, :]   # [rows, 64]


@gluon.jit
def _copy_rows_async(dst, q_rows, col0):
    """cp.async of the CTA's query rows into dst, 16 bytes a copy, from column col0 (of q's element type) on, read
    as dst's dtype; rows past R are zero-filled."""
    q_ptr, stride_qs, stride_qh, H, R = q_rows
    ROWS: gl.constexpr = dst.shape[0]
    COLS: gl.constexpr = dst.shape[1]
    VEC: gl.constexpr = 128 // dst.dtype.primitive_bitwidth
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 * VEC // COLS, COLS // VEC],
                                            warps_per_cta=[4, 1], order=[1, 0])
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    row_ptr = (q_ptr + (rows // H) * stride_qs + (rows % H) * stride_qh + col0).to(gl.pointer_type(dst.dtype))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    cp_async_load(dst, row_ptr[:, None] + cols[None, :], mask=(rows < R)[:, None])
