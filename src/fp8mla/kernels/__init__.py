"""fp8mla's kernels, behind one dispatch table.

``DECODERS`` says which decode kernel serves a call (the first that fits, among the chosen backend's):

  hopper_bf16    Gluon sm_90a, the bf16 cache (BF16 wgmma; V read from the page ring as it is)
  hopper_small   Gluon sm_90a, the FP8 caches with at most 32 query rows a request (s_q * h_q): the rows on the
                 wgmma's N, so nothing is padded to 64
  hopper         Gluon sm_90a, the FP8 caches, 64 query rows a CTA
  hopper_sparse  hopper's kernel on the sparse call's gather ring (cp.async of each index's row), at least 33 query
                 rows (h_q) read with one descale a row ("fp8_rope_bf16": fp8mla's writer's caches); "fp8_ds_mla"
                 above 64 rows from Triton 3.9 on (3.6 compiles that reading with spills, slower than the next)
  hopper_small_sparse   hopper_small's kernel on the gather ring (its load warp gathers), at most 32 query rows;
                 "fp8_ds_mla" too (a descale per 128 latent dims: a Q.K^T and a P a group)
  hopper_small_sparse_wide   hopper_small_sparse's kernel on "fp8_ds_mla" with more rows, 32 a CTA
  portable       plain Triton (any GPU with FP8 tensor cores, and the CPU interpreter), every format, dense and
                 sparse (its pages gathered row by row through ``indices``)

The "hopper" backend runs on an sm_90 GPU whose Triton has Gluon's Hopper API (``hopper_unavailable`` says why
not); ``backend=None`` takes it where it can, and an sm_90 GPU that cannot gets the portable kernels and one
warning saying why. Every decode is the chosen kernel over the split-KV schedule, then the combine of the
requests that were split (combine.py).
"""
from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch

from ..formats import D_LATENT, KV_FORMATS
from ..runtime import capability, device_index, interpreter_active, triton_release
from ..schedule import ROWS_PER_BLOCK, most_splits, num_sm_parts

BACKENDS = ("portable", "hopper")
FP8_FORMATS = ("fp8", "fp8_rope_bf16")   # the Hopper FP8 kernels' (fp8_ds_mla: the sparse call's alone)
HOPPER_FORMATS = ("bf16", *FP8_FORMATS)   # the formats the hopper backend takes
SMALL_ROWS = 32   # hopper_small's largest N


@dataclass(frozen=True, eq=False)   # one object per decoder (DECODERS): hashed by identity, on every call
class Decoder:
    name: str                  # the kernel's module
    backend: str
    formats: tuple[str, ...]   # cache formats it reads
    min_rows: int              # query rows per request (s_q * h_q) it takes
    max_rows: int | None
    calls: tuple[str, ...] = ("dense",)   # "dense" (a block table), "sparse" (indices: rows gathered one by one)
    cta_rows: int = ROWS_PER_BLOCK   # query rows a CTA takes, at most (the schedule's parts: SMs / row blocks)
    min_triton: tuple[int, int] = (3, 6)   # the oldest Triton release it is chosen under


DECODERS = (
    Decoder("hopper_bf16", "hopper", ("bf16",), 1, None),
    Decoder("hopper_small", "hopper", FP8_FORMATS, 1, SMALL_ROWS),
    Decoder("hopper", "hopper", FP8_FORMATS, SMALL_ROWS + 1, None),
    Decoder("hopper_small_sparse", "hopper", ("fp8_rope_bf16", "fp8_ds_mla"), 1, SMALL_ROWS, ("sparse",)),
    Decoder("hopper_sparse", "hopper", ("fp8_rope_bf16",), SMALL_ROWS + 1, None, ("sparse",)),
    Decoder("hopper_sparse", "hopper", ("fp8_ds_mla",), ROWS_PER_BLOCK + 1, None, ("sparse",), min_triton=(3, 9)),
    Decoder("hopper_small_sparse_wide", "hopper", ("fp8_ds_mla",), SMALL_ROWS + 1, None, ("sparse",), SMALL_ROWS),
    Decoder("portable", "portable", KV_FORMATS, 1, None, ("dense", "sparse")),
)


def hopper_unavailable(device: torch.device) -> str | None:
    """Why the Hopper kernels cannot run on ``device`` (None if they can)."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if interpreter_active():
        return "TRITON_INTERPRET is set"
    return _hopper_unavailable(device_index(device))


@functools.lru_cache(maxsize=None)   # asked on every call
def _hopper_unavailable(index: int) -> str | None:
    major, minor = capability(index)
    if (major, minor) != (9, 0):
        return f"GPU {index} is sm_{major}{minor}, not sm_90"
    from .triton_compat import hopper_missing

    return hopper_missing()


@functools.lru_cache(maxsize=None)
def _warn_portable_on_hopper(reason: str) -> None:
    """Once per reason: an sm_90 GPU on the portable kernels is many times slower than it could be."""
    warnings.warn(f"fp8mla: running the portable Triton kernels on an sm_90 GPU, about 10x slower than the Hopper "
                  f"kernels, because {reason}", RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def _warn_no_hopper_kernel(what: str) -> None:
    warnings.warn(f"fp8mla: {what} runs on the portable Triton kernel: no Hopper kernel takes it yet",
                  RuntimeWarning, stacklevel=4)


@functools.lru_cache(maxsize=256)   # asked on every call (what it depends on is fixed in a process)
def select(backend: str | None, device: torch.device, kv_format: str, rows: int, gather: bool = False) -> Decoder:
    """The decoder for a call of ``rows`` query rows per request on a ``kv_format`` cache (``gather``: a sparse
    call): ``backend``'s, or with None the fastest that can run on ``device``."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend != "portable":
        unavailable = hopper_unavailable(device)
        if backend == "hopper" and unavailable is not None:
            raise ValueError(f"the 'hopper' backend needs an sm_90 GPU and Triton's Gluon for Hopper: {unavailable}")
        if backend is None:
            backend = "hopper" if unavailable is None else "portable"
            if unavailable is not None and device.type == "cuda" and capability(device_index(device)) == (9, 0):
                _warn_portable_on_hopper(unavailable)
            if backend == "hopper" and _decoder(backend, kv_format, rows, gather) is None:
                _warn_no_hopper_kernel(f"a {'sparse ' if gather else ''}decode of a {kv_format!r} cache")
                backend = "portable"
    return decoder_for(backend, kv_format, rows, gather)


def _decoder(backend: str, kv_format: str, rows: int, gather: bool) -> Decoder | None:
    for decoder in DECODERS:
        if decoder.backend == backend and kv_format in decoder.formats and decoder.min_rows <= rows \
                and (decoder.max_rows is None or rows <= decoder.max_rows) \
                and ("sparse" if gather else "dense") in decoder.calls and triton_release() >= decoder.min_triton:
            return decoder
    return None


def decoder_for(backend: str, kv_format: str, rows: int, gather: bool = False) -> Decoder:
    """The first decoder of DECODERS in ``backend`` that takes the call."""
    decoder = _decoder(backend, kv_format, rows, gather)
    if decoder is None:
        raise ValueError(f"no {backend!r} kernel takes a {'sparse call on a ' if gather else ''}{kv_format!r} cache "
                         f"with {rows} query rows")
    return decoder


def schedule_parts(decoder: Decoder, device: torch.device, rows: int) -> int | None:
    """The parts a lazily planned schedule (MLASchedule) cuts for ``decoder``: one per SM and row block of its
    cta_rows, so that the row blocks of a part run in one wave and share its pages through L2 (None: the default,
    ROWS_PER_BLOCK's)."""
    if decoder.cta_rows == ROWS_PER_BLOCK:
        return None
    parts = num_sm_parts(device, rows, decoder.cta_rows)
    return None if parts == num_sm_parts(device, rows) else parts


def sparse_constexprs(gather) -> dict:
    """What the kernels specialise on for a call's checks.Gather (None: a dense call): GATHER (its pages gathered
    through indices), HAS_TOPK_LENGTH, HAS_SINK."""
    return dict(GATHER=gather is not None, HAS_TOPK_LENGTH=gather is not None and gather.topk_length is not None,
                HAS_SINK=gather is not None and gather.attn_sink is not None)


def partial_dtype(kv_format: str) -> torch.dtype:
    """The dtype of split requests' partial O: bf16 for the FP8 formats (half the traffic of the partial stores and
    the combine's reads, far below their FP8 error), fp32 for bf16 (whose error is at bf16's own rounding)."""
    return torch.float32 if kv_format == "bf16" else torch.bfloat16


@functools.lru_cache(maxsize=None)
def lazy(module: str):
    """The kernel module ``module``, imported on first use (the modules import Triton and define its kernels, and
    __main__ may switch the interpreter on before; hopper's only where it is used), then found without an import
    statement's cost (~1.6 us)."""
    return importlib.import_module(f"{__name__}.{module}")


def _plan_decode(call, decoder: Decoder, parts: int):
    """launch_decode for calls of ``call``'s signature and a schedule of ``parts`` parts."""
    launch = lazy("hopper").LAUNCH[decoder.name] if decoder.backend == "hopper" else lazy("portable").launch_portable
    launch_site, scratch = lazy("launcher").launch_site, lazy("launcher").scratch
    b, s_q, h_q = call.shape
    # every part adds at most one split beyond the first of each request
    buffers = (((b + parts, call.rows, D_LATENT), partial_dtype(call.kv_format)),
               ((b + parts, call.rows), torch.float32))
    # a sparse call's schedule (api._planned's) may split no request, each then writing its out and lse itself
    splits = call.gather is None or most_splits(b, call.rows, call.block_table.shape[1], call.q.device,
                                                schedule_parts(decoder, call.q.device, call.rows)) > 1
    combine = lazy("combine").plan_combine(b, s_q, h_q, parts, call.max_pages, call.q.device, call.gather) \
        if splits else None

    def decode(call):
        o_part, lse_part = scratch(call.q.device, *buffers)
        site = launch_site()
        launch(call, o_part, lse_part, site)
        if combine is not None:
            combine(call.out, call.lse, o_part, lse_part, call.meta, call.num_splits, call.cache_seqlens,
                    call.gather and call.gather.attn_sink, call.signature, site)
    return decode


def launch_decode(decoder: Decoder, call) -> None:
    """The decode kernel ``decoder`` over ``call`` (a checks.DecodeCall), then the combine of its split requests."""
    lazy("launcher").planned(_plan_decode, call, decoder, call.meta.shape[0])(call)
