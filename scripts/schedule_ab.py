"""Whole-call time (kernel + combine) of the default schedule against the plain cut of the timeline into one part
per SM (``num_parts`` given explicitly), on equal-length batches, with the outputs of both compared:

    PYTHONPATH=src python3 scripts/schedule_ab.py

or, with ``--parts N [N ...]``, against those part counts instead (e.g. fewer, longer pieces for a small batch;
``--configs`` picks the configs as b,s_q,h_q triples):

    PYTHONPATH=src python3 scripts/schedule_ab.py --configs 1,2,128 2,2,128 4,2,64 --parts 8 16 24

Prints one markdown table (CUDA-graph medians of three alternating rounds).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402
from fp8mla import cal_diff  # noqa: E402
from fp8mla.inputs import make_problem  # noqa: E402
from fp8mla.scheduler import num_sm_parts  # noqa: E402

CONFIGS = [(128, 1, 16), (64, 2, 16), (64, 2, 64), (32, 2, 64), (16, 2, 64), (8, 2, 64), (4, 2, 64), (8, 1, 16)]
FORMATS = [("fp8", True), ("fp8_rope_bf16", False), ("bf16", False)]   # (cache format, e4m3 q)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", help="b,s_q,h_q triples (8192 tokens each, causal)")
    parser.add_argument("--parts", type=int, nargs="+", help="part counts to time against the default schedule")
    args = parser.parse_args()
    configs = [tuple(map(int, c.split(","))) for c in args.configs] if args.configs else CONFIGS
    others = [f"{n} parts" for n in args.parts] if args.parts else ["plain cut"]
    print("| config | format | default µs | " + " | ".join(f"{o} µs | default / {o}" for o in others) + " |\n"
          + "|---" * (3 + 2 * len(others)) + "|")
    for b, s_q, h_q in configs:
        p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
        counts = args.parts or [num_sm_parts(torch.device("cuda"), s_q * h_q)]
        for kv_format, q_fp8 in FORMATS:
            calls = {"default": hopper_check.decode_call(p, kv_format, q_fp8, True, None)}
            calls.update({o: hopper_check.decode_call(p, kv_format, q_fp8, True, n) for o, n in zip(others, counts)})
            base = calls["default"]()[0].float()
            for name in others:
                d = cal_diff(calls[name]()[0].float(), base)["cos_diff"]
                # FP8 P is quantized against each piece's running max, so other pieces give slightly other bits
                assert d < (1e-5 if kv_format == "bf16" else 2e-4), (b, s_q, h_q, kv_format, name, d)
            _, med = hopper_check.alternating_medians(calls, 3)
            print(f"| b={b} s_q={s_q} h_q={h_q} | {kv_format} | {med['default']:.1f} | "
                  + " | ".join(f"{med[o]:.1f} | {med['default'] / med[o]:.3f}" for o in others) + " |", flush=True)


if __name__ == "__main__":
    main()
