"""``python -m fp8mla demo``: decode a small batch with every cache format and print how close each output is to
the fp32 reference on the unquantized inputs, for randn inputs and with the RoPE dims ×8 (the case where one
per-tensor FP8 scale breaks down and the ``fp8_rope_bf16`` format does not); then DeepSeek V3.2's sparse call
on a 656-byte cache whose latent groups differ in magnitude, in both of its readings."""
from __future__ import annotations

import torch

from .api import flash_mla_with_kvcache, get_mla_metadata
from .formats import TOKEN_SCALED
from .inputs import GROUP_SCALES, make_problem, make_sparse_problem
from .bench.metrics import output_error
from .bench.report import describe, sci
from .reference import reference_mla_decode, reference_sparse_mla_decode

S_Q, H_Q, SEQLENS = 2, 16, [300, 77]
CASES = (("randn", 1.0), ("RoPE ×8", 8.0))
VARIANTS = (("bf16", False), ("fp8", False), ("fp8", True), ("fp8_rope_bf16", False))  # (format, e4m3 q)
SPARSE_TOPK = 128   # the sparse case: indices a query token
SPARSE_CASE = f"sparse, topk {SPARSE_TOPK}, groups ×{', ×'.join(f'{g:g}' for g in GROUP_SCALES)}"


def run_demo(device: torch.device, seqlens: list[int] = SEQLENS, h_q: int = H_Q, seed: int = 0,
             progress=lambda message: None) -> tuple[list[dict], str]:
    """Decode every case and variant on ``device`` (one request per entry of ``seqlens``, inputs drawn with
    ``seed``); returns the rows and the markdown table. ``progress`` gets a line per step."""
    rows = []
    for case, rope_scale in CASES:
        progress(f"{case}: inputs and the fp32 reference")
        p = make_problem(len(seqlens), S_Q, h_q, seqlens, device=device, rope_scale=rope_scale, seed=seed)
        ref_out, ref_lse = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)
        meta, num_splits = get_mla_metadata(p.cache_seqlens, S_Q * h_q, 1)
        for kv_format, q_fp8 in VARIANTS:
            row = dict(case=case, format=kv_format, q="e4m3 per tensor" if q_fp8 else "bf16")
            progress(f"{case}: {kv_format} cache, {row['q']} q")
            x = p.quantized(kv_format, q_fp8)
            try:
                out, lse = flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta,
                                                  num_splits, causal=True, descale_q=x["descale_q"],
                                                  descale_k=x["descale_k"], kv_format=kv_format)
                row.update(output_error(out, lse, ref_out, ref_lse))
            except Exception as e:  # one broken variant should not hide the others
                row["error"] = describe(e)
            rows.append(row)
    rows += _sparse_rows(device, len(seqlens), h_q, seed, progress)
    where = "CUDA" if device.type == "cuda" else "CPU, Triton interpreter"
    lines = [f"fp8mla demo ({where}): b={len(seqlens)} s_q={S_Q} h_q={h_q} seqlens={seqlens}, causal, seed {seed}; "
             f"out vs the fp32 reference on the unquantized inputs; the sparse case: s_q=1, each query token's "
             f"{SPARSE_TOPK} indices of {2 * SPARSE_TOPK} tokens, as fp8mla's writer (one descale a token: "
             "fp8_rope_bf16) and vLLM's (one a 128-dim group: fp8_ds_mla) store them"
             + ("" if device.type == "cuda" else " (the portable kernel rescales each group to its token's largest "
                "descale, so here both readings do the same arithmetic; the Hopper kernels read the groups as "
                "they are)"), "",
             "| case | cache format | q | cos_diff | RMSE | amax | lse err |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        metrics = ([f"failed: {r['error']}", "", "", ""] if "error" in r else
                   [sci(r[k]) for k in ("cos_diff", "rmse", "amax", "lse_err")])
        lines.append("| " + " | ".join([r["case"], r["format"], r["q"], *metrics]) + " |")
    return rows, "\n".join(lines) + "\n"


def _sparse_rows(device, b: int, h_q: int, seed: int, progress) -> list[dict]:
    """DeepSeek V3.2's sparse call, as vLLM makes it, on each reading of a 656-byte cache of the same values."""
    progress(f"{SPARSE_CASE}: inputs and the fp32 reference")
    p = make_sparse_problem(b, 1, h_q, SPARSE_TOPK, device=device, seed=seed)
    ref_out, ref_lse = reference_sparse_mla_decode(p.q, p.kv, p.indices, p.topk_length, p.attn_sink)
    rows = []
    for kv_format in TOKEN_SCALED:
        row = dict(case=SPARSE_CASE, format=kv_format, q="bf16")
        progress(f"{SPARSE_CASE}: {kv_format} cache")
        schedule, _ = get_mla_metadata()
        try:
            out, lse = flash_mla_with_kvcache(p.q, p.quantized(kv_format)["k_cache"], None, None, 512, schedule, None,
                                              is_fp8_kvcache=True, indices=p.indices, topk_length=p.topk_length,
                                              attn_sink=p.attn_sink, kv_format=kv_format)
            row.update(output_error(out, lse, ref_out, ref_lse))
        except Exception as e:
            row["error"] = describe(e)
        rows.append(row)
    return rows
