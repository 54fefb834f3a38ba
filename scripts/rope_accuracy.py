"""Accuracy of each cache format with randn and with ×8 RoPE dims (README's "why the RoPE part stays BF16").

Runs the portable kernel anywhere (``TRITON_INTERPRET=1`` on a CPU: exact FP8 rounding, fp32 dot accumulation):
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/rope_accuracy.py
"""
import argparse

import torch

from fp8mla import cal_diff, flash_mla_with_kvcache, get_mla_metadata
from fp8mla.inputs import make_problem
from fp8mla.reference import reference_mla_decode

METHODS = [("bf16", False, "bf16 (bf16)"), ("fp8", True, "fp8 (e4m3, per tensor)"), ("fp8", False, "fp8 (bf16)"),
           ("fp8_rope_bf16", False, "fp8_rope_bf16 (bf16)")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 1500])
    parser.add_argument("--h-q", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s_q = 2
    print("| RoPE scale | format (q) | cos_diff | RMSE | amax |\n|---|---|---|---|---|")
    for rope_scale in (1.0, 8.0):
        p = make_problem(len(args.seqlens), s_q, args.h_q, args.seqlens, device=device, rope_scale=rope_scale,
                         seed=args.seed)
        ref, _ = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)
        meta, splits = get_mla_metadata(p.cache_seqlens, s_q * args.h_q, 1)
        for kv_format, q_fp8, label in METHODS:
            x = p.quantized(kv_format, q_fp8)
            out, _ = flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta, splits,
                                            causal=True, descale_q=x["descale_q"], descale_k=x["descale_k"],
                                            kv_format=kv_format, backend="portable")
            d = cal_diff(out.float(), ref)
            print(f"| ×{rope_scale:g} | {label} | {d['cos_diff']:.2e} | {d['rmse']:.2e} | {d['amax']:.2e} |",
                  flush=True)


if __name__ == "__main__":
    main()
