"""Host cost of fp8mla's own Python in one eager decode call, on any machine (no GPU needed): the Hopper path with
every kernel launch replaced by a fake compiled kernel, so what is timed is the API's checks, the buffers, the
launch arguments and the launchers' cache keys (Triton's launcher and the driver are not):

    PYTHONPATH=src python3 scripts/host_cost.py [--calls 500 --rounds 5]

Prints µs per call (best of the rounds of --calls calls) for each cache format at two batch shapes.
"""
import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"   # CPU tensors pass the API's device check (no kernel runs)

import time  # noqa: E402

import fp8mla  # noqa: E402
from fp8mla import kernels  # noqa: E402
from fp8mla.inputs import make_problem  # noqa: E402
from fp8mla.kernels import combine, launcher, q_quant  # noqa: E402
from fp8mla.kernels.hopper import launch  # noqa: E402


class FakeKernel:
    function, packed_metadata = "function", "packed"

    def launch_metadata(self, grid, stream, *params):
        return None

    def run(self, *args):
        pass


class FakeJit:
    """Stands for a kernel's @jit function: the first launch of a specialization 'compiles' a FakeKernel."""

    def __init__(self, fn):
        self.arg_names = fn.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: FakeKernel()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best is printed)")
    args = parser.parse_args()
    launcher._interpreting = lambda: False
    launcher._current_device = lambda: 0
    launcher._current_stream = lambda device: 0
    launcher._current_arch = lambda: 90
    kernels.hopper_unavailable = lambda device: None
    for launch_ in (launch._launch_fp8, launch._launch_small, launch._launch_bf16, combine._launch, q_quant._launch):
        launch_.fn = FakeJit(launch_.fn)
    for b, s_q, h_q in [(2, 1, 16), (64, 2, 64)]:
        p = make_problem(b, s_q, h_q, [512] * b, seed=0)
        meta, splits = fp8mla.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1)
        for kv_format, q_fp8 in [("fp8", True), ("fp8_rope_bf16", False), ("bf16", False)]:
            x = p.quantized(kv_format, q_fp8)

            def call():
                fp8mla.flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta,
                                              splits, causal=True, descale_q=x["descale_q"], descale_k=x["descale_k"],
                                              backend="hopper", validate=False)
            for _ in range(50):
                call()
            rounds = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
            print(f"b={b} s_q={s_q} h_q={h_q} {kv_format:14s} {min(rounds):6.1f} us a call (launches faked)",
                  flush=True)


if __name__ == "__main__":
    main()
