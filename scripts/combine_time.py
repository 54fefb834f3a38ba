"""What the combine step costs: the combine kernel alone (CUDA-graph median) on the FP8 formats' partial results of the default
schedule, next to the whole call, for the bench's configs:

    PYTHONPATH=src python3 scripts/combine_time.py
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402
from fp8mla import get_mla_metadata  # noqa: E402
from fp8mla.inputs import make_problem  # noqa: E402
from fp8mla.kernels import partial_dtype  # noqa: E402
from fp8mla.kernels.combine import launch_combine  # noqa: E402

CONFIGS = [(128, 1, 16), (64, 2, 16), (64, 2, 64), (32, 2, 64), (8, 2, 64), (1, 2, 128)]


def main():
    print("| config | requests split | partial rows | combine µs | whole call µs (fp8, e4m3 q) | combine share |\n"
          "|---|---|---|---|---|---|")
    for b, s_q, h_q in CONFIGS:
        p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
        meta, num_splits = get_mla_metadata(p.cache_seqlens, s_q * h_q, 1)
        per_req = (num_splits[1:] - num_splits[:-1]).tolist()
        rows = s_q * h_q
        o_part = torch.randn(b + meta.shape[0], rows, 512, device="cuda").to(partial_dtype("fp8"))
        lse_part = torch.randn(b + meta.shape[0], rows, device="cuda")
        out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(b, h_q, s_q, device="cuda")
        combine = triton.testing.do_bench_cudagraph(lambda: launch_combine(out, lse, o_part, lse_part, num_splits),
                                                    rep=100, return_mode="median") * 1e3
        call = hopper_check.decode_call(p, "fp8", True, True)
        whole = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median") * 1e3
        split = sum(n > 1 for n in per_req)
        print(f"| b={b} s_q={s_q} h_q={h_q} | {split} of {b} (up to {max(per_req)} pieces) | "
              f"{sum(n for n in per_req if n > 1) * rows} | {combine:.1f} | {whole:.1f} | {combine / whole:.1%} |",
              flush=True)


if __name__ == "__main__":
    main()
