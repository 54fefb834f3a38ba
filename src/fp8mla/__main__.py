"""``python -m fp8mla bench ...``: speed and accuracy against the peer kernels (needs a CUDA GPU).
``python -m fp8mla demo``: accuracy of every cache format on a small batch (runs on the CPU too)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys

NO_GPU = ("fp8mla bench: no CUDA GPU found. The bench times kernels on a GPU (Hopper for the 'hopper' backend "
          "and the FP8 peers).\nOn this machine, run `python -m fp8mla demo` to decode a small batch in Triton's "
          "interpreter and see each cache format's accuracy.")


def _device_or_interpreter() -> str:
    """"cuda", or "cpu" with Triton's interpreter switched on. The switch must come before fp8mla.kernels is
    imported: its kernels become interpreted functions when they are decorated, at import."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    from .api import interpreter_active

    if "fp8mla.kernels" in sys.modules and not interpreter_active():
        raise RuntimeError("fp8mla.kernels was imported without TRITON_INTERPRET=1 and there is no GPU")
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from .bench import add_arguments
    from .demo import H_Q, SEQLENS

    parser = argparse.ArgumentParser(prog="python -m fp8mla", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_arguments(commands.add_parser("bench", help="speed and accuracy against FlashMLA / FA3 (GPU)"))
    demo = commands.add_parser("demo", help="accuracy of every cache format on a small batch (CPU or GPU)")
    demo.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS, help="one cache length per request")
    demo.add_argument("--h-q", type=int, default=H_Q, help="query heads")
    demo.add_argument("--seed", type=int, default=0, help="of the random inputs")
    args = parser.parse_args(argv)

    if args.command == "demo":
        import torch

        from .demo import run_demo

        _, table = run_demo(torch.device(_device_or_interpreter()), args.seqlens, args.h_q, args.seed)
        print(table, end="")
        return 0

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(NO_GPU, file=sys.stderr)
        return 1
    _device_or_interpreter()
    from .bench import run_bench

    return run_bench(args, shlex.join(["python", "-m", "fp8mla", *argv]))


if __name__ == "__main__":
    sys.exit(main())
