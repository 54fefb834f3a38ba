"""A/B of combine kernel versions (copies of ``kernels/combine.py``, e.g. ``git show REV:src/fp8mla/kernels/
combine.py > /tmp/old.py``): each merges the same random partials of the default schedule's split counts, checked
against the first, and all are timed in alternating rounds (CUDA-graph medians), bf16 and fp32 partials:

    PYTHONPATH=src python3 scripts/combine_ab.py /tmp/old.py src/fp8mla/kernels/combine.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402
from fp8mla import get_mla_metadata  # noqa: E402

CONFIGS = [(1, 2, 128), (1, 2, 64), (2, 2, 128), (8, 2, 64), (32, 2, 64), (64, 2, 16), (4, 1, 16)]


def main():
    versions = {f"{Path(p).stem}_{i}": hopper_check.load_module(p, f"_combine_ab_{i}")
                for i, p in enumerate(sys.argv[1:])}
    names = list(versions)
    print("| config | partials | " + " | ".join(f"{n} µs" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |\n" + "|---" * (1 + 2 * len(names)) + "|")
    for b, s_q, h_q in CONFIGS:
        meta, num_splits = get_mla_metadata(torch.full((b,), 8192, dtype=torch.int32, device="cuda"), s_q * h_q, 1)
        rows = s_q * h_q
        for dtype in (torch.bfloat16, torch.float32):
            o_part = torch.randn(b + meta.shape[0], rows, 512, device="cuda").to(dtype)
            lse_part = torch.randn(b + meta.shape[0], rows, device="cuda") * 3
            calls, outs = {}, {}
            for name, module in versions.items():
                outs[name] = (torch.zeros(b, s_q, h_q, 512, dtype=torch.bfloat16, device="cuda"),
                              torch.zeros(b, h_q, s_q, device="cuda"))
                calls[name] = (lambda m=module, o=outs[name]: m.launch_combine(*o, o_part, lse_part, num_splits))
                calls[name]()
            for name in names[1:]:
                assert torch.allclose(outs[name][0].float(), outs[names[0]][0].float(), atol=2e-2, rtol=1e-2), name
                assert torch.allclose(outs[name][1], outs[names[0]][1], atol=1e-4), name
            _, med = hopper_check.alternating_medians(calls, 3)
            print(f"| b={b} s_q={s_q} h_q={h_q} | {str(dtype)[6:]} | " + " | ".join(f"{med[n]:.1f}" for n in names)
                  + " | " + " | ".join(f"{med[n] / med[names[0]]:.2f}" for n in names[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
