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

from .formats import D_LATENT, D_QK, FP8_DTYPE, PAGE_SIZE, ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET, infer_kv_format
from .runtime import interpreter_active
from .schedule import METADATA_WIDTH, PLANNED_ROWS, MLASchedule, plan


class Gather(NamedTuple):
    """What a sparse call adds (``indices`` given): its requests are the ``b * s_q`` query tokens, each with its own
    row of indices (the DecodeCall's block_table, ``[b * s_q, topk]``) and ``h_q`` query rows."""
    s_q: int                          # query tokens per batch entry (the out / lse layout's s_q)
    topk_length: torch.Tensor | None  # [b] int32: only the first topk_length[i] indices of batch entry i count
    attn_sink: torch.Tensor | None    # [h_q] fp32


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
    rows: int = 0               # query rows per request: s_q * h_q, which share every KV page (sparse: h_q)
    gather: Gather | None = None  # a sparse call's (block_table: its indices; cache_seqlens: topk each)

    @property
    def max_pages(self) -> int:
        """Pages a request's block table can name: its columns (a sparse call's: topk's pages of 64 indices)."""
        cols = self.block_table.shape[1]
        return cols if self.gather is None else -(-cols // PAGE_SIZE)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(requests, query tokens a request, heads) as the kernels see them: (b, s_q, h_q), sparse (b * s_q, 1,
        h_q)."""
        b, s_q, h_q, _ = self.q.shape
        return (b, s_q, h_q) if self.gather is None else (b * s_q, 1, h_q)


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


def check_cache(k_cache, kv_format: str | None, sparse: bool = False) -> str:
    """k_cache's format (``kv_format`` checked against it, or inferred, for a sparse call if ``sparse``) after
    checking its shape."""
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache must be a torch.Tensor, got {type(k_cache).__name__}")
    kv_format = infer_kv_format(k_cache, kv_format, sparse)
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
    _check_q(q, head_dim_v)
    b = q.shape[0]
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

    softmax_scale = _check_scales(q, kv_format, descale_q, descale_k, softmax_scale)
    _check_outputs(q, out, lse)
    return kv_format, softmax_scale, bool(causal)


def _check_q(q, head_dim_v) -> None:
    check_tensor("q", q, (torch.bfloat16, FP8_DTYPE), dim=4)
    if q.shape[3] != D_QK:
        raise ValueError(f"q's head dim must be {D_QK} (512 latent + 64 RoPE), got {q.shape[3]}")
    if head_dim_v != D_LATENT:
        raise ValueError(f"head_dim_v must be {D_LATENT}, got {head_dim_v}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension must be contiguous")


def _check_sparse_arguments(q, k_cache, indices, topk_length, attn_sink, head_dim_v, meta, num_splits,
                            softmax_scale, causal, descale_q, descale_k, kv_format, out, lse) -> tuple[str, float]:
    """Every check of check_sparse's; returns (kv_format, softmax_scale)."""
    _check_q(q, head_dim_v)
    b, s_q, h_q, _ = q.shape
    kv_format = check_cache(k_cache, kv_format, sparse=True)
    check_tensor("indices", indices, (torch.int32,), dim=3)
    if indices.shape[:2] != (b, s_q) or indices.shape[2] < 1 or not indices.is_contiguous():
        raise ValueError(f"indices must be a contiguous int32 [{b}, {s_q}, topk] tensor (topk >= 1), got shape "
                         f"{list(indices.shape)}, strides {indices.stride()}")
    if causal:
        raise ValueError("causal must be False with indices: the indexer's top-k already says what each token sees")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, (torch.int32,), dim=1)
        if topk_length.shape[0] != b or not topk_length.is_contiguous():
            raise ValueError(f"topk_length must be a contiguous int32 [{b}] tensor, got {list(topk_length.shape)}")
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, (torch.float32,), dim=1)
        if attn_sink.shape[0] != h_q or not attn_sink.is_contiguous():
            raise ValueError(f"attn_sink must be a contiguous fp32 [{h_q}] tensor, got {list(attn_sink.shape)}")
    if not isinstance(meta, MLASchedule) or num_splits is not None:
        raise ValueError("a sparse call (indices) takes the schedule get_mla_metadata() returns, with num_splits "
                         "None: it is planned for the call's b * s_q query tokens of topk indices each")
    for name, t in (("k_cache", k_cache), ("indices", indices), ("topk_length", topk_length),
                    ("attn_sink", attn_sink)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    check_device(q.device)
    softmax_scale = _check_scales(q, kv_format, descale_q, descale_k, softmax_scale)
    _check_outputs(q, out, lse)
    return kv_format, softmax_scale


def _check_scales(q, kv_format, descale_q, descale_k, softmax_scale) -> float:
    """The scale arguments; returns the softmax scale (its default filled in)."""
    device = q.device
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
    return softmax_scale


def _check_outputs(q, out, lse) -> None:
    b, s_q, h_q, _ = q.shape
    device = q.device
    if out is not None and (out.shape != (b, s_q, h_q, D_LATENT) or out.dtype != torch.bfloat16
                            or not out.is_contiguous() or out.device != device):
        raise ValueError(f"out must be a contiguous bf16 [{b}, {s_q}, {h_q}, {D_LATENT}] tensor on {device}")
    if lse is not None and (lse.shape != (b, h_q, s_q) or lse.dtype != torch.float32 or not lse.is_contiguous()
                            or lse.device != device):
        raise ValueError(f"lse must be a contiguous fp32 [{b}, {h_q}, {s_q}] tensor on {device}")


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


_sparse_checked: dict = {}   # as _checked, for sparse calls
_topk_seqlens: dict = {}     # (requests, topk, device) -> [requests] int32 of topk: a sparse call's seqlens


def _topk_of(requests: int, topk: int, device) -> torch.Tensor:
    """Each of a sparse call's requests has topk tokens (the schedule's and the combine's seqlens), one tensor per
    shape kept, so a CUDA graph keeps reading the same memory (made by the shape's first call: let it be an eager
    one: a fill captured in a graph would happen only at its replays, so a capture is refused). Kept for the
    process's life: a graph does not keep alive what it reads, and an engine captures one a batch size (often more
    than 64), so a dropped tensor's memory could be another's at a replay; each is requests * 4 bytes."""
    key = (requests, topk, device)
    if key not in _topk_seqlens:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"the first sparse call of {requests} query tokens of topk {topk} is being captured in a "
                             "CUDA graph: make one eager call of this shape first (it makes the tensor of topk each "
                             "that its schedule and kernels read)")
        _topk_seqlens[key] = torch.full((requests,), topk, dtype=torch.int32, device=device)
    return _topk_seqlens[key]


def check_sparse(q, k_cache, indices, topk_length, attn_sink, head_dim_v, meta, num_splits, softmax_scale, causal,
                 descale_q, descale_k, kv_format, out, lse) -> DecodeCall:
    """A sparse call's arguments checked (flash_mla_with_kvcache with ``indices``), once per signature as in
    check_decode, as a DecodeCall whose requests are the b * s_q query tokens: block_table is ``indices`` as
    ``[b * s_q, topk]``, cache_seqlens topk for each."""
    try:
        signature = (*[(t.dtype, t.shape, t.stride(), t.device, not t.data_ptr() & 15) if type(t) is torch.Tensor
                       else type(t) if t is None or type(t) is MLASchedule else _not_a_tensor()
                       for t in (q, k_cache, indices, topk_length, attn_sink, meta, num_splits, descale_q, descale_k,
                                 out, lse)],
                     head_dim_v, softmax_scale, causal, kv_format, q.is_cuda or interpreter_active())
        known = _sparse_checked.get(signature)
    except TypeError:
        signature = known = None
    if known is None:
        known = _remember(_sparse_checked, signature, _check_sparse_arguments(
            q, k_cache, indices, topk_length, attn_sink, head_dim_v, meta, num_splits, softmax_scale, causal,
            descale_q, descale_k, kv_format, out, lse))
    (kv_format, softmax_scale), number = known
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    if out is None:
        out = q.new_empty((b, s_q, h_q, D_LATENT), dtype=torch.bfloat16)
    if lse is None:
        lse = q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return DecodeCall(q, k_cache, kv_format, indices.view(b * s_q, topk), _topk_of(b * s_q, topk, q.device), meta,
                      None, out, lse, descale_q, descale_k, softmax_scale, False, number, h_q,
                      Gather(s_q, topk_length, attn_sink))


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
    if call.kv_format == "fp8_rope_bf16" and referenced.dim() == 2:   # the rows of the requests' tokens
        pos = torch.arange(max_pages * PAGE_SIZE, device=block_table.device)
        rows = referenced.repeat_interleave(PAGE_SIZE, dim=1) * PAGE_SIZE + pos % PAGE_SIZE
        _check_one_descale(call.k_cache, rows[pos[None, :] < cache_seqlens.long()[:, None]])
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


def _check_one_descale(k_cache, rows) -> None:
    """An ``"fp8_rope_bf16"`` reading takes a row's first descale for all its latent dims: the rows read must have
    four equal ones (as fp8mla's writer stores them), else the cache is ``"fp8_ds_mla"``."""
    descales = k_cache.view(-1, ROW_BYTES)[rows.reshape(-1)][:, SCALE_OFFSET:ROPE_OFFSET].view(torch.float32)
    if not bool((descales == descales[:, :1]).all()):
        raise ValueError("k_cache read as 'fp8_rope_bf16' (one descale a row) has rows whose four descales differ: "
                         "pass kv_format='fp8_ds_mla' (a descale per 128 latent dims)")


def check_sparse_data(call: DecodeCall) -> None:
    """The sparse call's opt-in data check (host read-backs): every index counted is -1 or a row of the cache, and
    topk_length is within [0, topk]."""
    indices, topk_length = call.block_table, call.gather.topk_length
    topk = indices.shape[1]
    cache_rows = call.k_cache.shape[0] * PAGE_SIZE
    counted = torch.ones_like(indices, dtype=torch.bool)
    if topk_length is not None:
        lo, hi = topk_length.min().item(), topk_length.max().item()
        if lo < 0 or hi > topk:
            raise ValueError(f"topk_length holds {lo if lo < 0 else hi}, outside [0, topk={topk}]")
        lengths = topk_length.long().repeat_interleave(call.gather.s_q)
        counted = torch.arange(topk, device=indices.device)[None, :] < lengths[:, None]
    used = torch.where(counted, indices.long(), -1)
    lo, hi = used.min().item(), used.max().item()
    if lo < -1 or hi >= cache_rows:
        raise ValueError(f"indices holds {lo if lo < -1 else hi}, outside the cache's rows [0, {cache_rows}) "
                         "(and -1, skipped)")
    if call.kv_format == "fp8_rope_bf16":
        _check_one_descale(call.k_cache, used[used >= 0])


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
