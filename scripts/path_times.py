"""Whole-call time of the four Hopper paths (fp8_rope_bf16, fp8 with an e4m3 q, bf16, fp8 with a bf16 q) at a few
configs, in alternating rounds in one process, each against fp8 with an e4m3 q (which quantizes nothing in the
kernel): what a bf16 q and the formats cost.

    PYTHONPATH=src python3 scripts/path_times.py [--configs 1,2,128 8,2,64 ...]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402
from fp8mla.inputs import make_problem  # noqa: E402

CONFIGS = [(1, 2, 128), (8, 2, 64), (64, 2, 64), (128, 1, 16)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", help="b,s_q,h_q triples (8192 tokens each, causal)")
    args = parser.parse_args()
    configs = [tuple(map(int, c.split(","))) for c in args.configs] if args.configs else CONFIGS
    names = [f"{f} ({'e4m3' if q8 else 'bf16'} q)" for f, q8 in hopper_check.PATHS]
    print("| config | " + " | ".join(f"{n} µs (ratio)" for n in names) + " |\n" + "|---" * (1 + len(names)) + "|")
    for b, s_q, h_q in configs:
        p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
        calls = {n: hopper_check.decode_call(p, f, q8, True) for n, (f, q8) in zip(names, hopper_check.PATHS)}
        for call in calls.values():
            call()
        _, med = hopper_check.alternating_medians(calls, 3)
        base = med["fp8 (e4m3 q)"]
        print(f"| b={b} s_q={s_q} h_q={h_q} | " + " | ".join(f"{med[n]:.1f} ({med[n] / base:.2f})" for n in names)
              + " |", flush=True)


if __name__ == "__main__":
    main()
