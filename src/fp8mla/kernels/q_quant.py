"""A bf16 q quantized once per call for the 64-row Hopper kernel, each query row to e4m3 with a scale per row
(descale = amax / 448, 1 for a row of zeros; e4m3 = x * (1 / descale), rounded to nearest), rows in (request, s,
head) order:

- for the fp8_rope_bf16 cache (ROPE_FP8 False) the latent part only, its RoPE part kept bf16 for the BF16 RoPE
  product: one 640-byte row (512 e4m3, then the 64 bf16 in the last 128 bytes; the buffer is typed e4m3, as the
  kernel reads most of it);
- for the "fp8" cache (ROPE_FP8 True), whose RoPE keys are e4m3 anyway, the whole row (amax over all 576 values),
  so the RoPE product joins the latent one in a single FP8 accumulation: rows shaped like q.

Quantizing in the kernel instead costs every CTA of a request the same two passes over its 64 rows at the start
of the request, on the softmax warpgroup's critical path. The small-rows kernel does the same arithmetic there
(hopper/operands.load_q).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import formats
from .constants import D_LATENT, D_ROPE, FP8_MAX
from .launcher import ASK, CachedLauncher, scratch

BLOCK_ROWS = tl.constexpr(16)


@triton.jit
def quantize_rows(x, x_rope, ROPE_FP8: tl.constexpr):
    """Query rows [rows, 512] and their RoPE part [rows, 64] to e4m3 with a descale per row, amax / 448 (1 for a
    row of zeros), over the latent part and, with ROPE_FP8, the RoPE part too (which is otherwise left as it is):
    (latent e4m3, RoPE, descale [rows]). The portable kernel quantizes its rows with it too."""
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
def quantize_q_kernel(q_ptr, stride_qb, stride_qs, stride_qh, packed_ptr, row_bytes, descale_ptr, n_rows, S_Q, H,
                      ROPE_FP8: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ok = (rows < n_rows)[:, None]
    # query row = (request, s, head) flattened as the kernels number them (s * H + head within a request)
    src = (q_ptr + (rows // (S_Q * H)).to(tl.int64) * stride_qb + (rows // H % S_Q) * stride_qs
           + (rows % H) * stride_qh)[:, None]
    dst = packed_ptr + rows.to(tl.int64)[:, None] * row_bytes
    d = tl.arange(0, D_LATENT)[None, :]
    r = tl.arange(0, D_ROPE)[None, :]
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    x_rope = tl.load(src + D_LATENT + r, mask=ok, other=0.0)
    x, x_rope, descale = quantize_rows(x, x_rope, ROPE_FP8)
    tl.store(dst + d, x, mask=ok)
    if ROPE_FP8:
        tl.store(dst + D_LATENT + r, x_rope, mask=ok)
    else:
        tl.store((dst + D_LATENT).to(tl.pointer_type(tl.bfloat16)) + r, x_rope, mask=ok)
    tl.store(descale_ptr + rows, descale, mask=rows < n_rows)


_launch = CachedLauncher(quantize_q_kernel)


def plan_quantize_q(q: torch.Tensor, rope_fp8: bool):
    """(``quantize(q, key=None, site=ASK)``, the packed rows' strides of b, s and head) for q's of this q's shape
    and strides: see quantize_q."""
    b, s_q, h_q, _ = q.shape
    n_rows = b * s_q * h_q
    width = formats.D_LATENT + formats.D_ROPE * (1 if rope_fp8 else 2)
    buffers = (((b, s_q, h_q, width), torch.float8_e4m3fn), ((n_rows,), torch.float32))
    q_strides = q.stride()[:3]
    variant = _launch.variant(dict(ROPE_FP8=rope_fp8), num_warps=4)
    # (-(-n // m): triton.cdiv is a ConstexprFunction, ~3-5 us a call on the host)
    grid = (-(-n_rows // BLOCK_ROWS.value),)

    def quantize(q, key=None, site=ASK):
        packed, descale = scratch(q.device, *buffers)
        variant(grid, (q, *q_strides, packed, width, descale, n_rows, s_q, h_q), key, site)
        return packed, descale
    return quantize, (s_q * h_q * width, h_q * width, width)


def quantize_q(q: torch.Tensor, rope_fp8: bool, key=None, site=ASK) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, s_q, h_q, 576] bf16 -> (packed rows [b, s_q, h_q, 576 or 640] e4m3: the latent part, then the
    RoPE part, e4m3 (rope_fp8) or its bf16 bytes; each row's descale [b * s_q * h_q] fp32). ``key``, ``site``:
    the launcher's (launcher.CachedLauncher)."""
    return plan_quantize_q(q, rope_fp8)[0](q, key, site)
