"""What the bench reports: FlashMLA's speed formulas (kept as they are, so numbers compare with FlashMLA's) and
the accuracy of an output against the fp32 reference.

FLOPs  = 2 * s_q * sum(seqlens) * h_q * (576 + 512)            (causal masking not subtracted)
bytes  = sum(seqlens) * h_kv * cache bytes per token  +  b * s_q * h_q * 576 * q bytes per element
         + b * s_q * h_q * 512 * 2                              (bf16 out)
A token of a bf16 cache is 576 * 2 bytes and of an fp8 cache 576 bytes, which is FlashMLA's
``(sum(seqlens) * h_kv * 576 + b * s_q * h_q * 576) * bytes_per_elem`` exactly; an ``fp8_rope_bf16`` token is
counted with its real 656 bytes (fp8 latent, its scale, padding and bf16 RoPE), as is an ``fp8_ds_mla`` one.
Sparse decode (FlashMLA's formula too): sum(seqlens) is topk for each batch entry, and every query token reads its
own topk rows.
"""
from __future__ import annotations

import math

import torch

from ..formats import D_LATENT, D_QK, ROW_BYTES
from ..reference import cal_diff

CACHE_BYTES_PER_TOKEN = {"bf16": 2 * D_QK, "fp8": D_QK, "fp8_rope_bf16": ROW_BYTES, "fp8_ds_mla": ROW_BYTES}
NEEDLE_COS = 0.99  # an output row "is" the needle's V when their cosine similarity is above this


def decode_flops(s_q: int, h_q: int, total_seqlen: int) -> int:
    return 2 * s_q * total_seqlen * h_q * (D_QK + D_LATENT)


def decode_bytes(b: int, s_q: int, h_q: int, total_seqlen: int, cache_format: str, q_bytes_per_elem: int,
                 h_kv: int = 1) -> int:
    return (total_seqlen * h_kv * CACHE_BYTES_PER_TOKEN[cache_format] + b * s_q * h_q * D_QK * q_bytes_per_elem
            + b * s_q * h_q * D_LATENT * 2)


def speed(ms: float, flops: int, nbytes: int) -> dict[str, float]:
    """``{"ms", "tflops", "gbps"}`` (1 TFLOPS = 1e12 FLOP/s, 1 GB/s = 1e9 B/s)."""
    return {"ms": ms, "tflops": flops / ms * 1e-9, "gbps": nbytes / ms * 1e-6}


def format_speed(ms: float, tflops: float, gbps: float) -> str:
    return f"{ms:.3f} ms, {tflops:.0f} TFLOPS, {gbps:.0f} GB/s"


def output_error(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor,
                 ref_lse: torch.Tensor) -> dict[str, float | None]:
    """cal_diff of ``out`` against the reference, and the largest lse error over the rows that see a key
    (None when there is no lse of the reference's shape to compare)."""
    result: dict[str, float | None] = dict(cal_diff(out.float(), ref_out.float()))
    seen = torch.isfinite(ref_lse)
    if lse is None or lse.shape != ref_lse.shape:
        result["lse_err"] = None
    elif seen.any():
        result["lse_err"] = (lse.float() - ref_lse)[seen].abs().max().item()  # NaN stays NaN
    else:
        result["lse_err"] = 0.0
    return result


def needle_report(out: torch.Tensor, ref_out: torch.Tensor, kv: torch.Tensor,
                  needles: list[tuple[int, int, int, int]]) -> dict[str, float | int]:
    """For rows whose attention one planted key dominates (see ``inputs.plant_needles``): how many outputs are
    that key's V (cosine > NEEDLE_COS), for ``out`` and for the reference, and the error on those rows alone."""
    rows = kv.reshape(-1, D_QK)
    hits = ref_hits = 0
    got, want = [], []
    for req, s, h, slot in needles:
        v = rows[slot, :D_LATENT].float()
        o, r = out[req, s, h].float(), ref_out[req, s, h].float()
        hits += _cosine(o, v) > NEEDLE_COS
        ref_hits += _cosine(r, v) > NEEDLE_COS
        got.append(o)
        want.append(r)
    cos_diff = cal_diff(torch.stack(got), torch.stack(want))["cos_diff"] if needles else math.nan
    return {"needle_rows": len(needles), "needle_hits": int(hits), "needle_ref_hits": int(ref_hits),
            "needle_cos_diff": cos_diff}


def _cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() @ y.double() / max((x.double().norm() * y.double().norm()).item(), 1e-30)).item()
