"""A bf16 q quantized once per call for the 64-row Hopper kernel: each query row's latent part to e4m3 with a scale
per row, its RoPE part kept bf16, packed in one 640-byte row (512 e4m3, then 64 bf16 in the last 128 bytes; the
buffer is typed e4m3, as the kernel reads most of it).

Quantizing in the kernel instead costs every CTA of a request the same two passes over its 64 rows at the start
of the request, on the softmax warpgroup's critical path. The arithmetic is the one the small-rows kernel uses
(hopper_common.load_q): descale = amax / 448 (1 for a row of zeros), e4m3 = x * (1 / descale), rounded to nearest.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import formats
from .constants import D_LATENT, D_ROPE, FP8_MAX
from .launcher import CachedLauncher

BLOCK_ROWS = tl.constexpr(16)
Q_ROW_BYTES = tl.constexpr(formats.D_LATENT + 2 * formats.D_ROPE)   # a packed row: e4m3 latent, bf16 RoPE


@triton.jit
def quantize_q_kernel(q_ptr, stride_qb, stride_qs, stride_qh, packed_ptr, descale_ptr, n_rows, S_Q, H):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ok = (rows < n_rows)[:, None]
    # query row = (request, s, head) flattened as the kernels number them (s * H + head within a request)
    src = (q_ptr + (rows // (S_Q * H)).to(tl.int64) * stride_qb + (rows // H % S_Q) * stride_qs
           + (rows % H) * stride_qh)[:, None]
    dst = packed_ptr + rows.to(tl.int64)[:, None] * Q_ROW_BYTES
    d = tl.arange(0, D_LATENT)[None, :]
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    descale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    tl.store(dst + d, (x * (1.0 / descale)[:, None]).to(tl.float8e4nv), mask=ok)
    r = tl.arange(0, D_ROPE)[None, :]
    tl.store((dst + D_LATENT).to(tl.pointer_type(tl.bfloat16)) + r, tl.load(src + D_LATENT + r, mask=ok), mask=ok)
    tl.store(descale_ptr + rows, descale, mask=rows < n_rows)


_launch = CachedLauncher(quantize_q_kernel)


def quantize_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, s_q, h_q, 576] bf16 -> (packed rows [b, s_q, h_q, 640] e4m3: the latent part, then the bf16 RoPE part's
    bytes; each row's latent descale [b * s_q * h_q] fp32, rows in (request, s, head) order)."""
    b, s_q, h_q, _ = q.shape
    n_rows = b * s_q * h_q
    packed = torch.empty(b, s_q, h_q, Q_ROW_BYTES.value, dtype=torch.float8_e4m3fn, device=q.device)
    descale = torch.empty(n_rows, dtype=torch.float32, device=q.device)
    stride_b, stride_s, stride_h, _ = q.stride()
    # (-(-n // m): triton.cdiv is a ConstexprFunction, ~2 us a call on the host)
    _launch((-(-n_rows // BLOCK_ROWS.value),),
            (q, stride_b, stride_s, stride_h, packed, descale, n_rows, s_q, h_q), {}, num_warps=4)
    return packed, descale
