"""Cache writer kernel: one program per new token, writing its row into the paged cache (see formats.py; for the
656-byte formats a descale per row, ``"fp8_rope_bf16"``, stored in all four slots, or per 128 dims,
``"fp8_ds_mla"``)."""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import (D_LATENT, D_QK, D_ROPE, FORMAT_CODE, FP8, FP8_DS_MLA, FP8_MAX, FP8_ROPE_BF16, GROUP, GROUPS,
                        ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET)
from .launcher import CachedLauncher


EXPONENT_MASK = tl.constexpr(0x7F800000)  # float32 exponent field
EXPONENT_ONE = tl.constexpr(0x00800000)   # 1 in that field


@triton.jit
def write_kv_cache_kernel(kv_c_ptr, stride_c, k_pe_ptr, stride_pe, cache_ptr, num_slots, slot_ptr, descale_k_ptr,
                          KV_FORMAT: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):  # negative slots are padding; slots past the cache are skipped too
        d = tl.arange(0, D_LATENT)
        r = tl.arange(0, D_ROPE)
        rope = tl.load(k_pe_ptr + tok.to(tl.int64) * stride_pe + r).to(tl.float32)
        if (KV_FORMAT == FP8_ROPE_BF16) | (KV_FORMAT == FP8_DS_MLA):
            row = cache_ptr + slot * ROW_BYTES
            g = tl.arange(0, GROUPS)
            dims = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]   # the latent row as [groups, 128]
            lat = tl.load(kv_c_ptr + tok.to(tl.int64) * stride_c + dims).to(tl.float32)
            amax = tl.max(tl.abs(lat), axis=1)   # [groups]
            if KV_FORMAT == FP8_ROPE_BF16:       # one descale for the row, stored in every group's slot
                amax = tl.zeros([GROUPS], tl.float32) + tl.max(amax, axis=0)
            # formats.token_descale: the power of two just above amax / 448 (exponent field + 1)
            bits = (amax / FP8_MAX).to(tl.int32, bitcast=True)
            pow2 = ((bits & EXPONENT_MASK) + EXPONENT_ONE).to(tl.float32, bitcast=True)
            descale = tl.where(amax > 0, pow2, 1.0)
            q = tl.clamp(tl.div_rn(lat, descale[:, None]), -FP8_MAX, FP8_MAX)
            tl.store((row + dims).to(tl.pointer_type(tl.float8e4nv)), q.to(tl.float8e4nv))
            tl.store((row + SCALE_OFFSET).to(tl.pointer_type(tl.float32)) + g, descale)
            tl.store((row + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16)) + r, rope.to(tl.bfloat16))
        else:
            lat = tl.load(kv_c_ptr + tok.to(tl.int64) * stride_c + d).to(tl.float32)
            row = cache_ptr + slot * D_QK
            if KV_FORMAT == FP8:
                descale = tl.load(descale_k_ptr)
                tl.store(row + d, tl.clamp(tl.div_rn(lat, descale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv))
                tl.store(row + D_LATENT + r, tl.clamp(tl.div_rn(rope, descale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv))
            else:
                tl.store(row + d, lat.to(tl.bfloat16))
                tl.store(row + D_LATENT + r, rope.to(tl.bfloat16))

_launch = CachedLauncher(write_kv_cache_kernel)


def launch_write_kv_cache(kv_c, k_pe, k_cache, slot_mapping, kv_format, descale_k):
    _launch((kv_c.shape[0],), (kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), k_cache, k_cache.shape[0] * k_cache.shape[1],
                               slot_mapping, descale_k if descale_k is not None else slot_mapping),
            dict(KV_FORMAT=FORMAT_CODE[kv_format]), num_warps=4)
