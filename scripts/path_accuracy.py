"""cos_diff of out against the fp32 reference for each FP8 path (the fp8 cache with a bf16 and an e4m3 q,
fp8_rope_bf16 with a bf16 q), randn and RoPE x8, a few seeds: what a path's q handling costs in accuracy.

    PYTHONPATH=src python3 scripts/path_accuracy.py [hopper|portable]      (CPU: TRITON_INTERPRET=1, portable)
"""
import argparse

import torch

import fp8mla
from fp8mla.inputs import make_problem
from fp8mla.reference import cal_diff, reference_mla_decode

PATHS = [("fp8", False), ("fp8", True), ("fp8_rope_bf16", False)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", nargs="?", default="portable", choices=fp8mla.BACKENDS)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rope_scale in (1.0, 8.0):
        for seed in range(args.seeds):
            p = make_problem(1, 2, 64, [1024], device=device, rope_scale=rope_scale, seed=seed)
            meta, splits = fp8mla.get_mla_metadata(p.cache_seqlens, 2 * 64, 1)
            ref, _ = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)
            row = []
            for kv_format, q_fp8 in PATHS:
                x = p.quantized(kv_format, q_fp8=q_fp8)
                out, _ = fp8mla.flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512,
                                                       meta, splits, causal=True, descale_q=x["descale_q"],
                                                       descale_k=x["descale_k"], backend=args.backend)
                row.append(f"{kv_format}/{'e4m3' if q_fp8 else 'bf16'} q {cal_diff(out.float(), ref)['cos_diff']:.3e}")
            print(f"rope x{rope_scale:g} seed {seed}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
