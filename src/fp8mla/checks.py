"""The public API's argument checks: every shape, dtype and device of a call, once, before anything is launched.

``check_decode`` raises ``TypeError``/``ValueError`` naming the argument, and returns the call as a ``DecodeCall``
(outputs allocated where none were given); the kernels trust it. ``check_indices`` is the opt-in data check
(``validate=True``): it reads the block table and seqlens back to the host, so it is for debugging, not for a hot
path. Without it the kernels still guard the data: a page index outside the cache, a seqlen beyond the block
table or a schedule that does not cover a request's pages makes that request's out and lse NaN.
"""
from __future__ import annotations

import itertools
import warnings
from typing import NamedTuple

import torch

from .formats import D_LATENT, D_QK, FP8_DTYPE, PAGE_SIZE, infer_kv_format
from .runtime import interpreter_active
from .schedule import METADATA_WIDTH, PLANNED_ROWS, MLASchedule, plan


class DecodeCall(NamedTuple):
    q: torch.Tensor             # [b, s_q, h_q, 576] bf16 or e4m3
    k_cache: torch.Tensor       # [num_pages, 64, 1, row]
    kv_format: str
    block_table: torch.Tensor   # [b, max_pages] int32
    cache_seqlens: torch.Tensor  # [b] int32
    meta: torch.Tensor | MLASchedule   # [num_parts, METADATA_WIDTH] int32, or a schedule still to be planned
    num_splits: torch.Tensor | None    # [b + 1] int32 (None with an MLASchedule)
    out: torch.Tensor           # [b, s_q, h_q, 512] bf16
    lse: torch.Tensor           # [b, h_q, s_q] fp32
    descale_q: torch.Tensor | None
    descale_k: torch.Tensor | None
    softmax_scale: float
    causal: bool
    # a number standing for the call's signature, what the checks and the kernels' specializations depend on (equal
    # signatures, equal numbers, while check_decode remembers them); None: unknown
    signature: int | None = None
    rows: int = 0               # query rows per request: s_q * h_q, which share every KV page


def check_tensor(name, t, dtypes, dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {list(t.shape)}")


def _check_scale(name, t, device):
    check_tensor(name, t, (torch.float32,))
    if t.numel() != 1 or t.dim() != 1:
        raise ValueError(f"{name} must have shape [1], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def check_device(device: torch.device) -> None:
    if device.type != "cuda" and not (device.type == "cpu" and interpreter_active()):
        raise ValueError(f"tensors must be on a CUDA device (CPU only with TRITON_INTERPRET=1), got {device}")


def check_cache(k_cache, kv_format: str | None) -> str:
    """k_cache's format (``kv_format`` checked against it, or inferred) after checking its shape."""
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache must be a torch.Tensor, got {type(k_cache).__name__}")
    kv_format = infer_kv_format(k_cache, kv_format)
    if k_cache.dim() != 4 or k_cache.shape[1] != PAGE_SIZE or k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must be [num_pages, {PAGE_SIZE}, 1, row] (page size {PAGE_SIZE}, one KV head), "
                         f"got {list(k_cache.shape)}")
    if not k_cache.is_contiguous():
        raise ValueError("k_cache must be contiguous")
    return kv_format


def check_seqlens(cache_seqlens) -> None:
    check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), dim=1)
    if not cache_seqlens.is_contiguous():   # the kernels read it as consecutive int32s
        raise ValueError(f"cache_seqlens must be contiguous, got strides {cache_seqlens.stride()}")


def _check_arguments(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal,
                     descale_q, descale_k, kv_format, out, lse) -> tuple[str, float, bool]:
    """Every check of check_decode's; returns what the call derives from its arguments: (kv_format, softmax_scale,
    causal)."""
    # ---- shapes, dtypes, devices ----
    check_tensor("q", q, (torch.bfloat16, FP8_DTYPE), dim=4)
    b, s_q, h_q, d_qk = q.shape
    if d_qk != D_QK:
        raise ValueError(f"q's head dim must be {D_QK} (512 latent + 64 RoPE), got {d_qk}")
    if head_dim_v != D_LATENT:
        raise ValueError(f"head_dim_v must be {D_LATENT}, got {head_dim_v}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension must be contiguous")
    kv_format = check_cache(k_cache, kv_format)
    check_tensor("block_table", block_table, (torch.int32,), dim=2)
    check_seqlens(cache_seqlens)
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(f"block_table {list(block_table.shape)} and cache_seqlens {list(cache_seqlens.shape)} "
                         f"must have q's batch size {b}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table's last dimension must be contiguous")
    if isinstance(meta, MLASchedule):   # planned at launch (api.py)
        if num_splits is not None:
            raise ValueError("with a schedule from get_mla_metadata(), num_splits must be None")
        schedule = ()
    else:
        check_tensor("tile_scheduler_metadata", meta, (torch.int32,), dim=2)
        if meta.shape[1] != METADATA_WIDTH or not meta.is_contiguous():
            raise ValueError(f"tile_scheduler_metadata must be a contiguous [num_parts, {METADATA_WIDTH}] tensor "
                             "from get_mla_metadata")
        check_tensor("num_splits", num_splits, (torch.int32,), dim=1)
        if num_splits.shape[0] != b + 1 or not num_splits.is_contiguous():
            raise ValueError(f"num_splits must be a contiguous [{b + 1}] tensor (from get_mla_metadata for this "
                             f"batch), got shape {list(num_splits.shape)}, strides {num_splits.stride()}")
        schedule = (("tile_scheduler_metadata", meta), ("num_splits", num_splits))
    device = q.device
    for name, t in (("k_cache", k_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                    *schedule):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")
    check_device(device)

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
    if out is not None and (out.shape != (b, s_q, h_q, D_LATENT) or out.dtype != torch.bfloat16
                            or not out.is_contiguous() or out.device != device):
        raise ValueError(f"out must be a contiguous bf16 [{b}, {s_q}, {h_q}, {D_LATENT}] tensor on {device}")
    if lse is not None and (lse.shape != (b, h_q, s_q) or lse.dtype != torch.float32 or not lse.is_contiguous()
                            or lse.device != device):
        raise ValueError(f"lse must be a contiguous fp32 [{b}, {h_q}, {s_q}] tensor on {device}")
    return kv_format, softmax_scale, bool(causal)


def _not_a_tensor():
    raise TypeError   # an argument of another type than expected: checked in full, every call


_checked: dict = {}   # signature -> ((kv_format, softmax_scale, causal), its number): the checks passed for it
_numbers = itertools.count()   # (never reused: a forgotten signature comes back under a new number)


def _remember(table: dict, signature, derived) -> tuple:
    """(derived, a number for the signature) for checks that passed, kept in ``table`` under ``signature`` (a few
    hundred at most); an unknown signature (None) gets no number and is not kept."""
    if signature is None:
        return derived, None
    if len(table) >= 256:
        table.clear()
    known = table[signature] = (derived, next(_numbers))
    return known


def check_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal,
                 descale_q, descale_k, kv_format, out, lse) -> DecodeCall:
    """flash_mla_with_kvcache's arguments checked (see its docstring), as a DecodeCall (with out and lse allocated
    where not given). The checks run once per *signature*, the arguments' dtypes, shapes, strides, devices and
    alignments with the other arguments' values: a call of a signature that passed before only looks it up. The
    DecodeCall carries a number for the signature, which the launchers take as their key (hashed at once, where the
    signature is a tuple of ~60 values)."""
    try:
        # what a check or a kernel's specialization may depend on in each tensor argument (inline: this runs on
        # every call)
        signature = (*[(t.dtype, t.shape, t.stride(), t.device, not t.data_ptr() & 15) if type(t) is torch.Tensor
                       else type(t) if t is None or type(t) is MLASchedule else _not_a_tensor()
                       for t in (q, k_cache, block_table, cache_seqlens, meta, num_splits, descale_q, descale_k, out,
                                 lse)],
                     head_dim_v, softmax_scale, causal, kv_format,
                     q.is_cuda or interpreter_active())   # (CPU tensors are for the interpreter only)
        known = _checked.get(signature)
    except TypeError:   # an argument of another type, or unhashable
        signature = known = None
    if known is None:
        known = _remember(_checked, signature, _check_arguments(
            q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal, descale_q,
            descale_k, kv_format, out, lse))
    (kv_format, softmax_scale, causal), number = known
    b, s_q, h_q, _ = q.shape
    if out is None:   # (q's new_empty: torch.empty's parsing of a device argument costs ~0.8 us)
        out = q.new_empty((b, s_q, h_q, D_LATENT), dtype=torch.bfloat16)
    if lse is None:
        lse = q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return DecodeCall(q, k_cache, kv_format, block_table, cache_seqlens, meta, num_splits, out, lse, descale_q,
                      descale_k, softmax_scale, causal, number, s_q * h_q)


_metadata_checked: dict = {}   # signature -> (None, its number): get_mla_metadata's checks passed for it


def check_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_parts) -> int | None:
    """get_mla_metadata's arguments checked (check_metadata_args), once per signature as in check_decode; returns
    the signature's number (None: an argument of another type than expected, checked in full)."""
    try:
        signature = ((cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.device,
                      not cache_seqlens.data_ptr() & 15, cache_seqlens.is_cuda or interpreter_active())
                     if type(cache_seqlens) is torch.Tensor else _not_a_tensor(),
                     num_q_tokens_per_head_k, num_heads_k, num_parts)
        known = _metadata_checked.get(signature)
    except TypeError:
        signature = known = None
    if known is None:
        known = _remember(_metadata_checked, signature,
                          check_metadata_args(cache_seqlens, num_q_tokens_per_head_k, num_heads_k))
    return known[1]


def check_metadata_args(cache_seqlens, num_q_tokens_per_head_k, num_heads_k) -> None:
    """get_mla_metadata's arguments: what the decode call would reject is rejected here too."""
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
        raise ValueError("cache_seqlens must be a 1-D tensor [batch]")
    check_seqlens(cache_seqlens)
    check_device(cache_seqlens.device)
    if num_heads_k != 1:
        raise ValueError(f"MLA decode has one KV head, got num_heads_k={num_heads_k}")
    if num_q_tokens_per_head_k < 1:
        raise ValueError(f"num_q_tokens_per_head_k must be >= 1, got {num_q_tokens_per_head_k}")


def check_indices(call: DecodeCall) -> None:
    """The opt-in data check (host read-backs): seqlens are >= 0 and fit the block table, used pages exist, and
    the schedule is get_mla_metadata's for these seqlens (check_schedule)."""
    block_table, cache_seqlens, num_pages = call.block_table, call.cache_seqlens, call.k_cache.shape[0]
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
    if not isinstance(call.meta, MLASchedule):
        check_schedule(call)


def _rows_of(rows: int, h_q: int) -> str:
    return f"{rows} query rows a request" + (f" (s_q={rows // h_q} at h_q={h_q})" if rows % h_q == 0 else "")


def check_schedule(call: DecodeCall) -> None:
    """Raises unless the call's schedule is get_mla_metadata's for its seqlens (is_schedule_for). A schedule planned
    for these seqlens and another number of query rows a request (another s_q) passes with a warning naming both:
    the decode reads a schedule's pages for all of the call's row blocks, so out and lse are right, but the cut was
    made for the other rows (schedule.py)."""
    h_q = call.q.shape[2]
    recorded = call.meta[:, PLANNED_ROWS]
    lo, hi = torch.stack([recorded.min(), recorded.max()]).tolist() if recorded.numel() else (0, 0)
    planned = lo if lo == hi and lo >= 1 else None   # (None: not a schedule get_mla_metadata wrote)
    if planned is not None and planned != call.rows and is_schedule_for(call, planned):
        warnings.warn(f"fp8mla: tile_scheduler_metadata was planned for {_rows_of(planned, h_q)}, and this call has "
                      f"{_rows_of(call.rows, h_q)}: out and lse are right, but its pages were cut into parts for the "
                      "other rows (get_mla_metadata(cache_seqlens, s_q * h_q, 1) plans for this call's)",
                      RuntimeWarning, stacklevel=4)
        return
    if not is_schedule_for(call, call.rows):
        raise ValueError("tile_scheduler_metadata and num_splits are not get_mla_metadata's schedule for these "
                         f"cache_seqlens and {_rows_of(call.rows, h_q)} (planned for other cache_seqlens, or never "
                         "written): call get_mla_metadata(cache_seqlens, s_q * h_q, 1) again for this step's seqlens")


def is_schedule_for(call: DecodeCall, rows: int) -> bool:
    """Whether the call's schedule is what get_mla_metadata plans for its seqlens and ``rows`` query rows a request,
    with the default number of parts or with as many as it has (its reference, schedule.plan; read back). Stricter
    than the kernels' own check, which looks at each part's first and last requests only."""
    for num_parts in (None, call.meta.shape[0]):
        meta, num_splits = plan(call.cache_seqlens, rows, num_parts)
        if meta.shape == call.meta.shape and torch.equal(meta, call.meta) and torch.equal(num_splits,
                                                                                           call.num_splits):
            return True
    return False
