"""Kernels: the portable Triton decode kernel, the Hopper Gluon kernel, the combine step and the cache writer.

``launch_decode`` is the one entry the API calls after it has validated every input.
"""
from __future__ import annotations

import torch

from ..api import interpreter_active
from ..formats import D_LATENT

if interpreter_active():
    from . import interpreter
    interpreter.apply()


def partial_dtype(kv_format: str) -> torch.dtype:
    """The dtype of split requests' partial O: bf16 for the FP8 formats (half the traffic of the partial stores and
    the combine's reads, far below their FP8 error), fp32 for bf16 (whose error is at bf16's own rounding)."""
    return torch.float32 if kv_format == "bf16" else torch.bfloat16


def launch_decode(backend, q, k_cache, kv_format, block_table, cache_seqlens, meta, num_splits, out, lse,
                  descale_q, descale_k, softmax_scale, causal):
    from .combine import launch_combine

    b, s_q, h_q, _ = q.shape
    # every part adds at most one split beyond the first of each request
    max_splits = b + meta.shape[0]
    o_part = torch.empty(max_splits, s_q * h_q, D_LATENT, dtype=partial_dtype(kv_format), device=q.device)
    lse_part = torch.empty(max_splits, s_q * h_q, dtype=torch.float32, device=q.device)
    if backend == "hopper":
        from .hopper import launch_hopper as launch
    else:
        from .portable import launch_portable as launch
    launch(q, k_cache, kv_format, block_table, cache_seqlens, meta, num_splits, out, lse, o_part, lse_part,
           descale_q, descale_k, softmax_scale, causal)
    launch_combine(out, lse, o_part, lse_part, num_splits)
