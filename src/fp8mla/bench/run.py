"""The bench: fp8mla's formats and backends and the peer kernels, on the same inputs, in one process.

Every config builds one random problem (``inputs.make_problem``: shuffled pages, NaN in unused cache slots) and
its fp32 reference on the *unquantized* bf16 inputs. Every method (an fp8mla format on a backend, or a peer) is
prepared once, with quantization and scheduler metadata outside the timed region as engines do, called once for
accuracy, then timed on a GPU three ways: captured in a CUDA graph, as engines run decode
(``triton.testing.do_bench_cudagraph``, median: the "ms" every ratio is of), launched from Python each time
(``triton.testing.do_bench``, median, an L2 flush between calls, as FlashMLA's own test times them: it shows the
host whenever a call's launch path takes longer on the CPU than the flush and the call before on the GPU), and
the host's own cost (``host µs/call``: wall time per call of 50 calls launched back to back, no sync). The last two
come from rounds that take a config's methods in turn (``LAUNCH_ROUNDS``; eager: the median of the rounds', host: the
best round's), since the speed of the H200 machine's host drifts by a third within minutes and both depend on it. A
method that fails becomes a row that says why; the bench goes on.

Our ``fp8`` rows take an e4m3 q with a per-tensor scale: exactly the inputs of FlashMLA's dense FP8 kernel.

``--sparse`` benches the sparse call (DeepSeek V3.2: each query token attends to topk cache rows) against
FlashMLA's sparse kernel: a context of ``mean_sk`` tokens a batch entry, topk of them drawn for each query token,
latent groups scaled x1, x8, x0.25, x2 (``inputs.make_sparse_problem``), so the ``fp8_ds_mla`` cache's four
descales differ; the ``fp8_rope_bf16`` rows read the cache fp8mla's own writer makes (one descale a row).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..api import flash_mla_with_kvcache, get_mla_metadata, hopper_available
from ..formats import D_LATENT, D_QK, KV_FORMATS, TOKEN_SCALED
from ..inputs import make_problem, make_seqlens, make_sparse_problem, plant_needles
from ..kernels import BACKENDS, DECODERS
from ..reference import reference_mla_decode, reference_sparse_mla_decode
from .metrics import decode_bytes, decode_flops, format_speed, needle_report, output_error, speed
from .peers import Peer, load_peers
from .report import describe, write_report

SOFTMAX_SCALE = D_QK ** -0.5
SEED_BATCHES = (32, 48, 64, 128)
LAUNCH_ROUNDS = 5   # rounds of the eager and host timings, each taking every method of a config in turn


@dataclass(frozen=True)
class Config:
    b: int
    s_q: int
    h_q: int
    mean_sk: int
    causal: bool = True
    varlen: bool = False
    rope_scale: float = 1.0
    needle: bool = False
    name: str = ""  # the accuracy case it stands for
    topk: int = 0   # > 0: the sparse call, each query token attending to topk of its entry's mean_sk tokens

    @property
    def label(self) -> str:
        if self.topk:
            return f"sparse b={self.b} s_q={self.s_q} h_q={self.h_q} topk={self.topk} of {self.mean_sk}"
        words = [f"b={self.b} s_q={self.s_q} h_q={self.h_q} sk={self.mean_sk}"]
        words += ["varlen"] if self.varlen else []
        words += ["causal" if self.causal else "non-causal"] if self.s_q > 1 else []   # (one token: nothing to mask)
        if self.name:  # the case's name already says what is special about it
            return f"{self.name}: " + " ".join(words)
        words += [f"RoPE ×{self.rope_scale:g}"] if self.rope_scale != 1 else []
        return " ".join(words + (["needle"] if self.needle else []))


def speed_suite(tiny: bool = False) -> list[Config]:
    """The seed table (s_q=2, h_q=64, 8k tokens), then the other rows the peers were measured on for
    ../shared/ANCHORS.md (a long context, one token of 128 heads, the memory-bound config); ``tiny`` for the
    interpreter."""
    if tiny:
        return [Config(b, 2, 16, 100) for b in (1, 2)] + [Config(2, 1, 16, 130)]
    return ([Config(b, 2, 64, 8192) for b in SEED_BATCHES]
            + [Config(4, 2, 64, 65536), Config(64, 1, 128, 8192), Config(128, 1, 16, 8192)])


def sparse_suite(tiny: bool = False, topk: int = 2048) -> list[Config]:
    """The rows FlashMLA's sparse kernel was measured on for ../shared/ANCHORS.md (topk 2048 of 8192 tokens)."""
    if tiny:
        return [Config(2, 1, 16, 256, causal=False, topk=100), Config(1, 2, 64, 256, causal=False, topk=70)]
    shapes = [(1, 1, 128), (8, 1, 128), (64, 1, 128), (128, 2, 128), (64, 1, 64), (64, 1, 16), (64, 2, 32)]
    return [Config(b, s_q, h_q, 4 * topk, causal=False, topk=topk) for b, s_q, h_q in shapes]


def accuracy_suite(tiny: bool = False) -> list[Config]:
    """randn, RoPE dims ×8, a long context, and a planted needle at a short and at the long context."""
    b, h_q, short, long = (2, 16, 200, 700) if tiny else (32, 64, 8192, 131072)
    long_b = 1 if tiny else 2
    return [Config(b, 2, h_q, short, name="randn"),
            Config(b, 2, h_q, short, rope_scale=8.0, name="RoPE ×8"),
            Config(long_b, 2, h_q, long, name="long"),
            Config(min(b, 8), 2, h_q, short, needle=True, name="needle"),
            Config(long_b, 2, h_q, long, needle=True, name="needle long")]


class Case:
    """One config's problem, its fp32 reference and its quantized inputs (shared by every method)."""

    def __init__(self, config: Config, device: torch.device, seed: int):
        self.config = config
        self._inputs: dict[tuple[str, bool], dict] = {}
        self.needles = []
        if config.topk:
            p = self.problem = make_sparse_problem(config.b, config.s_q, config.h_q, config.topk, config.mean_sk,
                                                   device, skipped=0, seed=seed)
            self.ref_out, self.ref_lse = reference_sparse_mla_decode(p.q, p.kv, p.indices,
                                                                     softmax_scale=SOFTMAX_SCALE)
            self.total_seqlen = config.b * config.topk   # FlashMLA's formula: topk for sum(seqlens)
            return
        seqlens = make_seqlens(config.b, config.mean_sk, config.varlen, generator=torch.Generator().manual_seed(seed))
        self.problem = make_problem(config.b, config.s_q, config.h_q, seqlens, device=device,
                                    rope_scale=config.rope_scale, seed=seed)
        self.needles = plant_needles(self.problem, softmax_scale=SOFTMAX_SCALE, seed=seed) if config.needle else []
        p = self.problem
        self.ref_out, self.ref_lse = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens,
                                                          softmax_scale=SOFTMAX_SCALE, causal=config.causal)
        self.total_seqlen = int(p.cache_seqlens.sum())

    def inputs(self, kv_format: str, q_fp8: bool = False) -> dict:
        key = (kv_format, q_fp8)
        if key not in self._inputs:
            self._inputs[key] = (self.problem.quantized(kv_format) if self.config.topk
                                 else self.problem.quantized(kv_format, q_fp8))
        return self._inputs[key]

    @property
    def rows_read(self) -> int:
        """Cache rows the call reads (sparse: every query token its own topk)."""
        return self.total_seqlen * (self.config.s_q if self.config.topk else 1)


@dataclass
class Method:
    label: str
    kind: str           # "bf16" or "fp8": fp8mla rows are compared with the peers of their kind
    cache_format: str   # for the bytes formula
    q_fp8: bool
    prepare: Callable[[Case], tuple[Callable, tuple]] | None  # -> (timed call, first (out, lse))
    peer: bool = False
    unavailable: str | None = None


def our_method(kv_format: str, backend: str) -> Method:
    q_fp8 = kv_format == "fp8"  # the e4m3 q FlashMLA's dense FP8 kernel gets

    def prepare(case: Case):
        p, (_, s_q, h_q) = case.problem, case.problem.shape
        x = case.inputs(kv_format, q_fp8)
        if case.config.topk:   # the sparse call, the schedule planned by its first call
            call = functools.partial(flash_mla_with_kvcache, x["q"], x["k_cache"], None, None, D_LATENT,
                                     get_mla_metadata()[0], None, SOFTMAX_SCALE, descale_k=x["descale_k"],
                                     kv_format=kv_format, indices=p.indices, backend=backend)
            first = call(validate=True)
            return functools.partial(call, validate=False), first
        meta, num_splits = get_mla_metadata(p.cache_seqlens, s_q * h_q, 1)
        call = functools.partial(flash_mla_with_kvcache, x["q"], x["k_cache"], p.block_table, p.cache_seqlens,
                                 D_LATENT, meta, num_splits, SOFTMAX_SCALE, case.config.causal, x["descale_q"],
                                 x["descale_k"], kv_format, backend=backend)
        first = call(validate=True)  # checks every input once; the timed call skips the host read-back
        return functools.partial(call, validate=False), first
    return Method(f"fp8mla {kv_format} ({backend})", "bf16" if kv_format == "bf16" else "fp8", kv_format, q_fp8,
                  prepare)


def peer_method(peer: Peer) -> Method:
    def prepare(case: Case):
        call = peer.prepare(case.problem, case.config.causal, SOFTMAX_SCALE, case.inputs)
        return call, call()
    return Method(peer.name, peer.kind, peer.cache_format, peer.q_fp8, prepare if peer.prepare else None, peer=True,
                  unavailable=peer.error)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a kernel's asynchronous error surfaces here, inside its row


def run_method(method: Method, case: Case, timer: Callable[[Callable], dict] | None) -> tuple[dict, Callable | None]:
    """(One row: accuracy of the first call, then (with a timer) speed; the timed call, None after an error, which
    ends the row with its message.)"""
    row = dict(config=asdict(case.config), label=case.config.label, method=method.label, kind=method.kind,
               peer=method.peer, cache_format=method.cache_format, q_fp8=method.q_fp8, error=None)
    if method.prepare is None:
        row["error"] = f"unavailable: {method.unavailable}"
        return row, None
    device = case.problem.q.device
    call = None
    try:
        call, (out, lse) = method.prepare(case)
        _sync(device)
        row.update(output_error(out, lse, case.ref_out, case.ref_lse))
        if case.needles:
            row.update(needle_report(out, case.ref_out, case.problem.kv, case.needles))
        if timer is not None:
            b, s_q, h_q = case.problem.shape
            row.update(timer(call))
            _sync(device)
            flops = decode_flops(s_q, h_q, case.total_seqlen)
            nbytes = decode_bytes(b, s_q, h_q, case.rows_read, method.cache_format, 1 if method.q_fp8 else 2)
            row.update(speed(row["ms"], flops, nbytes), flops=flops, bytes=nbytes)
    except Exception as e:
        row["error"] = describe(e)
        call = None
    return row, call


def add_speedups(rows: list[dict]) -> None:
    """Each fp8mla row's speedup over each peer of its kind in the same run: peer ms / our ms."""
    peers = [r for r in rows if r["peer"] and r.get("ms")]
    for r in rows:
        if not r["peer"] and r.get("ms"):
            r["speedup"] = {p["method"]: p["ms"] / r["ms"] for p in peers if p["kind"] == r["kind"]}


def run_suite(configs: list[Config], methods: list[Method], device: torch.device, timer, seed: int,
              progress: Callable[[str], None], suite: str) -> list[dict]:
    rows = []
    for i, config in enumerate(configs, 1):
        progress(f"[{suite} {i}/{len(configs)}] {config.label}: inputs and fp32 reference")
        try:
            case = Case(config, device, seed)
        except Exception as e:
            error = f"inputs failed: {describe(e)}"
            progress(f"    {error}")
            rows += [dict(config=asdict(config), label=config.label, method=m.label, kind=m.kind, peer=m.peer,
                          error=error) for m in methods]
            continue
        config_rows, calls = [], {}
        for method in methods:
            row, call = run_method(method, case, timer)
            progress(f"    {method.label}: {summary(row)}")
            config_rows.append(row)
            if call is not None:
                calls[len(config_rows) - 1] = call
        launched = getattr(timer, "launched", None)
        if launched is not None and calls:
            progress(f"    eager and host µs/call: {LAUNCH_ROUNDS} rounds of {len(calls)} methods")
            for i, result in launched(calls).items():
                config_rows[i].update(result)
                rounds = " ".join(f"{ms:.3f}" for ms in result.get("eager_rounds_ms", []))
                progress(f"    {config_rows[i]['method']}: eager ms by round {rounds}")
        add_speedups(config_rows)
        rows += config_rows
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def summary(row: dict) -> str:
    if row.get("error"):
        return f"failed: {row['error']}"
    text = f"cos_diff {row['cos_diff']:.2e}"
    if "ms" in row:
        text = f"{format_speed(row['ms'], row['tflops'], row['gbps'])}, {text}"
    return text


def gpu_timer(warmup: int, rep: int) -> Callable[[Callable], dict]:
    """{ms: in a CUDA graph} of a call; its ``launched`` the eager and host times of a config's calls."""
    import triton.testing

    def timer(fn):
        torch.cuda.synchronize()   # do_bench_cudagraph runs on a stream of its own, which waits for nothing
        return dict(ms=triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))

    def launched(calls: dict) -> dict:
        """{key: {eager_ms: launched from Python, host_us: host time per call}} of ``calls`` ({key: call}), timed
        in LAUNCH_ROUNDS rounds that each take every call in turn (a failure: {error})."""
        times = {key: ([], []) for key in calls}
        results = {}
        for _ in range(LAUNCH_ROUNDS):
            for key, fn in calls.items():
                if key in results:
                    continue
                try:
                    eager = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
                    times[key][0].append(eager)
                    times[key][1].append(host_time(fn))
                except Exception as e:
                    results[key] = dict(error=describe(e))
        for key, (eager, host) in times.items():
            if key not in results:
                results[key] = dict(eager_ms=statistics.median(eager), eager_rounds_ms=eager, host_us=min(host),
                                    host_rounds_us=host)
        return results
    timer.launched = launched
    return timer


def host_time(fn: Callable, calls: int = 50) -> float:
    """µs of host (CPU) time per call: ``calls`` launches back to back, without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def cpu_timer(fn: Callable) -> dict:
    """One call's wall time in ms: the interpreter's numbers only prove the pipeline runs."""
    start = time.perf_counter()
    fn()
    return dict(ms=(time.perf_counter() - start) * 1e3)


DENSE_FORMATS = ("bf16", "fp8", "fp8_rope_bf16")   # the dense bench's default (fp8_ds_mla is the sparse cache)
SPARSE_FORMATS = TOKEN_SCALED   # the sparse call's readings of a 656-byte cache


def takes(backend: str, kv_format: str, sparse: bool) -> bool:
    """Whether ``backend`` has a kernel for the format's calls (of some row count)."""
    return any(d.backend == backend and kv_format in d.formats and ("sparse" if sparse else "dense") in d.calls
               for d in DECODERS)


def build_methods(device: torch.device, formats, backends, peers_dir: str | None, fa3: bool,
                  sparse: bool = False) -> list[Method]:
    usable = [b for b in (backends or BACKENDS) if b != "hopper" or hopper_available(device)]
    formats = formats or (SPARSE_FORMATS if sparse else DENSE_FORMATS)
    methods = [our_method(f, b) for f in formats for b in usable if takes(b, f, sparse)]
    if peers_dir:
        methods += [peer_method(p) for p in load_peers(peers_dir, fa3=fa3, sparse=sparse)]
    return methods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_argument_group("one config (or a batch sweep) instead of the default suite")
    size.add_argument("--b", type=int, nargs="+", metavar="B", help="batch size(s); several make a sweep")
    size.add_argument("--s-q", type=int, help="query tokens per request (default: 2; 1 with --sparse)")
    size.add_argument("--h-q", type=int, help="query heads (default: 64; 128 with --sparse)")
    size.add_argument("--mean-sk", type=int,
                      help="mean cache length in tokens (default: 8192; with --sparse 4 * topk, a batch entry's)")
    size.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                      help="mask the keys after each query token, bottom-right aligned (default: causal; with "
                           "--s-q 1 there is nothing to mask)")
    size.add_argument("--varlen", action="store_true", help="lengths drawn around --mean-sk, as FlashMLA's test")
    parser.add_argument("--rope-scale", type=float, default=1.0, help="multiply q's and the cache's RoPE dims")
    parser.add_argument("--format", nargs="+", choices=KV_FORMATS,
                        help=f"cache formats (default: {', '.join(DENSE_FORMATS)}; with --sparse "
                             f"{', '.join(SPARSE_FORMATS)})")
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, help="fp8mla backends (default: all available)")
    parser.add_argument("--peers", metavar="DIR",
                        help="folder with the peer binaries (fetch-peers writes it; default: no peers, fp8mla alone)")
    parser.add_argument("--no-fa3", dest="fa3", action="store_false",
                        help="leave FA3-MLA out of the peers (by default --peers loads it beside FlashMLA's two, and "
                             "its row says so where DIR has no FA3 binary)")
    parser.add_argument("--sparse", action="store_true",
                        help="the sparse call (DeepSeek V3.2) against FlashMLA's sparse kernel: its suite, or the "
                             "size options' configs with --topk of --mean-sk tokens")
    parser.add_argument("--topk", type=int, default=2048, help="indices per query token with --sparse")
    parser.add_argument("--accuracy", action="store_true",
                        help="run the accuracy suite (randn, RoPE ×8, 128k tokens, needles) instead of the speed one")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup of the eager calls, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--out", default="bench-out", help="folder for the table, JSON and plots")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: interpreter, tiny sizes


def configs_from_args(args: argparse.Namespace, tiny: bool) -> list[Config]:
    single = [args.b, args.s_q, args.h_q, args.mean_sk, args.causal]
    if args.accuracy:
        if any(v is not None for v in single) or args.varlen or args.rope_scale != 1.0:
            raise ValueError("the accuracy suite has fixed configs: drop the size options or --accuracy")
        return accuracy_suite(tiny)
    if args.sparse:
        if all(v is None for v in single):
            return sparse_suite(tiny, args.topk)
        return [Config(b, args.s_q or 1, args.h_q or 128, args.mean_sk or 4 * args.topk, causal=False, topk=args.topk)
                for b in (args.b or [64])]
    if all(v is None for v in single) and not args.varlen:
        suite = speed_suite(tiny)
    else:
        suite = [Config(b, args.s_q or 2, args.h_q or 64, args.mean_sk or 8192,
                        True if args.causal is None else args.causal, args.varlen) for b in (args.b or [64])]
    return [Config(c.b, c.s_q, c.h_q, c.mean_sk, c.causal, c.varlen, args.rope_scale) for c in suite]


def run_bench(args: argparse.Namespace, command: str) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        configs = configs_from_args(args, tiny=device.type == "cpu")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    methods = build_methods(device, args.format, args.backend, args.peers, args.fa3, args.sparse)
    for m in methods:
        if m.unavailable:
            progress(f"{m.label}: {m.unavailable}")
    if args.accuracy:
        timer = None
    elif device.type == "cuda":
        timer = gpu_timer(args.warmup, args.rep)
    else:
        timer = cpu_timer
    suite = "accuracy" if args.accuracy else "sparse" if args.sparse else "speed"
    rows = run_suite(configs, methods, device, timer, args.seed, progress, suite)
    print(write_report(rows, suite, device, command, args.out, progress), end="")
    return 0
