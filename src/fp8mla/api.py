"""The public API: FlashMLA's calls (and vLLM's dense-FP8 variant through :mod:`fp8mla.compat`), each reading as
check (checks.py) -> select (kernels.select) -> launch."""
from __future__ import annotations

import torch

from . import checks, kernels   # (kernels/__init__ imports no Triton: __main__ may still switch the interpreter on)
from .formats import D_LATENT, D_ROPE
from .runtime import interpreter_active
from .schedule import MLASchedule, plan


def get_mla_metadata(cache_seqlens: torch.Tensor | None = None, num_q_tokens_per_head_k: int | None = None,
                     num_heads_k: int | None = None, num_heads_q: int | None = None, is_fp8_kvcache: bool = False,
                     topk: int | None = None, *, num_parts: int | None = None):
    """``(tile_scheduler_metadata [num_parts, 8] int32, num_splits [b + 1] int32)`` for one decode step.

    ``num_q_tokens_per_head_k`` is ``s_q * h_q // h_kv`` (the query rows that share one KV head) and
    ``num_heads_k`` must be 1 (MLA has one latent KV head). Build it once per step and reuse it for every
    layer, as with FlashMLA: one kernel launch, no host synchronisation (CUDA-graph safe). The decode kernels follow
    the schedule, so launch it on the decode's stream (or make that stream wait for it): a decode that reads it
    before it is written gets NaN for the requests it does not cover (the kernels check it, reading nothing outside
    a tensor). ``num_parts`` (default: one per SM and row block) fixes the
    number of parts and turns off the choice of pieces (:mod:`fp8mla.schedule`). A negative seqlen plans no pages,
    and the decode marks that request NaN.

    ``get_mla_metadata()`` with no arguments is FlashMLA's current convention: ``(MLASchedule(), None)``, a
    schedule the first decode call plans for its batch (:class:`fp8mla.schedule.MLASchedule`). So is a call with
    ``topk`` (FlashMLA's sparse form, ``num_heads_q`` and ``is_fp8_kvcache`` accepted as it has them): a sparse
    call's schedule depends on b, s_q, h_q and topk only, and its first decode call plans it.
    """
    if cache_seqlens is None or topk is not None:
        return MLASchedule(), None
    signature = checks.check_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_parts)
    if cache_seqlens.shape[0] == 0 or (not cache_seqlens.is_cuda and not interpreter_active()):
        return plan(cache_seqlens, num_q_tokens_per_head_k, num_parts)   # (the same schedule, in torch ops)
    return kernels.lazy("planner").launch_plan(cache_seqlens, num_q_tokens_per_head_k, num_parts, signature)


def _planned(call: checks.DecodeCall, decoder: kernels.Decoder) -> checks.DecodeCall:
    """The call with its MLASchedule planned for its decoder (kept while the batch's configuration holds)."""
    schedule = call.meta
    config = (call.cache_seqlens.shape[0], call.rows, call.q.device,
              None if call.gather is None else call.block_table.shape[1], decoder)
    if schedule.config != config:
        schedule.tile_scheduler_metadata, schedule.num_splits = get_mla_metadata(
            call.cache_seqlens, call.rows, 1, num_parts=kernels.schedule_parts(decoder, call.q.device, call.rows))
        schedule.config = config
    return call._replace(meta=schedule.tile_scheduler_metadata, num_splits=schedule.num_splits)


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int,
                           tile_scheduler_metadata: torch.Tensor | MLASchedule, num_splits: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = False,
                           descale_q: torch.Tensor | None = None, descale_k: torch.Tensor | None = None,
                           kv_format: str | None = None, *, is_fp8_kvcache: bool | None = None,
                           indices: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                           attn_sink: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           lse: torch.Tensor | None = None, backend: str | None = None,
                           validate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged cache: ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32)``.

    Drop-in for FlashMLA's ``flash_mla_with_kvcache`` (bf16) and vLLM's dense-FP8 FlashMLA call (e4m3 ``q``
    and cache with ``descale_q``/``descale_k`` of shape [1]).

    q: ``[b, s_q, h_q, 576]`` bf16 (with an FP8 cache quantized per query row on the GPU: for ``"fp8_rope_bf16"``
        its latent part, the RoPE part kept bf16; for ``"fp8"``, whose RoPE keys are e4m3, the whole row), or
        float8_e4m3fn with ``descale_q`` for the flat ``"fp8"`` format.
    k_cache: ``[num_pages, 64, 1, row]`` in one of the formats of :mod:`fp8mla.formats`; ``kv_format`` names it,
        or it is inferred from dtype and row width.
    block_table: ``[b, max_pages]`` int32 page indices; cache_seqlens: ``[b]`` int32.
    tile_scheduler_metadata, num_splits: from :func:`get_mla_metadata` (computed once per step, shared by layers),
        or an MLASchedule from ``get_mla_metadata()`` and None.
    causal: for ``s_q > 1`` query token i sees keys ``[0, seqlen - (s_q - 1 - i))`` (bottom-right aligned).
    out, lse: optional preallocated outputs (e.g. for CUDA graphs).
    backend: ``"hopper"`` (Gluon, sm_90a), ``"portable"`` (plain Triton), or None for the fastest available.
    validate: also check the data (seqlens, block table, schedule) on the host, naming what is wrong: for debugging,
        as it reads them back (a synchronisation; skipped during CUDA-graph capture). Without it the kernels guard
        the data themselves: a request whose seqlen is negative or beyond the block table, whose block-table
        entries leave the cache, or which the schedule was not planned for gets NaN in its out and lse, and
        nothing is read outside its tensors.
    A request with seqlen 0 (or a query row that sees no key) gets out 0 and lse +inf.

    Sparse decode (DeepSeek V3.2), FlashMLA's sparse call: ``indices [b, s_q, topk]`` int32 gives each query token
    the cache rows it attends to (row = page * 64 + offset; -1: skipped; block_table and cache_seqlens are not
    used, pass None), with the schedule of ``get_mla_metadata()`` and ``num_splits=None``; ``topk_length [b]``
    int32 counts only the first that many indices of each batch entry; ``attn_sink [h_q]`` fp32 scales head h's
    out by ``exp(lse) / (exp(lse) + exp(attn_sink[h]))`` (lse unchanged); ``causal`` must be False. A 656-byte cache
    is read as ``"fp8_ds_mla"`` (a descale per 128 latent dims) unless ``kv_format`` says otherwise. An index
    below -1 or past the cache, or a topk_length outside [0, topk], makes that query token's out and lse NaN and
    is never read. ``is_fp8_kvcache`` (FlashMLA's flag) is checked against the cache's dtype when given.
    """
    if is_fp8_kvcache is not None and isinstance(k_cache, torch.Tensor) \
            and bool(is_fp8_kvcache) != (k_cache.dtype != torch.bfloat16):
        raise ValueError(f"is_fp8_kvcache={is_fp8_kvcache} but k_cache is {k_cache.dtype}")
    if indices is None:
        if topk_length is not None or attn_sink is not None:
            raise ValueError("topk_length and attn_sink are for the sparse call (indices)")
        call = checks.check_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale, causal, descale_q, descale_k, kv_format, out, lse)
    else:
        call = checks.check_sparse(q, k_cache, indices, topk_length, attn_sink, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale, causal, descale_q, descale_k, kv_format, out, lse)
    decoder = kernels.select(backend, q.device, call.kv_format, call.rows, call.gather is not None)
    if call.cache_seqlens.shape[0] == 0:   # (no requests: b, or b * s_q for a sparse call)
        return call.out, call.lse
    if call.num_splits is None:
        call = _planned(call, decoder)
    if validate and not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        if call.gather is None:
            checks.check_indices(call)
        else:
            checks.check_sparse_data(call)
    kernels.launch_decode(decoder, call)
    return call.out, call.lse


def write_kv_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_format: str | None = None, descale_k: torch.Tensor | None = None) -> None:
    """Append tokens to a paged cache in place (vLLM's ``concat_and_cache_mla``).

    ``kv_c [T, 512]`` latent and ``k_pe [T, 64]`` RoPE vectors (any float dtype) go to the cache rows
    ``slot_mapping [T]`` (slot = page * 64 + offset; negative slots are skipped, as for padded tokens, and so are
    slots past the cache's end: nothing is written outside it).
    ``"fp8"`` needs the cache's per-tensor ``descale_k``; ``"fp8_rope_bf16"`` (a 656-byte cache's default) computes
    each token's scale, ``"fp8_ds_mla"`` one a 128-dim latent group (vLLM's DeepSeek V3.2 cache).
    Runs as one kernel with no host synchronisation, so it can be captured in a CUDA graph.
    """
    kv_format = checks.check_cache(k_cache, kv_format)
    if kv_c.dim() != 2 or kv_c.shape[1] != D_LATENT:
        raise ValueError(f"kv_c must be [num_tokens, {D_LATENT}], got {list(kv_c.shape)}")
    if k_pe.dim() != 2 or k_pe.shape != (kv_c.shape[0], D_ROPE):
        raise ValueError(f"k_pe must be [num_tokens, {D_ROPE}] matching kv_c, got {list(k_pe.shape)}")
    if slot_mapping.shape != (kv_c.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64) \
            or not slot_mapping.is_contiguous():   # (the kernel reads consecutive slots)
        raise ValueError(f"slot_mapping must be a contiguous int32/int64 [{kv_c.shape[0]}] tensor")
    if not kv_c.dtype.is_floating_point or not k_pe.dtype.is_floating_point:
        raise TypeError("kv_c and k_pe must be floating point")
    if kv_c.stride(1) != 1 or k_pe.stride(1) != 1:  # the kernel steps through rows by stride(0) only
        raise ValueError("kv_c's and k_pe's last dimension must be contiguous")
    if kv_format == "fp8" and (descale_k is None or descale_k.numel() != 1):
        raise ValueError("the 'fp8' format needs descale_k of shape [1]")
    devices = {t.device for t in (kv_c, k_pe, k_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if kv_c.shape[0] == 0:
        return
    kernels.lazy("cache_writer").launch_write_kv_cache(kv_c, k_pe, k_cache, slot_mapping, kv_format, descale_k)


def hopper_available(device: torch.device) -> bool:
    """True where the Gluon sm_90a kernels can run: an sm_90 GPU and a Triton whose Gluon has what they use."""
    return kernels.hopper_unavailable(torch.device(device)) is None


__all__ = ["flash_mla_with_kvcache", "get_mla_metadata", "hopper_available", "write_kv_cache"]
