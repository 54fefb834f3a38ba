"""GPU check of every Hopper path against the fp32 reference; A/B timing of other source trees and of the kernels'
ablations; the program the sanitizers and the profiler run.

Every Hopper path (fp8_rope_bf16; fp8 with an e4m3 q; bf16; fp8 with a bf16 q) on caches written by
``write_kv_cache``, with and without splits, against the reference; then timings of the two key configs (``--no-time``
skips them; the bench has them with the peers). ``--seqlens`` (with ``--s-q``, ``--h-q``, ``--parts``) checks one
case instead of the default ones:

    PYTHONPATH=src python3 scripts/hopper_check.py [--no-time]
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=src compute-sanitizer --tool memcheck \\
        python3 scripts/hopper_check.py --no-time --seqlens 1000 70 --parts 5

A/B: ``--trees DIR ...`` other source trees whole (``DIR/src/fp8mla``, e.g. a branch materialized by ``git archive
BRANCH src | tar -x -C DIR``), each imported as a package of its own and called through its own API; ``--ablate``
the working tree's 64-row kernels with stages skipped (kernels/hopper/ablations.py: every ABLATIONS entry, or those
named, each on the paths whose kernel implements it). Each tree is checked like the working tree, then everything
is timed in alternating rounds on the same inputs (``--rounds``; each call in a CUDA graph, so the host's launch
cost is not timed), and a table gives each variant's median against the working tree's (``--timed B,S_Q,H_Q ...``
and ``--paths`` choose the configs and paths timed, ``--check-timed-paths`` checks only those paths: for a short
device call):

    PYTHONPATH=src python3 scripts/hopper_check.py --trees ab/next --rounds 5
    PYTHONPATH=src python3 scripts/hopper_check.py --trees ab/next --seqlens 1000 70 --timed 64,2,64 --paths fp8q \\
        --check-timed-paths
    PYTHONPATH=src python3 scripts/hopper_check.py --ablate [--b 64 --s-q 2 --h-q 64]
    PYTHONPATH=src python3 scripts/hopper_check.py --ablate "half loads" "no refills" --paths bf16

``--sparse`` checks and times the sparse call instead (both readings of a 656-byte cache, or ``--readings``'s;
SPARSE_TIMED's configs, topk 2048 of 8192 tokens as the bench draws them), with ``--trees`` as an A/B in one process:

    PYTHONPATH=src python3 scripts/hopper_check.py --sparse --trees ab/next --rounds 5 [--readings fp8_ds_mla]

``--profile [FORMAT]`` only runs one config (the headline b=64 s_q=2 h_q=64 unless ``--b/--s-q/--h-q`` say
otherwise; fp8_rope_bf16 unless FORMAT is fp8 (e4m3 q) or bf16) three times, for a profiler (the kernels' names:
``mla_decode_hopper_kernel``, ``mla_decode_hopper_small_kernel`` for s_q * h_q <= 32, ``mla_decode_hopper_bf16``);
with ``--sparse`` it is the sparse call instead (topk 2048 of 8192 tokens a batch entry, the bench's; FORMAT
fp8_ds_mla or fp8_rope_bf16, the cache's reading); ncu's source page then goes through scripts/ncu_stalls.py:

    PYTHONPATH=src ncu --clock-control none -k regex:mla_decode_hopper -s 2 -c 1 --section WarpStateStats \\
        --section SourceCounters -o prof python3 scripts/hopper_check.py --profile
"""
import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch
import triton

import fp8mla
from fp8mla import cal_diff, reference_mla_decode, reference_sparse_mla_decode
from fp8mla.bench.run import SPARSE_FORMATS as SPARSE_READINGS   # a 656-byte cache's two readings
from fp8mla.inputs import make_problem, make_sparse_problem
from fp8mla.kernels.hopper.ablations import ABLATIONS, BF16_FLAGS, FP8_FLAGS

# (cache format, e4m3 q) by --paths' names (fp8q: the fp8 cache with an e4m3 q); the first three are timed by default
PATH_NAMES = {"fp8_rope_bf16": ("fp8_rope_bf16", False), "fp8q": ("fp8", True), "bf16": ("bf16", False),
              "fp8": ("fp8", False)}
PATHS = list(PATH_NAMES.values())
CASES = [(1, 16, [200, 0, 77], False), (2, 16, [300, 1000], True), (2, 64, [1000, 64], True),
         (4, 128, [129, 700, 5, 2100], True), (2, 64, [1, 65], True)]
TIMED = [(64, 2, 64), (128, 1, 16)]   # b, s_q, h_q at 8192 tokens each, causal
SPARSE_TIMED = [(64, 1, 128), (128, 2, 128), (64, 1, 64), (64, 2, 32), (64, 1, 16)]   # b, s_q, h_q of --sparse


def load_tree(root, name: str):
    """The fp8mla package of the source tree ``root`` (``root/src/fp8mla``), imported as a package named ``name``:
    its API, kernels and helpers all the tree's own."""
    package = Path(root) / "src" / "fp8mla"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


class Variant:
    """A way to decode: a tree's fp8mla API, with the working tree's ablation flags (0: none)."""

    def __init__(self, api, ablate: int = 0):
        self.api, self.ablate = api, ablate

    def decode_call(self, p, kv_format, q_fp8, causal, num_parts=None):
        """The Hopper decode of problem ``p`` with its cache written by ``write_kv_cache``, as a no-argument call."""
        api = self.api
        b, s_q, h_q = p.shape
        x = p.quantized(kv_format, q_fp8)
        cache = api.empty_kv_cache(x["k_cache"].shape[0], kv_format, device="cuda")
        tokens = p.kv.reshape(-1, 576)
        api.write_kv_cache(tokens[:, :512], tokens[:, 512:], cache, torch.arange(len(tokens), device="cuda"),
                           kv_format, x["descale_k"])
        meta, splits = api.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1, num_parts=num_parts)
        launch = importlib.import_module(f"{api.__name__}.kernels.hopper.launch")

        def call():
            launch.ABLATE, own = self.ablate, launch.ABLATE
            try:
                return api.flash_mla_with_kvcache(x["q"], cache, p.block_table, p.cache_seqlens, 512, meta, splits,
                                                  causal=causal, descale_q=x["descale_q"], descale_k=x["descale_k"],
                                                  backend="hopper", validate=False)
            finally:
                launch.ABLATE = own
        return call

    def sparse_call(self, p, kv_format, k_cache):
        """sparse_call through this variant's API."""
        return sparse_call(p, kv_format, api=self.api, k_cache=k_cache)


SPARSE_TOPK = 2048   # --profile --sparse: each query token's indices, of 4x as many tokens a batch entry


def sparse_call(p, kv_format, backend="hopper", api=fp8mla, k_cache=None):
    """The sparse decode of problem ``p`` (inputs.make_sparse_problem) on its cache read as ``kv_format`` (k_cache:
    that cache, quantized once for every variant; None: quantized here), as the bench calls it (no topk_length, no
    attn_sink), as a no-argument call (through ``api``: a tree's fp8mla)."""
    if k_cache is None:
        k_cache = p.quantized(kv_format)["k_cache"]
    schedule, _ = api.get_mla_metadata()
    return lambda: api.flash_mla_with_kvcache(p.q, k_cache, None, None, 512, schedule, None, is_fp8_kvcache=True,
                                              indices=p.indices, kv_format=kv_format, backend=backend)


def check(cases, parts_list, variants, paths) -> bool:
    ok = True
    for s_q, h_q, seqlens, causal in cases:
        p = make_problem(len(seqlens), s_q, h_q, seqlens, device="cuda", seed=0, extra_pages=0)
        ref_out, ref_lse = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=causal)
        empty = torch.isinf(ref_lse)
        for kv_format, q_fp8 in paths:
            for parts in parts_list:
                for name, variant in variants.items():
                    out, lse = variant.decode_call(p, kv_format, q_fp8, causal, parts)()
                    d = cal_diff(out.float(), ref_out)["cos_diff"]
                    good = (d < (2e-5 if kv_format == "bf16" else 2.5e-3) and not out.isnan().any()
                            and torch.equal(torch.isinf(lse), empty)
                            and torch.allclose(lse[~empty], ref_lse[~empty], atol=0.2))
                    ok &= good
                    print(f"check [{name}] b={len(seqlens)} s_q={s_q} h_q={h_q} {kv_format} q_fp8={q_fp8} "
                          f"parts={parts}: cos_diff {d:.2e} {'ok' if good else 'FAIL'}", flush=True)
    print("ALL OK" if ok else "FAILURES", flush=True)
    return ok


def check_and_time_sparse(variants, rounds: int, readings=SPARSE_READINGS) -> bool:
    """Each variant's sparse call on SPARSE_TIMED's configs, in each of the readings: its cos_diff against the fp32
    reference, then median µs over alternating rounds and the ratio to the working tree's (one process)."""
    ok, rows = True, []
    for b, s_q, h_q in SPARSE_TIMED:
        p = make_sparse_problem(b, s_q, h_q, SPARSE_TOPK, 4 * SPARSE_TOPK, device="cuda", skipped=0, seed=0)
        ref_out, _ = reference_sparse_mla_decode(p.q, p.kv, p.indices)
        for kv_format in readings:
            k_cache = p.quantized(kv_format)["k_cache"]
            calls = {name: v.sparse_call(p, kv_format, k_cache) for name, v in variants.items()}
            label = f"sparse b={b} s_q={s_q} h_q={h_q} {kv_format}"
            for name, call in calls.items():
                d = cal_diff(call()[0].float(), ref_out)["cos_diff"]
                good = d < 6e-3
                ok &= good
                print(f"check [{name}] {label}: cos_diff {d:.2e} {'ok' if good else 'FAIL'}", flush=True)
            rows.append(timed_row(calls, rounds, label))
    print_medians(list(variants), rows)
    print("ALL OK" if ok else "FAILURES", flush=True)
    return ok


def alternating_medians(calls: dict, rounds: int) -> tuple[dict, dict]:
    """({name: µs per round}, {name: median µs}) of no-argument calls timed in alternating rounds (CUDA-graph
    medians), so drifts of the machine hit every call alike."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median") * 1e3)
    return times, {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def timed_row(calls: dict, rounds: int, label: str) -> tuple[str, dict]:
    """(label, {name: median µs}) of calls that have run once, timed in alternating rounds; prints each round's."""
    torch.cuda.synchronize()   # do_bench_cudagraph runs on a stream of its own, which waits for nothing
    times, medians = alternating_medians(calls, rounds)
    print(f"time {label}: " + "; ".join(f"[{n}] " + " ".join(f"{t:.1f}" for t in ts) for n, ts in times.items()),
          flush=True)
    return label, medians


def variants_for(variants: dict, kv_format: str) -> dict:
    """The variants that change the kernel of a cache format: an ablation none of whose flags that kernel implements
    (ablations.FP8_FLAGS, BF16_FLAGS) would time it unchanged."""
    implemented = BF16_FLAGS if kv_format == "bf16" else FP8_FLAGS
    return {name: v for name, v in variants.items() if not v.ablate or v.ablate & implemented}


def time_variants(variants, rounds: int, timed, paths) -> None:
    """Median µs of each variant over alternating rounds, and its ratio to the working tree's (one run only); an
    ablation a path's kernel does not implement is not timed there."""
    rows = []
    for b, s_q, h_q in timed:
        p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
        for kv_format, q_fp8 in paths:
            calls = {name: v.decode_call(p, kv_format, q_fp8, True)
                     for name, v in variants_for(variants, kv_format).items()}
            for call in calls.values():
                call()
            label = f"b={b} s_q={s_q} h_q={h_q} {kv_format}{' (e4m3 q)' if q_fp8 else ''}"
            rows.append(timed_row(calls, rounds, label))
    print_medians(list(variants), rows)


def print_medians(names, rows) -> None:
    """The table of (config label, {variant: median µs}) rows, each variant's ratio to the first's."""
    print("\n| config | " + " | ".join(f"{n} µs" for n in names) + "".join(f" | {n} / working tree" for n in names[1:])
          + " |\n|---" + "|---" * (2 * len(names) - 1) + "|")
    for label, med in rows:   # (a variant not timed for a row: -)
        base = med[names[0]]
        print(f"| {label} | " + " | ".join(f"{med[n]:.1f}" if n in med else "-" for n in names)
              + "".join(f" | {med[n] / base:.3f}" if n in med else " | -" for n in names[1:]) + " |")


def config(text: str) -> tuple[int, int, int]:
    """--timed's "B,S_Q,H_Q"."""
    b, s_q, h_q = (int(x) for x in text.split(","))
    return b, s_q, h_q


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--no-time", action="store_true", help="correctness only")
    parser.add_argument("--seqlens", type=int, nargs="+", help="one case: a cache length per request")
    parser.add_argument("--b", type=int, default=TIMED[0][0], help="requests of --profile's and --ablate's config")
    parser.add_argument("--s-q", type=int, default=TIMED[0][1], help="query tokens per request, likewise")
    parser.add_argument("--h-q", type=int, default=TIMED[0][2], help="query heads, likewise")
    parser.add_argument("--parts", type=int, help="split-KV parts for the one case (default: None and 7)")
    parser.add_argument("--trees", nargs="+", default=[], help="other source trees (DIR/src/fp8mla) to check and time")
    parser.add_argument("--ablate", nargs="*", metavar="NAME", choices=list(ABLATIONS),
                        help="time the 64-row kernels with stages skipped (no check: their results are wrong): "
                             "those of kernels/hopper/ablations.py's ABLATIONS named, or all")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    parser.add_argument("--profile", nargs="?", const="fp8_rope_bf16",
                        choices=["fp8_rope_bf16", "fp8", "bf16", "fp8_ds_mla"],
                        help="only run one config (--b, --s-q, --h-q) three times, in this cache format (fp8: e4m3 q)")
    parser.add_argument("--sparse", action="store_true",
                        help="the sparse call: checked and timed (with --trees, A/B), or --profile's config")
    parser.add_argument("--readings", nargs="+", choices=SPARSE_READINGS, default=SPARSE_READINGS,
                        help="--sparse's readings of the 656-byte cache")
    parser.add_argument("--timed", nargs="+", type=config, default=TIMED, metavar="B,S_Q,H_Q",
                        help="the dense A/B's timed configs (8192 tokens a request, causal)")
    parser.add_argument("--paths", nargs="+", choices=list(PATH_NAMES), default=list(PATH_NAMES)[:3],
                        help="the timed paths of the A/B and of --ablate (fp8q: the fp8 cache with an e4m3 q)")
    parser.add_argument("--check-timed-paths", action="store_true",
                        help="check only --paths' paths (fewer kernels to compile in a short device call)")
    args = parser.parse_args()
    paths = [PATH_NAMES[name] for name in args.paths]
    here = Variant(fp8mla)
    if args.profile:
        b, s_q, h_q = args.b, args.s_q, args.h_q
        if args.sparse:
            call = sparse_call(make_sparse_problem(b, s_q, h_q, SPARSE_TOPK, 4 * SPARSE_TOPK, device="cuda",
                                                   skipped=0, seed=0), args.profile)
        elif args.profile == "fp8_ds_mla":
            parser.error("fp8_ds_mla is profiled in the sparse call (--sparse)")
        else:
            call = here.decode_call(make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0), args.profile,
                                    args.profile == "fp8", True)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        return
    if args.ablate is not None:
        variants = {"kernel": here, **{name: Variant(fp8mla, flags) for name, flags in ABLATIONS.items()
                                       if name in args.ablate or not args.ablate}}
        time_variants(variants, args.rounds, [(args.b, args.s_q, args.h_q)], paths)
        return
    variants = {"working tree": here}
    variants.update({Path(root).name: Variant(load_tree(root, f"fp8mla_tree_{i}")) for i, root in enumerate(args.trees)})
    if args.sparse:
        sys.exit(0 if check_and_time_sparse(variants, args.rounds, args.readings) else 1)
    cases = [(args.s_q, args.h_q, args.seqlens, True)] if args.seqlens else CASES
    parts_list = [args.parts] if args.seqlens and args.parts else [None, 7]
    if not check(cases, parts_list, variants, paths if args.check_timed_paths else PATHS):
        sys.exit(1)
    if not args.no_time:
        time_variants(variants, args.rounds, args.timed, paths)


if __name__ == "__main__":
    main()
