"""Host (CPU) cost of fp8mla's calls: µs per call of a loop of calls without a synchronisation.

    PYTHONPATH=src python3 scripts/host_cost.py [--calls 500 --rounds 5]          # any machine: launches faked
    PYTHONPATH=src python3 scripts/host_cost.py --gpu [--peers .peers] [--profile] [--parts]  # a GPU: real launches
    PYTHONPATH=src python3 scripts/host_cost.py --sparse [--gpu --peers .peers]          # the sparse calls only

Faked (the default), every kernel launch is replaced by a fake compiled kernel, so what is timed is fp8mla's own
Python: the checks, the buffers, the launch arguments and the launchers' cache keys (not Triton's launcher or the
driver; scratch buffers kept as on a GPU). With ``--gpu`` the launches are real: each decode path (cache format x q
dtype x kernel), the metadata call, and with ``--peers`` FlashMLA dense FP8's call and schedule; then the sparse call (both readings of a 656-byte
cache, topk 2048; with ``--peers`` FlashMLA's sparse call); ``--profile`` adds
cProfile's top functions of one path; ``--parts`` what the fp8_rope_bf16 call of the last shape spends on each step
(the output allocations, the checks, the launches; the decode launch alone, its tensors passed as addresses and as
objects). Prints µs per call, the best of the rounds, each round timing every call of a shape in turn (with
``--peers`` also each call's ratio to FlashMLA's in the same rounds: the host's drifts cancel there).
"""
import argparse
import os
import sys
import time

PATHS = [("fp8", True), ("fp8", False), ("fp8_rope_bf16", False), ("bf16", False)]   # (cache format, e4m3 q)
SHAPES = [(2, 1, 16), (2, 1, 128), (64, 2, 64)]   # b, s_q, h_q: the small-rows kernel, then the 64-row kernels
SPARSE_SHAPES = [(1, 1, 128), (64, 1, 16), (64, 1, 128)]   # b, s_q, h_q of sparse calls (topk SPARSE_TOPK)
SPARSE_TOPK = 2048


def per_call_alternating(fns: dict, calls: int, rounds: int, sync=lambda: None) -> dict:
    """{name: best over rounds of µs per call}, each round timing every function in turn, so that the machine's
    drifts (large on the H200 machine's host) hit them alike and their ratios compare."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    sync()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
            sync()
    return best


def per_call(fn, calls: int, rounds: int, sync=lambda: None) -> float:
    """Best over rounds of µs per call of ``calls`` calls back to back."""
    return per_call_alternating({"": fn}, calls, rounds, sync)[""]


def fake_launches():
    """Every kernel launch replaced by a fake compiled kernel (on any machine, CPU tensors)."""
    import torch

    from fp8mla import kernels
    from fp8mla.kernels import combine, launcher, planner
    from fp8mla.kernels.hopper import launch

    class FakeJit:
        def __init__(self, fn):
            self.arg_names = fn.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    launcher._interpreting = lambda: False
    launcher._current_device = lambda: 0
    launcher._current_stream = lambda device: 0
    launcher._current_arch = lambda: 90
    launcher.direct_launch = lambda kernel, params: lambda grid, stream, params: None
    kernels.hopper_unavailable = lambda device: None
    kept = {}   # scratch buffers kept per shape, as on a GPU's stream (new CPU ones would time the CPU's allocator)
    launcher.scratch = lambda device, *specs: kept.get(specs) or kept.setdefault(
        specs, tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs))
    for launch_ in (launch._launch_fp8, launch._launch_small, launch._launch_bf16, combine._launch, planner._launch):
        launch_.fn = FakeJit(launch_.fn)


def decode_calls(device, b, s_q, h_q):
    """{path label: a no-argument decode call} for a problem of 512 tokens a request."""
    import fp8mla
    from fp8mla.inputs import make_problem

    p = make_problem(b, s_q, h_q, [512] * b, device=device, seed=0)
    meta, splits = fp8mla.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1)
    calls = {}
    for kv_format, q_fp8 in PATHS:
        x = p.quantized(kv_format, q_fp8)
        calls[f"{kv_format}{', e4m3 q' if q_fp8 else ''}"] = (
            lambda x=x, kv_format=kv_format: fp8mla.flash_mla_with_kvcache(
                x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta, splits, causal=True,
                descale_q=x["descale_q"], descale_k=x["descale_k"], kv_format=kv_format))
    calls["metadata"] = lambda: fp8mla.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1)
    return p, calls


def sparse_calls(device, b, s_q, h_q):
    """{path label: a no-argument sparse decode call}, as vLLM's backend makes it (schedule planned by the first)."""
    import fp8mla
    from fp8mla.bench.run import SOFTMAX_SCALE, SPARSE_FORMATS
    from fp8mla.inputs import make_sparse_problem

    p = make_sparse_problem(b, s_q, h_q, SPARSE_TOPK, context=SPARSE_TOPK, device=device, seed=0)
    calls = {}
    for kv_format in SPARSE_FORMATS:
        x = p.quantized(kv_format)
        sched, _ = fp8mla.get_mla_metadata()
        calls[kv_format] = (
            lambda x=x, kv_format=kv_format, sched=sched: fp8mla.flash_mla_with_kvcache(
                x["q"], x["k_cache"], None, None, 512, sched, None, softmax_scale=SOFTMAX_SCALE, is_fp8_kvcache=True,
                indices=p.indices, topk_length=p.topk_length, attn_sink=p.attn_sink, kv_format=kv_format))
    return p, calls


def sparse_peer_calls(peers_dir, p):
    """FlashMLA's sparse decode on the same fp8_ds_mla cache (the bench's peer)."""
    from fp8mla.bench.peers import load_peers
    from fp8mla.bench.run import SOFTMAX_SCALE

    peer = next(q for q in load_peers(peers_dir, fa3=False, sparse=True) if q.name == "FlashMLA sparse")
    if peer.prepare is None:
        print(f"FlashMLA sparse: {peer.error}", file=sys.stderr)
        return {}
    return {"FlashMLA sparse": peer.prepare(p, False, SOFTMAX_SCALE, lambda kv_format, q_fp8: p.quantized(kv_format))}


def peer_calls(peers_dir, p):
    """FlashMLA dense FP8's decode and schedule on the same problem (the bench's peer)."""
    import torch

    from fp8mla.bench.peers import load_peers
    from fp8mla.bench.run import SOFTMAX_SCALE

    peer = next(q for q in load_peers(peers_dir, fa3=False) if q.name == "FlashMLA dense FP8")
    if peer.prepare is None:
        print(f"FlashMLA dense FP8: {peer.error}", file=sys.stderr)
        return {}
    b, s_q, h_q = p.shape
    ops = torch.ops._flashmla_extension_C
    return {"FlashMLA dense FP8": peer.prepare(p, True, SOFTMAX_SCALE, p.quantized),
            "FlashMLA metadata": lambda: ops.get_mla_decoding_metadata_dense_fp8(p.cache_seqlens, s_q * h_q, 1)}


def print_parts(p, calls: int, rounds: int, sync) -> None:
    """µs per call of each step of the fp8_rope_bf16 call on problem p."""
    import torch

    import fp8mla
    from fp8mla import checks, kernels

    b, s_q, h_q = p.shape
    x = p.quantized("fp8_rope_bf16", False)
    meta, splits = fp8mla.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1)
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=p.q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=p.q.device)
    args = (x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta, splits, None, True, None, None,
            "fp8_rope_bf16")
    call = checks.check_decode(*args, out, lse)
    decoder = kernels.select(None, p.q.device, call.kv_format, call.rows)
    steps = {"torch.empty(out)": lambda: torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=p.q.device),
             "torch.empty(lse)": lambda: torch.empty(b, h_q, s_q, dtype=torch.float32, device=p.q.device),
             "check_decode (out, lse given)": lambda: checks.check_decode(*args, out, lse),
             "kernels.select": lambda: kernels.select(None, p.q.device, call.kv_format, call.rows),
             "launch_decode (decode, combine)": lambda: kernels.launch_decode(decoder, call),
             "whole call (out, lse given)": lambda: fp8mla.flash_mla_with_kvcache(
                 *args[:7], causal=True, kv_format="fp8_rope_bf16", out=out, lse=lse),
             "whole call": lambda: fp8mla.flash_mla_with_kvcache(*args[:7], causal=True, kv_format="fp8_rope_bf16")}
    if decoder.name == "hopper":   # the 64-row kernel's launch alone, its arguments ready
        from fp8mla.kernels import launcher
        from fp8mla.kernels.hopper import launch as hopper_launch

        site = launcher.launch_site()
        o_part, lse_part = launcher.scratch(p.q.device, ((b + meta.shape[0], s_q * h_q, 512), torch.bfloat16),
                                           ((b + meta.shape[0], s_q * h_q), torch.float32))
        grid = (meta.shape[0], -(-s_q * h_q // 64))
        recorded = []   # the decode's arguments, as its plan passes them
        hopper_launch.fp8_launch(lambda grid, args, key, site: recorded.append(args), grid, call)(
            call, o_part, lse_part, site)
        decode_args = recorded[0]
        cached = hopper_launch._launch_fp8
        variant = cached.variant(hopper_launch.fp8_kernel_constexprs(call), num_warps=4)
        constexprs = variant.constexprs
        steps["launcher.launch_site()"] = launcher.launch_site
        steps["decode launch: CachedLauncher (a plan's variant)"] = lambda: variant(grid, decode_args,
                                                                                   call.signature, site)
        variant(grid, decode_args, call.signature, site)
        go = next(go for key, go in cached.kernels.items() if key[1] == call.signature)
        params = decode_args + variant.values
        steps["decode launch: the driver's launcher (direct_launch)"] = lambda: go((*grid, 1), site[1], params)
        # the same with tensors passed as objects (Triton's own way: the launcher asks the driver about each)
        with launcher.compiling_for(launcher._current_arch()):
            kernel = cached.fn[grid](*decode_args, **constexprs, **launcher.COMPILE_OPTIONS, num_warps=4)
        as_objects = launcher.direct_launch(kernel, tuple(object() if isinstance(a, torch.Tensor) else a
                                                          for a in params))
        steps["decode launch: the driver's launcher, tensors as objects"] = lambda: as_objects((*grid, 1), site[1],
                                                                                                params)
    print(f"\n| b={b} s_q={s_q} h_q={h_q} fp8_rope_bf16: step | host µs/call |\n|---|---|")
    for name, step in steps.items():
        print(f"| {name} | {per_call(step, calls, rounds, sync):.1f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best is printed)")
    parser.add_argument("--gpu", action="store_true", help="real launches on the GPU")
    parser.add_argument("--peers", help="(with --gpu) folder with FlashMLA's binaries, to time its call too")
    parser.add_argument("--profile", action="store_true", help="(with --gpu) cProfile of the fp8_rope_bf16 path")
    parser.add_argument("--parts", action="store_true", help="the fp8_rope_bf16 call's steps timed one by one")
    parser.add_argument("--sparse", action="store_true", help="the sparse calls only")
    args = parser.parse_args()
    if args.gpu:
        import torch
        device, sync = torch.device("cuda"), torch.cuda.synchronize
    else:
        os.environ["TRITON_INTERPRET"] = "1"   # CPU tensors pass the API's device check (no kernel runs)
        fake_launches()
        import torch
        device, sync = torch.device("cpu"), lambda: None
    peers = args.gpu and args.peers
    shapes = [] if args.sparse else SHAPES
    if shapes:
        print_header("call", "same call", args.gpu, peers)
    for b, s_q, h_q in shapes:
        p, calls = decode_calls(device, b, s_q, h_q)
        if peers:
            calls.update(peer_calls(args.peers, p))
        print_shape((b, s_q, h_q), calls, per_call_alternating(calls, args.calls, args.rounds, sync), peers,
                    lambda name: "FlashMLA metadata" if name == "metadata" else "FlashMLA dense FP8")
        if args.parts and (b, s_q, h_q) == SHAPES[-1]:
            print_parts(p, args.calls, args.rounds, sync)
        if args.profile and (b, s_q, h_q) == SHAPES[-1]:
            import cProfile
            import pstats
            call = calls["fp8_rope_bf16"]
            profile = cProfile.Profile()
            profile.runcall(per_call, call, args.calls, 1)   # (results dropped as they come, as in the timing)
            sync()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    print()
    print_header(f"sparse call, topk {SPARSE_TOPK}", "sparse call", args.gpu, peers)
    for b, s_q, h_q in SPARSE_SHAPES:
        p, calls = sparse_calls(device, b, s_q, h_q)
        if peers:
            calls.update(sparse_peer_calls(args.peers, p))
        print_shape((b, s_q, h_q), calls, per_call_alternating(calls, args.calls, args.rounds, sync), peers,
                    lambda name: "FlashMLA sparse")


def print_header(what: str, peer_what: str, gpu: bool, peers) -> None:
    print(f"| b s_q h_q | {what} | host µs/call{'' if gpu else ' (launches faked)'} |"
          + (f" / FlashMLA's {peer_what} |\n|---|---|---|---|" if peers else "\n|---|---|---|"))


def print_shape(shape, calls, us, peers, peer_of) -> None:
    """One table row per call of a shape (with peers, its ratio to ``peer_of(name)``'s time, same rounds)."""
    for name in calls:
        ratio = ""
        if peers:
            peer = peer_of(name)
            ratio = f" {us[name] / us[peer]:.2f}x |" if "FlashMLA" not in name and peer in us else " |"
        print(f"| {' '.join(map(str, shape))} | {name} | {us[name]:.1f} |{ratio}", flush=True)


if __name__ == "__main__":
    main()
