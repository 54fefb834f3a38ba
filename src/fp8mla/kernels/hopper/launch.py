"""The Hopper kernels' host side: the cache's TMA descriptors, and one launch function per decoder of the dispatch
table (kernels/__init__.py), each taking a checks.DecodeCall and the split buffers, and launching the plan of the
call's signature (launcher.planned: grid, strides, sizes and constexprs worked out once)."""
from __future__ import annotations

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import formats
from .. import sparse_constexprs
from ..constants import FORMAT_CODE, LOG2E
from ..launcher import CachedLauncher, planned
from .bf16 import K_BOX, mla_decode_hopper_bf16_kernel
from .fp8 import mla_decode_hopper_kernel
from .layouts import BLOCK_M, LAT_BF16_SMEM, LAT_SMEM, ROPE_BF16_SMEM, ROPE_FP8_SMEM, SCALE_COLS, SCALE_SMEM
from .small import mla_decode_hopper_small_kernel, rows_per_cta

ABLATE = 0   # ablations.py's flags for the 64-row kernels: 0 in every real call (hopper_check.py --ablate sets it)
_launch_fp8 = CachedLauncher(mla_decode_hopper_kernel)
_launch_small = CachedLauncher(mla_decode_hopper_small_kernel)
_launch_bf16 = CachedLauncher(mla_decode_hopper_bf16_kernel)
_descriptors: dict = {}


def cache_descriptors(k_cache: torch.Tensor, kv_format: str):
    """TMA descriptors of a cache's latent, RoPE and scale columns (the scale's is the RoPE's where the format has
    none), built once per cache tensor."""
    key = (k_cache.data_ptr(), k_cache.shape, kv_format)
    if key not in _descriptors:
        rows = k_cache.shape[0] * formats.PAGE_SIZE
        lat_cols = formats.D_LATENT   # the latent part's columns per TMA box
        if kv_format == "bf16":
            flat = k_cache.view(rows, formats.D_QK)
            lat, rope = flat[:, :formats.D_LATENT], flat[:, formats.D_LATENT:]
            scale = None
            lat_layout, rope_layout = LAT_BF16_SMEM, ROPE_BF16_SMEM
            lat_cols = K_BOX.value   # loaded box by box (bf16._load_page)
        elif kv_format in formats.TOKEN_SCALED:   # (fp8_ds_mla's are only the gather ring's q_rope type)
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


def fp8_launch(variant, grid, call):
    """``launch(call, o_part, lse_part, site)``: an FP8 kernel's launch (fp8.py's and small.py's parameters are
    the same, the sparse call's last: the cache's bytes, Q_GROUP, topk_length, attn_sink; a bf16 q is quantized in
    the kernel) for calls of ``call``'s signature."""
    b, s_q, h_q = call.shape
    kv_format = call.kv_format
    gather = call.gather
    table = (call.block_table.stride(0), call.max_pages, call.k_cache.shape[0])
    batch = (b, b + grid[0])   # requests, split slots (one a part beyond the first of each request)
    sizes = (call.softmax_scale * LOG2E.value, h_q, s_q, call.rows)
    q_strides = call.q.stride()[:3]

    q_group = 1 if gather is None else gather.s_q

    def launch(call, o_part, lse_part, site):
        dummy = call.cache_seqlens  # never read: placeholders for absent tensors
        topk_length, sink = (None, None) if call.gather is None else call.gather[1:]
        extra = (call.k_cache, q_group, dummy if topk_length is None else topk_length, dummy if sink is None else sink)
        variant(grid, (call.q, *q_strides, *cache_descriptors(call.k_cache, kv_format), call.block_table, *table,
                       call.cache_seqlens, call.meta, call.num_splits, *batch, call.out, call.lse, o_part, lse_part,
                       dummy if call.descale_q is None else call.descale_q,
                       dummy if call.descale_k is None else call.descale_k, *sizes, *extra), call.signature, site)
    return launch


def _fp8_constexprs(call) -> dict:
    """The FP8 kernels' constexprs for a call (its pages from the block table, or a sparse call's gathered)."""
    return dict(KV_FORMAT=FORMAT_CODE[call.kv_format], Q_FP8=call.q.dtype != torch.bfloat16, CAUSAL=call.causal,
                **sparse_constexprs(call.gather))


def fp8_kernel_constexprs(call, ablate: int = 0) -> dict:
    """fp8.py's kernel's constexprs for a call."""
    return {**_fp8_constexprs(call), "ABLATE": ablate}


def _plan_fp8(call, parts, ablate):
    """fp8.py's kernel: 64 query rows a CTA."""
    variant = _launch_fp8.variant(fp8_kernel_constexprs(call, ablate), num_warps=4)
    return fp8_launch(variant, (parts, -(-call.rows // BLOCK_M.value)), call)


def _plan_small(call, parts):
    """small.py's kernel: the call's query rows as the wgmma's N, 16 or 32 a CTA (more than 32: sparse
    fp8_ds_mla's, hopper_small_sparse_wide)."""
    rows = rows_per_cta(call.rows)
    variant = _launch_small.variant({**_fp8_constexprs(call), "ROWS": rows}, num_warps=4)
    return fp8_launch(variant, (parts, -(-call.rows // rows)), call)


def _plan_bf16(call, parts, ablate):
    """bf16.py's kernel: 64 query rows a CTA."""
    b, s_q, h_q, _ = call.q.shape
    variant = _launch_bf16.variant(dict(CAUSAL=call.causal, ABLATE=ablate), num_warps=4)
    grid = (parts, -(-call.rows // BLOCK_M.value))
    q_strides = call.q.stride()[:3]
    table = (call.block_table.stride(0), call.block_table.shape[1], call.k_cache.shape[0])
    batch = (b, b + parts)   # requests, split slots
    sizes = (call.softmax_scale * LOG2E.value, h_q, s_q)

    def launch(call, o_part, lse_part, site):
        lat_desc, rope_desc, _ = cache_descriptors(call.k_cache, "bf16")
        variant(grid, (call.q, *q_strides, lat_desc, rope_desc, call.block_table, *table, call.cache_seqlens,
                       call.meta, call.num_splits, *batch, call.out, call.lse, o_part, lse_part, *sizes), call.signature,
                 site)
    return launch


def launch_fp8(call, o_part, lse_part, site):
    planned(_plan_fp8, call, call.meta.shape[0], ABLATE)(call, o_part, lse_part, site)


def launch_small(call, o_part, lse_part, site):
    planned(_plan_small, call, call.meta.shape[0])(call, o_part, lse_part, site)


def launch_bf16(call, o_part, lse_part, site):
    planned(_plan_bf16, call, call.meta.shape[0], ABLATE)(call, o_part, lse_part, site)


LAUNCH = {"hopper": launch_fp8, "hopper_sparse": launch_fp8, "hopper_small": launch_small,
          "hopper_small_sparse": launch_small, "hopper_small_sparse_wide": launch_small, "hopper_bf16": launch_bf16}
