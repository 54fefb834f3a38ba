"""The peer kernels the bench compares with, loaded from prebuilt binaries (torch stable-ABI extensions).

A folder (``tools/fetch-peers.sh`` makes one) holds ``_flashmla_C.abi3.so`` (FlashMLA BF16),
``_flashmla_extension_C.abi3.so`` (FlashMLA dense FP8, as vLLM ships it) and ``_vllm_fa3_C.abi3.so.xz``
(vLLM's FlashAttention 3, xz-compressed: it is decompressed once into a cache folder).

Every peer takes the bench's inputs unchanged: the bf16 problem, or exactly fp8mla's ``"fp8"`` cache with a
per-tensor e4m3 q (``DecodeProblem.quantized("fp8", q_fp8=True)``). ``Peer.prepare`` does the untimed setup
(scheduler metadata, as engines compute it once per step) and returns the call to time, which gives
``(out [b, s_q, h_q, 512], lse [b, h_q, s_q] or None)``. A peer that cannot be loaded keeps the reason in
``error`` instead of raising, so the bench can report it.
"""
from __future__ import annotations

import importlib.util
import lzma
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import D_LATENT, D_ROPE, PAGE_SIZE
from ..inputs import DecodeProblem
from .report import describe

Inputs = Callable[[str, bool], dict]     # (kv_format, q_fp8) -> DecodeProblem.quantized(...)
Call = Callable[[], tuple]               # the timed call: () -> (out, lse)


@dataclass
class Peer:
    name: str
    kind: str                # "bf16" or "fp8": fp8mla's rows of that kind are compared with it
    cache_format: str        # the cache it reads, for the bytes formula
    q_fp8: bool              # reads an e4m3 q
    prepare: Callable[[DecodeProblem, bool, float, Inputs], Call] | None
    error: str | None = None  # why it is unavailable


def load_peers(directory: str, fa3: bool = True, cache_dir: str | None = None, sparse: bool = False) -> list[Peer]:
    """FlashMLA BF16, FlashMLA dense FP8 and (with ``fa3``) FA3 in MLA mode, from ``directory``; with ``sparse``,
    FlashMLA's sparse decode instead."""
    if sparse:
        specs = [("FlashMLA sparse", "fp8", "fp8_ds_mla", False, "_flashmla_C", _flashmla_sparse)]
    else:
        specs = [("FlashMLA BF16", "bf16", "bf16", False, "_flashmla_C", _flashmla_bf16),
                 ("FlashMLA dense FP8", "fp8", "fp8", True, "_flashmla_extension_C", _flashmla_fp8)]
    if fa3 and not sparse:
        specs.append(("FA3-MLA BF16", "bf16", "bf16", False, "_vllm_fa3_C", _fa3_mla))
    peers = []
    for name, kind, cache_format, q_fp8, module, make in specs:
        try:
            prepare, error = make(_load_ops(module, directory, cache_dir)), None
        except Exception as e:  # a missing or broken binary is a row in the table, not a crash
            prepare, error = None, f"cannot load {module}: {describe(e)}"
        peers.append(Peer(name, kind, cache_format, q_fp8, prepare, error))
    return peers


def _load_ops(module: str, directory: str, cache_dir: str | None):
    """Import the extension ``module`` from ``directory`` and return its ``torch.ops`` namespace."""
    path = os.path.join(directory, module + ".abi3.so")
    if not os.path.exists(path):
        if not os.path.exists(path + ".xz"):
            raise FileNotFoundError(f"no {module}.abi3.so or {module}.abi3.so.xz in {directory}")
        path = _decompressed(path + ".xz", cache_dir)
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, path)
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)  # registers the ops with torch
        sys.modules[module] = ext
    return getattr(torch.ops, module)


def _decompressed(xz_path: str, cache_dir: str | None) -> str:
    """``xz_path`` decompressed into a cache folder keyed by its size and mtime (reused while unchanged)."""
    st = os.stat(xz_path)
    name = os.path.basename(xz_path)[:-len(".xz")]
    folder = os.path.join(cache_dir or os.path.join(tempfile.gettempdir(), "fp8mla-peers"),
                          f"{name}-{st.st_size}-{st.st_mtime_ns}")
    target = os.path.join(folder, name)
    if not os.path.exists(target):
        os.makedirs(folder, exist_ok=True)
        partial = target + f".{os.getpid()}.part"  # concurrent runs never see a half-written file
        with lzma.open(xz_path) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        os.replace(partial, target)
    return target


def _flashmla_bf16(ops):
    op = ops.dense_decode_fwd

    def prepare(problem: DecodeProblem, causal: bool, softmax_scale: float, inputs: Inputs) -> Call:
        q, k_cache = (inputs("bf16", False)[k] for k in ("q", "k_cache"))
        args = (q, k_cache, D_LATENT, problem.cache_seqlens, problem.block_table, softmax_scale, causal)
        _, _, meta, num_splits = op(*args, None, None, None)  # the first call computes the schedule

        def call():
            out, lse, _, _ = op(*args, meta, num_splits, None)
            return out, lse
        return call
    return prepare


def _flashmla_fp8(ops):
    op = ops.fwd_kvcache_mla_fp8

    def prepare(problem: DecodeProblem, causal: bool, softmax_scale: float, inputs: Inputs) -> Call:
        b, s_q, h_q = problem.shape
        x = inputs("fp8", True)
        meta, num_splits = ops.get_mla_decoding_metadata_dense_fp8(problem.cache_seqlens, s_q * h_q, 1)
        args = (x["q"], x["k_cache"], D_LATENT, problem.cache_seqlens, problem.block_table, softmax_scale, causal,
                meta, num_splits, x["descale_q"], x["descale_k"])

        def call():
            out, lse = op(*args)
            return out, lse
        return call
    return prepare


SPARSE_MIN_HEADS = 64   # FlashMLA's SM90 sparse kernel is built for 64 and 128 heads; engines pad fewer up to 64


def _flashmla_sparse(ops):
    """FlashMLA's sparse decode as vLLM vendors it: bf16 q, the fp8_ds_mla cache, indices [b, s_q, topk]; fewer
    than 64 heads padded to 64 (zeros, outside the timed call, as an engine's padded q buffer) and the output's
    first h_q heads taken."""
    op = ops.sparse_decode_fwd

    def prepare(problem, causal: bool, softmax_scale: float, inputs: Inputs) -> Call:
        b, s_q, h_q = problem.shape
        x = inputs("fp8_ds_mla", False)
        q = x["q"]
        if h_q < SPARSE_MIN_HEADS:
            q = torch.cat([q, q.new_zeros(b, s_q, SPARSE_MIN_HEADS - h_q, q.shape[-1])], dim=2)
        args = (q, x["k_cache"], problem.indices, None, None)
        rest = (None, None, None, D_LATENT, softmax_scale)
        _, _, meta, num_splits = op(*args, None, None, *rest)  # the first call computes the schedule

        def call():
            out, lse, _, _ = op(*args, meta, num_splits, *rest)
            return out[:, :, :h_q], lse[:, :h_q]
        return call
    return prepare


def _fa3_mla(ops):
    """vLLM's FlashAttnMLA decode: q = q_rope, q_v = q_latent, K = the cache's RoPE columns, V = its latent
    columns, one KV head, varlen q (cu_seqlens_q) over a paged cache. Arguments go by the names of the op's
    schema (read from the binary), so a changed schema fails loudly instead of shifting arguments."""
    fwd, schedule = ops.fwd, ops.get_scheduler_metadata

    def prepare(problem: DecodeProblem, causal: bool, softmax_scale: float, inputs: Inputs) -> Call:
        b, s_q, h_q = problem.shape
        q, k_cache = (inputs("bf16", False)[k] for k in ("q", "k_cache"))
        q = q.reshape(b * s_q, h_q, -1)
        q_rope, q_latent = q[..., D_LATENT:].contiguous(), q[..., :D_LATENT].contiguous()
        seqlens = problem.cache_seqlens
        cu_seqlens_q = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device=q.device)
        max_seqlen_k = int(seqlens.max())
        common = dict(max_seqlen_q=s_q, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=None,
                      cu_seqlens_k_new=None, seqused_q=None, seqused_k=seqlens, leftpad_k=None, is_causal=causal,
                      window_size_left=-1, window_size_right=-1, num_splits=0, pack_gqa=None, sm_margin=0)
        meta = schedule(batch_size=b, num_heads=h_q, num_heads_k=1, headdim=D_ROPE, headdim_v=D_LATENT,
                        qkv_dtype=torch.bfloat16, page_size=PAGE_SIZE, max_seqlen_k_new=0, has_softcap=False,
                        **common)
        kwargs = dict(q=q_rope, k=k_cache[..., D_LATENT:], v=k_cache[..., :D_LATENT], k_new=None, v_new=None,
                      q_v=q_latent, out=None, page_table=problem.block_table, kv_batch_idx=None, rotary_cos=None,
                      rotary_sin=None, seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None,
                      softmax_scale=softmax_scale, softcap=0.0, is_rotary_interleaved=True, scheduler_metadata=meta,
                      s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, **common)

        def call():
            res = fwd(**kwargs)
            out, lse = res[0], res[1]  # out [b*s_q, h_q, 512], lse [h_q, b*s_q]
            lse = lse.view(h_q, b, s_q).permute(1, 0, 2) if lse.shape == (h_q, b * s_q) else None
            return out.view(b, s_q, h_q, D_LATENT), lse
        return call
    return prepare
