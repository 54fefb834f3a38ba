"""Engine-facing entry points with the signatures serving engines call today, built on fp8mla's API.

FlashMLA's own ``get_mla_metadata`` / ``flash_mla_with_kvcache`` are :mod:`fp8mla.api`'s. This module adds vLLM's:

* ``get_mla_metadata_dense_fp8`` and ``flash_mla_with_kvcache_fp8``: the dense-FP8 FlashMLA calls of
  ``vllm/v1/attention/ops/flashmla.py`` (vllm-project/vllm, read at commit 055e47c2), same argument order and
  defaults; vLLM passes ``k_cache`` as ``[blocks, 64, 1, 576]`` e4m3 and ``descale_q``/``descale_k`` as ``[1]``.
* ``concat_and_cache_mla``: the cache writer ``vllm._custom_ops.concat_and_cache_mla`` (same commit era), with its
  ``kv_cache_dtype`` strings (``"fp8_ds_mla"``: DeepSeek V3.2's 656-byte cache) plus fp8mla's ``"fp8_rope_bf16"``.

vLLM's sparse backend calls FlashMLA's ``flash_mla_with_kvcache`` with ``indices`` (and ``is_fp8_kvcache``,
``topk_length``, ``attn_sink``) by keyword: :func:`fp8mla.flash_mla_with_kvcache` takes that call as it is.

Like the kernels they replace, none of them reads anything back to the host, so they can be captured in a CUDA
graph and called per layer without a stall (the decode skips fp8mla's block-table validation).
"""
from __future__ import annotations

import torch

from .api import flash_mla_with_kvcache, get_mla_metadata, write_kv_cache
from .formats import FP8_DTYPE

# vLLM's cache dtype names -> fp8mla's format names ("auto": the model's dtype, which must be bf16 here)
KV_CACHE_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8",
                   "fp8_rope_bf16": "fp8_rope_bf16", "fp8_ds_mla": "fp8_ds_mla"}


def get_mla_metadata_dense_fp8(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int,
                               num_heads_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's metadata call for the dense-FP8 decode: the same schedule as :func:`fp8mla.get_mla_metadata`."""
    return get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)


def flash_mla_with_kvcache_fp8(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                               num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                               descale_q: torch.Tensor | None = None,
                               descale_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dense-FP8 FlashMLA decode: ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32)``.

    ``q`` is e4m3 with ``descale_q`` (or bf16 without it), ``k_cache`` the ``"fp8"`` format with ``descale_k``
    (value = fp8 * descale). ``softmax_scale`` defaults to ``576 ** -0.5`` as in vLLM.
    """
    return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal, descale_q, descale_k, kv_format="fp8",
                                  validate=False)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_cache_dtype: str, scale: torch.Tensor) -> None:
    """vLLM's MLA cache writer: token ``i``'s ``kv_c[i]`` (512) and ``k_pe[i]`` (64) go to row ``slot_mapping[i]``.

    kv_cache: vLLM's ``[blocks, 64, row]`` (or fp8mla's ``[blocks, 64, 1, row]``); FP8 caches may be the uint8
        storage vLLM allocates. kv_cache_dtype: ``"auto"`` (bf16 cache), ``"fp8"``/``"fp8_e4m3"`` (per-tensor
        ``scale``, value = fp8 * scale), ``"fp8_rope_bf16"`` (a descale per token in the cache) or ``"fp8_ds_mla"``
        (a descale per 128 latent dims in the cache); ``scale`` is unused but for ``"fp8"``.
    Only the first ``slot_mapping.shape[0]`` tokens are written: as in vLLM, ``kv_c``/``k_pe`` may carry CUDA-graph
    padding after them. Negative slots are skipped.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    kv_format = KV_CACHE_DTYPES[kv_cache_dtype]
    cache = kv_cache.unsqueeze(2) if kv_cache.dim() == 3 else kv_cache
    if kv_format == "fp8" and cache.dtype == torch.uint8:
        cache = cache.view(FP8_DTYPE)
    descale_k = scale.reshape(1).float() if kv_format == "fp8" else None
    num_tokens = slot_mapping.shape[0]
    write_kv_cache(kv_c[:num_tokens], k_pe[:num_tokens], cache, slot_mapping, kv_format, descale_k)


__all__ = ["KV_CACHE_DTYPES", "concat_and_cache_mla", "flash_mla_with_kvcache_fp8", "get_mla_metadata_dense_fp8"]
