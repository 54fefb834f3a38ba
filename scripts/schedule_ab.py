"""Whole-call time (kernel + combine) of the default schedule against the plain cut of the timeline into one part
per SM (``num_parts`` given explicitly), on equal-length batches, with the outputs of both compared:

    PYTHONPATH=src python3 scripts/schedule_ab.py

Prints one markdown table (CUDA-graph medians of three alternating rounds).
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402
from fp8mla import cal_diff  # noqa: E402
from fp8mla.inputs import make_problem  # noqa: E402
from fp8mla.scheduler import num_sm_parts  # noqa: E402

CONFIGS = [(128, 1, 16), (64, 2, 16), (64, 2, 64), (32, 2, 64), (16, 2, 64), (8, 2, 64), (4, 2, 64), (8, 1, 16)]
FORMATS = [("fp8", True), ("fp8_rope_bf16", False), ("bf16", False)]   # (cache format, e4m3 q)


def main():
    print("| config | format | plain cut µs | default µs | default / plain |\n|---|---|---|---|---|")
    for b, s_q, h_q in CONFIGS:
        p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
        parts = num_sm_parts(torch.device("cuda"), s_q * h_q)
        for kv_format, q_fp8 in FORMATS:
            calls = {"plain": hopper_check.decode_call(p, kv_format, q_fp8, True, parts),
                     "default": hopper_check.decode_call(p, kv_format, q_fp8, True, None)}
            outs = {name: call()[0].float() for name, call in calls.items()}
            d = cal_diff(outs["default"], outs["plain"])["cos_diff"]
            # FP8 P is quantized against each piece's running max, so other pieces give slightly other bits
            assert d < (1e-5 if kv_format == "bf16" else 2e-4), (b, s_q, h_q, kv_format, d)
            times = {name: [] for name in calls}
            for _ in range(3):
                for name, call in calls.items():
                    times[name].append(triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median") * 1e3)
            med = {name: sorted(t)[1] for name, t in times.items()}
            print(f"| b={b} s_q={s_q} h_q={h_q} ({parts} parts) | {kv_format} | {med['plain']:.1f} | "
                  f"{med['default']:.1f} | {med['default'] / med['plain']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
