"""fp32 reference for MLA decode, and the accuracy metrics the bench reports.

Written independently of the kernels: it gathers each request's tokens through the block table, dequantizes
whatever format it is given, and runs plain fp32 attention per request.
"""
from __future__ import annotations

import math

import torch

from .formats import D_LATENT, D_QK, dequantize_kv_cache


def reference_mla_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, head_dim_v: int = D_LATENT, softmax_scale: float | None = None,
                         causal: bool = False, descale_q: torch.Tensor | None = None,
                         descale_k: torch.Tensor | None = None,
                         kv_format: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode in fp32: ``(out [b, s_q, h_q, 512] fp32, lse [b, h_q, s_q] fp32)``.

    Same semantics as :func:`fp8mla.flash_mla_with_kvcache`: one KV head whose rows are ``[latent | rope]``,
    V = latent, causal bottom-right aligned (query token i sees keys ``[0, seqlen - (s_q - 1 - i))``), natural-log
    lse; a query row that sees no key gets out 0 and lse +inf.
    """
    b, s_q, h_q, d = q.shape
    if softmax_scale is None:
        softmax_scale = D_QK ** -0.5
    kv = dequantize_kv_cache(k_cache, descale_k, kv_format).reshape(-1, D_QK)  # [pages*64, 576]
    qf = q.float() * (descale_q.float() if descale_q is not None else 1.0)
    page = k_cache.shape[1]
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(cache_seqlens[i])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        rows = block_table[i, pos // page].long() * page + pos % page
        k = kv[rows]                                     # [n, 576]
        scores = torch.einsum("shd,nd->shn", qf[i], k) * softmax_scale  # [s_q, h_q, n]
        if causal:
            limit = n - (s_q - 1 - torch.arange(s_q, device=q.device))  # keys visible to each query token
            scores = scores.masked_fill(pos[None, None, :] >= limit[:, None, None], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)        # [s_q, h_q]; -inf where nothing is visible
        seen = torch.isfinite(row_lse)
        p = torch.exp(scores - torch.where(seen, row_lse, 0.0)[..., None])
        out[i] = torch.einsum("shn,nd->shd", p, k[:, :head_dim_v]) * seen[..., None]
        lse[i] = torch.where(seen, row_lse, math.inf).transpose(0, 1)
    return out, lse


def reference_sparse_mla_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                                topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                                head_dim_v: int = D_LATENT, softmax_scale: float | None = None,
                                kv_format: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode (DeepSeek V3.2) in fp32: ``(out [b, s_q, h_q, 512] fp32, lse [b, h_q, s_q] fp32)``.
    ``k_cache`` is any format's cache, or its fp32 values ``[num_pages, 64, 1, 576]``.

    Query token ``(i, s)`` attends to the cache rows ``indices[i, s, :topk_length[i]]`` (row = page * 64 +
    offset; -1 is skipped, a repeated row counts each time); ``attn_sink [h_q]`` scales head h's out by
    ``exp(lse) / (exp(lse) + exp(attn_sink[h]))`` and leaves lse as it is. A query token that sees no row gets
    out 0 and lse +inf.
    """
    b, s_q, h_q, d = q.shape
    if softmax_scale is None:
        softmax_scale = D_QK ** -0.5
    if k_cache.dtype == torch.float32:   # unquantized values
        kv = k_cache.reshape(-1, D_QK)
    else:
        if kv_format is None and k_cache.dtype == torch.uint8:
            kv_format = "fp8_ds_mla"
        kv = dequantize_kv_cache(k_cache, None, kv_format).reshape(-1, D_QK)
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = indices.shape[-1] if topk_length is None else int(topk_length[i])
        for s in range(s_q):
            rows = indices[i, s, :n].long()
            rows = rows[rows != -1]
            if rows.numel() == 0:
                continue
            k = kv[rows]                                            # [n, 576]
            scores = q[i, s].float() @ k.T * softmax_scale          # [h_q, n]
            row_lse = torch.logsumexp(scores, dim=-1)
            o = torch.softmax(scores, dim=-1) @ k[:, :head_dim_v]
            if attn_sink is not None:
                o = o * torch.sigmoid(row_lse - attn_sink.float())[:, None]
            out[i, s] = o
            lse[i, :, s] = row_lse
    return out, lse


def cal_diff(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """FlashMLA's accuracy metrics on float64: cos_diff, RMSE and amax of ``x - y``."""
    x, y = x.double(), y.double()
    cos_diff = 1 - 2 * (x * y).sum().item() / max((x * x + y * y).sum().item(), 1e-12)
    return {"cos_diff": cos_diff, "rmse": (x - y).pow(2).mean().sqrt().item(), "amax": (x - y).abs().max().item()}
