"""Quick device check of the Hopper kernel, and the program compute-sanitizer runs.

Every Hopper path (fp8_rope_bf16; fp8 with an e4m3 q; fp8 with a bf16 q) on caches written by ``write_kv_cache``,
with and without splits, against the fp32 reference; then timings of the two key configs (``--no-time`` skips
them; the bench has them with the peers). ``--seqlens`` (with ``--s-q``, ``--h-q``, ``--parts``) checks one case
instead of the default three:

    PYTHONPATH=src python3 scripts/hopper_check.py [--no-time]
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=src compute-sanitizer --tool memcheck \\
        python3 scripts/hopper_check.py --no-time --seqlens 1000 70 --parts 5
    PYTHONPATH=src compute-sanitizer --tool racecheck python3 scripts/hopper_check.py --no-time --seqlens 1000 70 --parts 5

Without the caching allocator every tensor is its own allocation, so a read past a sequence's pages or past a
tensor's end is an error memcheck sees. Under a sanitizer the first run compiles slowly: warm the Triton cache by
running the same command once without it. Exits 1 on any mismatch.
"""
import argparse
import sys

import torch
import triton

import fp8mla
from fp8mla import cal_diff, reference_mla_decode
from fp8mla.inputs import make_problem

PATHS = [("fp8_rope_bf16", False), ("fp8", True), ("fp8", False)]  # (cache format, e4m3 q)
CASES = [(1, 16, [200, 0, 77], False), (2, 64, [1000, 64], True), (4, 128, [129, 700, 5, 2100], True)]


def decode_call(p, kv_format, q_fp8, causal, num_parts=None):
    """The Hopper decode of problem ``p`` with its cache written by ``write_kv_cache``, as a no-argument call."""
    b, s_q, h_q = p.shape
    x = p.quantized(kv_format, q_fp8)
    cache = fp8mla.empty_kv_cache(x["k_cache"].shape[0], kv_format, device="cuda")
    tokens = p.kv.reshape(-1, 576)
    fp8mla.write_kv_cache(tokens[:, :512], tokens[:, 512:], cache, torch.arange(len(tokens), device="cuda"),
                          kv_format, x["descale_k"])
    meta, splits = fp8mla.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1, num_parts=num_parts)
    return lambda: fp8mla.flash_mla_with_kvcache(x["q"], cache, p.block_table, p.cache_seqlens, 512, meta, splits,
                                                 causal=causal, descale_q=x["descale_q"], descale_k=x["descale_k"],
                                                 backend="hopper", validate=False)


def check(cases, parts_list) -> bool:
    ok = True
    for s_q, h_q, seqlens, causal in cases:
        p = make_problem(len(seqlens), s_q, h_q, seqlens, device="cuda", seed=0, extra_pages=0)
        ref_out, ref_lse = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=causal)
        empty = torch.isinf(ref_lse)
        for kv_format, q_fp8 in PATHS:
            for parts in parts_list:
                out, lse = decode_call(p, kv_format, q_fp8, causal, parts)()
                d = cal_diff(out.float(), ref_out)["cos_diff"]
                good = (d < 2.5e-3 and not out.isnan().any() and torch.equal(torch.isinf(lse), empty)
                        and torch.allclose(lse[~empty], ref_lse[~empty], atol=0.2))
                ok &= good
                print(f"check b={len(seqlens)} s_q={s_q} h_q={h_q} {kv_format} q_fp8={q_fp8} parts={parts}: "
                      f"cos_diff {d:.2e} {'ok' if good else 'FAIL'}", flush=True)
    print("ALL OK" if ok else "FAILURES", flush=True)
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-time", action="store_true", help="correctness only")
    parser.add_argument("--seqlens", type=int, nargs="+", help="one case: a cache length per request")
    parser.add_argument("--s-q", type=int, default=2)
    parser.add_argument("--h-q", type=int, default=64)
    parser.add_argument("--parts", type=int, help="split-KV parts for the one case (default: None and 7)")
    args = parser.parse_args()
    if args.seqlens:
        ok = check([(args.s_q, args.h_q, args.seqlens, True)], [args.parts] if args.parts else [None, 7])
    else:
        ok = check(CASES, [None, 7])
    if not ok:
        sys.exit(1)
    if args.no_time:
        return
    for b, s_q, h_q in [(64, 2, 64), (128, 1, 16)]:
        p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
        for kv_format, q_fp8 in PATHS[:2]:
            call = decode_call(p, kv_format, q_fp8, True)
            call()
            ms = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
            print(f"time b={b} s_q={s_q} h_q={h_q} {kv_format:14} q_fp8={q_fp8} {ms * 1000:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
