"""Public decode API: FlashMLA's call, vLLM's dense-FP8 call, and backend selection.

Every shape, dtype and device is checked here, once, before any launch; the kernels trust their inputs.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from .formats import D_LATENT, D_QK, FP8_DTYPE, PAGE_SIZE, infer_kv_format
from .scheduler import METADATA_WIDTH, get_mla_metadata

BACKENDS = ("portable", "hopper")


def interpreter_active() -> bool:
    """Whether Triton's CPU interpreter is switched on (it must be before fp8mla.kernels is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def hopper_available(device: torch.device) -> bool:
    """True where the Gluon sm_90a kernels can run: an sm_90 GPU and a Triton whose Gluon has what they use."""
    return hopper_unavailable(device) is None


def hopper_unavailable(device: torch.device) -> str | None:
    """Why the Hopper kernels cannot run on ``device`` (None if they can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if interpreter_active():
        return "TRITON_INTERPRET is set"
    return _hopper_unavailable(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)   # asked on every call
def _hopper_unavailable(index: int) -> str | None:
    capability = torch.cuda.get_device_capability(index)
    if capability != (9, 0):
        return f"GPU {index} is sm_{capability[0]}{capability[1]}, not sm_90"
    from .kernels.triton_compat import hopper_missing

    return hopper_missing()


@functools.lru_cache(maxsize=None)
def _warn_portable_on_hopper(reason: str) -> None:
    """Once per reason: an sm_90 GPU that runs the portable kernel is many times slower than it could be."""
    warnings.warn(f"fp8mla: running the portable Triton kernel on an sm_90 GPU, about 10x slower than the Hopper "
                  f"kernels, because {reason}", RuntimeWarning, stacklevel=3)


def _check_tensor(name, t, dtypes, dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {list(t.shape)}")


def _check_scale(name, t, device):
    _check_tensor(name, t, (torch.float32,))
    if t.numel() != 1 or t.dim() != 1:
        raise ValueError(f"{name} must have shape [1], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _check_indices(block_table, cache_seqlens, num_pages):
    """Data-dependent checks (one host read-back): seqlens fit the block table, used pages exist."""
    max_pages = block_table.shape[1]
    pages = (cache_seqlens.long() + PAGE_SIZE - 1) // PAGE_SIZE
    used = torch.arange(max_pages, device=block_table.device)[None, :] < pages[:, None]
    referenced = torch.where(used, block_table.long(), 0)
    if referenced.numel() == 0:  # a table without columns (every request empty): nothing is referenced
        referenced = pages.new_zeros(1)
    stats = torch.stack([cache_seqlens.min().long(), pages.max(), referenced.min(), referenced.max()]).tolist()
    min_len, most_pages, lo, hi = stats
    if min_len < 0:
        raise ValueError("cache_seqlens must be >= 0")
    if most_pages > max_pages:
        raise ValueError(f"block_table has {max_pages} pages per request but a seqlen needs {most_pages} "
                         f"(pages of {PAGE_SIZE} tokens)")
    if lo < 0 or hi >= num_pages:
        raise ValueError(f"block_table refers to page {lo if lo < 0 else hi}, outside the cache's {num_pages} pages")


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                           descale_q: torch.Tensor | None = None, descale_k: torch.Tensor | None = None,
                           kv_format: str | None = None, *, out: torch.Tensor | None = None,
                           lse: torch.Tensor | None = None, backend: str | None = None,
                           validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged cache: ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] fp32)``.

    Drop-in for FlashMLA's ``flash_mla_with_kvcache`` (bf16) and vLLM's dense-FP8 FlashMLA call (e4m3 ``q``
    and cache with ``descale_q``/``descale_k`` of shape [1]).

    q: ``[b, s_q, h_q, 576]`` bf16 (with an FP8 cache quantized per query row on the GPU: for ``"fp8_rope_bf16"``
        its latent part, the RoPE part kept bf16; for ``"fp8"``, whose RoPE keys are e4m3, the whole row), or
        float8_e4m3fn with ``descale_q`` for the flat ``"fp8"`` format.
    k_cache: ``[num_pages, 64, 1, row]`` in one of the formats of :mod:`fp8mla.formats`; ``kv_format`` names it,
        or it is inferred from dtype and row width.
    block_table: ``[b, max_pages]`` int32 page indices; cache_seqlens: ``[b]`` int32.
    tile_scheduler_metadata, num_splits: from :func:`get_mla_metadata` (computed once per step, shared by layers).
    causal: for ``s_q > 1`` query token i sees keys ``[0, seqlen - (s_q - 1 - i))`` (bottom-right aligned).
    out, lse: optional preallocated outputs (e.g. for CUDA graphs).
    backend: ``"hopper"`` (Gluon, sm_90a), ``"portable"`` (plain Triton), or None for the fastest available.
    validate: also check the block table against ``cache_seqlens`` (reads them back to the host; skipped during
        CUDA-graph capture; pass False on a hot path that is not captured).
    A request with seqlen 0 (or a query row that sees no key) gets out 0 and lse +inf.
    """
    # ---- shapes, dtypes, devices ----
    _check_tensor("q", q, (torch.bfloat16, FP8_DTYPE), dim=4)
    b, s_q, h_q, d_qk = q.shape
    if d_qk != D_QK:
        raise ValueError(f"q's head dim must be {D_QK} (512 latent + 64 RoPE), got {d_qk}")
    if head_dim_v != D_LATENT:
        raise ValueError(f"head_dim_v must be {D_LATENT}, got {head_dim_v}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension must be contiguous")
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache must be a torch.Tensor, got {type(k_cache).__name__}")
    kv_format = infer_kv_format(k_cache, kv_format)
    if k_cache.dim() != 4 or k_cache.shape[1] != PAGE_SIZE or k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must be [num_pages, {PAGE_SIZE}, 1, row] (page size {PAGE_SIZE}, one KV head), "
                         f"got {list(k_cache.shape)}")
    if not k_cache.is_contiguous():
        raise ValueError("k_cache must be contiguous")
    _check_tensor("block_table", block_table, (torch.int32,), dim=2)
    _check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), dim=1)
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(f"block_table {list(block_table.shape)} and cache_seqlens {list(cache_seqlens.shape)} "
                         f"must have q's batch size {b}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table's last dimension must be contiguous")
    _check_tensor("tile_scheduler_metadata", tile_scheduler_metadata, (torch.int32,), dim=2)
    if tile_scheduler_metadata.shape[1] != METADATA_WIDTH or not tile_scheduler_metadata.is_contiguous():
        raise ValueError(f"tile_scheduler_metadata must be a contiguous [num_parts, {METADATA_WIDTH}] tensor from "
                         "get_mla_metadata")
    _check_tensor("num_splits", num_splits, (torch.int32,), dim=1)
    if num_splits.shape[0] != b + 1:
        raise ValueError(f"num_splits must be [{b + 1}] (from get_mla_metadata for this batch), "
                         f"got {list(num_splits.shape)}")
    device = q.device
    for name, t in (("k_cache", k_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                    ("tile_scheduler_metadata", tile_scheduler_metadata), ("num_splits", num_splits)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")
    if device.type != "cuda" and not (device.type == "cpu" and interpreter_active()):
        raise ValueError(f"tensors must be on a CUDA device (CPU only with TRITON_INTERPRET=1), got {device}")

    # ---- scales ----
    q_fp8 = q.dtype == FP8_DTYPE
    if q_fp8:
        if kv_format != "fp8":
            raise TypeError(f"a float8_e4m3fn q needs the 'fp8' cache format, got {kv_format!r}; pass bf16 q instead")
        if descale_q is None:
            raise ValueError("a float8_e4m3fn q needs descale_q of shape [1]")
    if descale_q is not None:
        if not q_fp8:
            raise ValueError("descale_q is only for a float8_e4m3fn q")
        _check_scale("descale_q", descale_q, device)
    if kv_format == "fp8":
        if descale_k is None:
            raise ValueError("the 'fp8' cache format needs descale_k of shape [1]")
        _check_scale("descale_k", descale_k, device)
    elif descale_k is not None:
        raise ValueError(f"descale_k is only for the 'fp8' format; {kv_format!r} keeps its scales in the cache")
    if softmax_scale is None:
        softmax_scale = D_QK ** -0.5
    softmax_scale = float(softmax_scale)
    if not softmax_scale > 0:  # the kernels take each row's max on unscaled scores
        raise ValueError(f"softmax_scale must be a positive number, got {softmax_scale}")

    # ---- outputs ----
    if out is None:
        out = torch.empty(b, s_q, h_q, D_LATENT, dtype=torch.bfloat16, device=device)
    elif out.shape != (b, s_q, h_q, D_LATENT) or out.dtype != torch.bfloat16 or not out.is_contiguous() \
            or out.device != device:
        raise ValueError(f"out must be a contiguous bf16 [{b}, {s_q}, {h_q}, {D_LATENT}] tensor on {device}")
    if lse is None:
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=device)
    elif lse.shape != (b, h_q, s_q) or lse.dtype != torch.float32 or not lse.is_contiguous() or lse.device != device:
        raise ValueError(f"lse must be a contiguous fp32 [{b}, {h_q}, {s_q}] tensor on {device}")

    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend != "portable":
        from .kernels.hopper import SUPPORTED_FORMATS, supports

        unavailable = hopper_unavailable(device)
        fits = unavailable is None and supports(q, kv_format)
        if backend is None:
            backend = "hopper" if fits else "portable"
            if unavailable is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
                _warn_portable_on_hopper(unavailable)
        elif unavailable is not None:
            raise ValueError(f"the 'hopper' backend needs an sm_90 GPU and Triton's Gluon for Hopper: {unavailable}")
        elif not fits:
            raise ValueError(f"the 'hopper' backend takes a bf16 q with the {SUPPORTED_FORMATS} cache formats; "
                             f"got a {q.dtype} q with {kv_format!r} (use backend='portable')")
    if b == 0:
        return out, lse
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if validate and not capturing:
        _check_indices(block_table, cache_seqlens, k_cache.shape[0])

    # ---- launch: split-KV decode, then combine ----
    from .kernels import launch_decode

    launch_decode(backend, q, k_cache, kv_format, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                  out, lse, descale_q, descale_k, softmax_scale, causal)
    return out, lse


__all__ = ["flash_mla_with_kvcache", "get_mla_metadata", "hopper_available", "BACKENDS"]
