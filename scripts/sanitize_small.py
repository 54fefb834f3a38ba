"""One small decode per Hopper-kernel path (and the cache writer, the combine), for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=src compute-sanitizer --tool memcheck python3 scripts/sanitize_small.py
    PYTHONPATH=src compute-sanitizer --tool racecheck python3 scripts/sanitize_small.py

Without the caching allocator every tensor is its own allocation, so a read past a sequence's pages or past a
tensor's end is an error memcheck sees. The first run compiles (slow under the sanitizer): warm the Triton cache
by running this script once without it.
"""
import argparse
import sys

import torch

import fp8mla
from fp8mla import cal_diff, reference_mla_decode
from fp8mla.inputs import make_problem

parser = argparse.ArgumentParser()
parser.add_argument("--seqlens", type=int, nargs="+", default=[1000, 70])
parser.add_argument("--s-q", type=int, default=2)
parser.add_argument("--h-q", type=int, default=64)
parser.add_argument("--parts", type=int, default=5, help="split-KV parts (CTAs per row block)")
parser.add_argument("--formats", nargs="+", default=["fp8_rope_bf16", "fp8:q8", "fp8"])
args = parser.parse_args()
problem = make_problem(len(args.seqlens), args.s_q, args.h_q, args.seqlens, device="cuda", seed=0, extra_pages=0)
ref_out, _ = reference_mla_decode(problem.q, problem.kv, problem.block_table, problem.cache_seqlens, causal=True)
meta, splits = fp8mla.get_mla_metadata(problem.cache_seqlens, args.s_q * args.h_q, 1, num_parts=args.parts)
worst = 0.0
for kv_format, q_fp8 in [(f.split(":")[0], f.endswith(":q8")) for f in args.formats]:
    x = problem.quantized(kv_format, q_fp8)
    cache = fp8mla.empty_kv_cache(x["k_cache"].shape[0], kv_format, device="cuda")
    tokens = problem.kv.reshape(-1, 576)
    fp8mla.write_kv_cache(tokens[:, :512], tokens[:, 512:], cache, torch.arange(len(tokens), device="cuda"),
                          kv_format, x["descale_k"])
    out, lse = fp8mla.flash_mla_with_kvcache(x["q"], cache, problem.block_table, problem.cache_seqlens, 512, meta,
                                             splits, causal=True, descale_q=x["descale_q"],
                                             descale_k=x["descale_k"], backend="hopper")
    torch.cuda.synchronize()
    d = cal_diff(out.float(), ref_out)["cos_diff"]
    worst = max(worst, d)
    print(f"{kv_format} q_fp8={q_fp8}: cos_diff {d:.2e}", flush=True)
sys.exit(0 if worst < 2.5e-3 else 1)
