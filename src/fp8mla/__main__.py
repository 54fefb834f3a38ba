"""fp8mla's commands: ``bench`` (speed, host cost and accuracy against the peer kernels, on a GPU), ``demo``
(every cache format's accuracy on a small batch, on a GPU or in Triton's CPU interpreter) and ``fetch-peers`` (the
peer kernels' binaries, for the bench)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

NO_GPU = ("fp8mla bench: no CUDA GPU found. The bench times kernels on a GPU (Hopper for the 'hopper' backend "
          "and the FP8 peers).\nOn this machine, run `python -m fp8mla demo` to decode a small batch in Triton's "
          "interpreter and see each cache format's accuracy.")


def _device_or_interpreter() -> str:
    """"cuda", or "cpu" with Triton's interpreter switched on. The switch must come before a kernel module is
    imported: its kernels become interpreted functions when they are decorated."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    from .runtime import interpreter_active

    if "fp8mla.kernels.combine" in sys.modules and not interpreter_active():
        raise RuntimeError("fp8mla's kernels were imported without TRITON_INTERPRET=1 and there is no GPU")
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def _progress(start: float):
    def progress(message: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {message}", file=sys.stderr, flush=True)
    return progress


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends in "(default: X)" unless there is nothing to say or the help says it already: not for
    a default of None (the option is off, or its help says what stands in), a flag (store_true / store_false), or a
    help that names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    from .bench import add_arguments as bench_arguments
    from .bench.fetch import add_arguments as fetch_arguments
    from .demo import H_Q, SEQLENS

    formatter = HelpFormatter
    p = argparse.ArgumentParser(prog="python -m fp8mla", description=__doc__, formatter_class=formatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench_arguments(commands.add_parser(
        "bench", formatter_class=formatter, help="speed and accuracy against FlashMLA / FA3 (needs a GPU)",
        description="Times every cache format and backend of fp8mla and the peers (FlashMLA BF16, FlashMLA dense "
                    "FP8, FA3-MLA; with --sparse FlashMLA's sparse decode) on the same inputs in one process: "
                    "graph-replay and eager ms, TFLOPS, GB/s, host "
                    "us per call, speedups over the peers of the same kind, and each output's error against an fp32 "
                    "reference. Without size options it runs the default suite (about 3 minutes on an H200). "
                    "Results go to --out as markdown, JSON and two plots; progress goes to stderr."))
    demo = commands.add_parser(
        "demo", formatter_class=formatter, help="accuracy of every cache format on a small batch (CPU or GPU)",
        description="Decodes a small batch with every cache format (bf16, fp8 with a bf16 or an e4m3 q, "
                    "fp8_rope_bf16), for randn inputs and with the RoPE dims x8, then DeepSeek V3.2's sparse call "
                    "on a 656-byte cache read both ways (fp8_ds_mla, fp8_rope_bf16), and prints each output's "
                    "error against an fp32 reference on the unquantized inputs. Without a GPU it runs in Triton's "
                    "interpreter: on a 2-core CPU about 3.5 s with the defaults, 13 s with --seqlens "
                    "8192 8192.")
    demo.add_argument("--seqlens", type=int, nargs="+", default=SEQLENS, help="one cache length per request")
    demo.add_argument("--h-q", type=int, default=H_Q, help="query heads")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    fetch_arguments(commands.add_parser(
        "fetch-peers", formatter_class=formatter, help="the peer kernels' binaries, for the bench",
        description="Downloads the vllm wheel from the package index with pip and takes FlashMLA's BF16 and dense "
                    "FP8 decode extensions (the first also has its sparse decode; with --fa3 also FA3-MLA) out of it "
                    "into DEST, for `bench --peers DEST`."))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    progress = _progress(time.monotonic())

    if args.command == "fetch-peers":
        from .bench.fetch import fetch_peers

        fetch_peers(args.dest, args.vllm, args.python, args.fa3, progress)
        return 0
    if args.command == "demo":
        import torch

        device = torch.device(_device_or_interpreter())
        from .demo import run_demo

        _, table = run_demo(device, args.seqlens, args.h_q, args.seed, progress)
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
