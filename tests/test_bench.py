"""The bench and the demo on the CPU: formulas, CLI, peer wrappers (against the binaries' schemas), outputs."""
import json
import lzma
import math
import subprocess
import sys

import pytest
import torch

from fp8mla import reference_mla_decode
from fp8mla.__main__ import main
from fp8mla.bench import peers, run
from fp8mla.bench.metrics import decode_bytes, decode_flops, format_speed, needle_report, output_error, speed
from fp8mla.bench.report import markdown, write_report
from fp8mla.bench.run import Config, add_speedups, configs_from_args, our_method, peer_method, run_suite
from fp8mla.inputs import make_problem, plant_needles

HAS_GPU = torch.cuda.is_available()


# ---- formulas: the ANCHORS.md rows, by hand ----

def test_flops_match_flashmla_anchor():
    flops = decode_flops(s_q=2, h_q=64, total_seqlen=64 * 8192)
    assert flops == 2 * 2 * 524288 * 64 * 1088 == 146_028_888_064
    nbytes = decode_bytes(64, 2, 64, 64 * 8192, "fp8", 1)
    assert nbytes == 524288 * 576 + 64 * 2 * 64 * 576 + 64 * 2 * 64 * 512 * 2 == 315_097_088
    s = speed(0.220, flops, nbytes)
    assert s["tflops"] == pytest.approx(662, rel=5e-3)  # ANCHORS: FlashMLA dense FP8, 0.220 ms, 662 TF
    assert format_speed(**s) == "0.220 ms, 664 TFLOPS, 1432 GB/s"


def test_bytes_match_flashmla_anchor_and_count_656_byte_rows():
    tokens = 128 * 8192
    fp8 = decode_bytes(128, 1, 16, tokens, "fp8", 1)
    bf16 = decode_bytes(128, 1, 16, tokens, "bf16", 2)
    assert fp8 == (tokens * 576 + 128 * 16 * 576) * 1 + 128 * 16 * 512 * 2 == 607_256_576
    assert bf16 == (tokens * 576 + 128 * 16 * 576) * 2 + 128 * 16 * 512 * 2 == 1_212_416_000
    assert speed(0.221, 1, fp8)["gbps"] == pytest.approx(2750, rel=5e-3)   # ANCHORS: 2.75 TB/s
    assert speed(0.329, 1, bf16)["gbps"] == pytest.approx(3690, rel=5e-3)  # ANCHORS: 3.69 TB/s
    assert decode_bytes(128, 1, 16, tokens, "fp8_rope_bf16", 2) == tokens * 656 + 128 * 16 * (576 + 512) * 2


def test_output_error_reports_lse_and_nan():
    ref = torch.randn(2, 1, 4, 512)
    ref_lse = torch.tensor([[[1.0]] * 4, [[float("inf")]] * 4])  # request 1 sees no key
    lse = ref_lse.clone()
    lse[0, 2, 0] += 0.25
    err = output_error(ref.bfloat16(), lse, ref, ref_lse)
    assert err["lse_err"] == 0.25 and 0 < err["cos_diff"] < 1e-4
    assert output_error(ref, None, ref, ref_lse)["lse_err"] is None
    bad = ref.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert math.isnan(output_error(bad, lse, ref, ref_lse)["cos_diff"])


def test_needles_dominate_the_reference():
    p = make_problem(3, 2, 16, [200, 150, 64], seed=1)
    needles = plant_needles(p, seed=1)
    assert [n[0] for n in needles] == [0, 1, 2] and all(n[1] == 1 for n in needles)
    ref_out, _ = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)
    report = needle_report(ref_out, ref_out, p.kv, needles)
    assert report["needle_ref_hits"] == report["needle_hits"] == report["needle_rows"] == 3
    assert needle_report(torch.randn_like(ref_out), ref_out, p.kv, needles)["needle_hits"] == 0


# ---- CLI ----

def parse(*argv):
    import argparse

    from fp8mla.bench import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_single_config_like_flashmla_test():
    args = parse("--b", "64", "--s-q", "2", "--mean-sk", "8196", "--h-q", "64", "--no-causal", "--varlen",
                 "--format", "fp8", "--rope-scale", "8")
    assert configs_from_args(args, tiny=False) == [Config(64, 2, 64, 8196, causal=False, varlen=True, rope_scale=8.0)]
    assert args.format == ["fp8"]
    sweep = configs_from_args(parse("--b", "32", "48", "--mean-sk", "4096"), tiny=False)
    assert [(c.b, c.s_q, c.h_q, c.mean_sk, c.causal) for c in sweep] == [(32, 2, 64, 4096, True), (48, 2, 64, 4096, True)]


def test_cli_default_suites():
    default = configs_from_args(parse(), tiny=False)
    assert [(c.b, c.s_q, c.h_q, c.mean_sk) for c in default] == [
        (32, 2, 64, 8192), (48, 2, 64, 8192), (64, 2, 64, 8192), (128, 2, 64, 8192),
        (4, 2, 64, 65536), (64, 1, 128, 8192), (128, 1, 16, 8192)]
    accuracy = configs_from_args(parse("--accuracy"), tiny=False)
    assert {c.name for c in accuracy} == {"randn", "RoPE ×8", "long", "needle", "needle long"}
    assert max(c.mean_sk for c in accuracy) == 131072 and any(c.rope_scale == 8 for c in accuracy)
    with pytest.raises(ValueError, match="fixed configs"):
        configs_from_args(parse("--accuracy", "--b", "4"), tiny=False)


def test_help_states_each_default_once_and_what_no_fa3_does():
    from fp8mla.__main__ import parser

    commands = parser()._subparsers._group_actions[0].choices
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            text = formatter._expand_help(action) if action.help else ""
            assert "(default: None)" not in text and text.count("default") <= 1, (name, text)
    bench = " ".join(commands["bench"].format_help().split())
    assert "--no-fa3 leave FA3-MLA out of the peers (by default --peers loads it" in bench
    assert "--seed SEED seed of the random inputs (default: 0)" in bench
    assert "--s-q S_Q query tokens per request (default: 2; 1 with --sparse) --h-q" in bench


@pytest.mark.skipif(HAS_GPU, reason="checks the message shown without a GPU")
def test_bench_without_gpu_points_to_demo(capsys):
    assert main(["bench"]) != 0
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "python -m fp8mla demo" in err


def test_demo_runs_every_format_in_a_fresh_process(env_without_interpreter):
    res = subprocess.run([sys.executable, "-m", "fp8mla", "demo"], capture_output=True, text=True,
                         env=env_without_interpreter, timeout=120)   # __main__ must switch the interpreter on itself
    assert res.returncode == 0, res.stderr
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines() if line.startswith("| R") or
            line.startswith("| r")]
    cells = {(r[0].strip(), r[1].strip(), r[2].strip()): float(r[3]) for r in rows}
    assert {f for _, f, _ in cells} == {"bf16", "fp8", "fp8_rope_bf16"} and len(cells) == 8
    assert cells[("randn", "bf16", "bf16")] < 1e-5
    # one per-tensor scale for RoPE ×8 inputs is what fp8_rope_bf16 avoids
    assert cells[("RoPE ×8", "fp8_rope_bf16", "bf16")] * 5 < cells[("RoPE ×8", "fp8", "e4m3 per tensor")]
    sparse = {r[1].strip(): float(r[3]) for r in (line.split("|")[1:-1] for line in res.stdout.splitlines()
                                                  if line.startswith("| sparse"))}
    assert sparse.keys() == {"fp8_ds_mla", "fp8_rope_bf16"}, res.stdout   # both readings of a 656-byte cache
    assert all(0 < d < 5e-3 for d in sparse.values()), res.stdout


# ---- peers: the wrappers called through the schemas read from the binaries ----

SCHEMAS = {
    "_flashmla_C": [
        "dense_decode_fwd(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, "
        "float softmax_scale, bool is_causal, Tensor(a)? tile_scheduler_metadata, Tensor(b)? num_splits, "
        "Tensor(c!)? out_) -> (Tensor(c!), Tensor, Tensor(a)?, Tensor(b)?)"],
    "_flashmla_extension_C": [
        "fwd_kvcache_mla_fp8(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, "
        "float softmax_scale, bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits, "
        "Tensor? descale_q, Tensor? descale_k) -> Tensor[]",
        "get_mla_decoding_metadata_dense_fp8(Tensor seqlens_k, int num_heads_per_head_k, int num_heads_k) -> Tensor[]"],
    "_vllm_fa3_C": [
        "fwd(Tensor! q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor!? out, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k, "
        "int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k, "
        "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale, "
        "Tensor? v_descale, float softmax_scale, bool is_causal, int window_size_left, int window_size_right, "
        "float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits, bool? pack_gqa, "
        "int sm_margin, Tensor? s_aux, int cp_world_size, int cp_rank, Tensor? cp_tot_seqused_k) -> Tensor[]",
        "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads, int num_heads_k, "
        "int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? leftpad_k, int? page_size, "
        "int max_seqlen_k_new, bool is_causal, int window_size_left, int window_size_right, bool has_softcap, "
        "int num_splits, bool? pack_gqa, int sm_margin) -> Tensor"],
}


def _dense_decode_fwd(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, meta, splits, out_):
    assert q.dtype == kcache.dtype == torch.bfloat16 and head_size_v == 512 and out_ is None
    out, lse = reference_mla_decode(q, kcache, block_table, seqlens_k, head_size_v, softmax_scale, is_causal)
    if meta is None:  # FlashMLA plans the schedule on the first call and hands it back
        meta, splits = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(len(seqlens_k) + 1, dtype=torch.int32)
    else:
        meta, splits = meta.clone(), splits.clone()
        FAKE_CALLS.append("bf16 reused the schedule")
    return out.bfloat16(), lse, meta, splits


def _fwd_kvcache_mla_fp8(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, meta, splits,
                         descale_q, descale_k):
    assert q.dtype == kcache.dtype == torch.float8_e4m3fn and meta.shape == (4, 8)
    out, lse = reference_mla_decode(q, kcache, block_table, seqlens_k, head_size_v, softmax_scale, is_causal,
                                    descale_q=descale_q, descale_k=descale_k, kv_format="fp8")
    return [out.bfloat16(), lse]


def _dense_fp8_metadata(seqlens_k, num_heads_per_head_k, num_heads_k):
    assert num_heads_per_head_k == 2 * 16 and num_heads_k == 1  # s_q * h_q of the test problem
    return [torch.zeros(4, 8, dtype=torch.int32), torch.zeros(len(seqlens_k) + 1, dtype=torch.int32)]


def _fa3_fwd(q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
             max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
             q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
             is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin, s_aux, cp_world_size,
             cp_rank, cp_tot_seqused_k):
    """FA3's MLA mode: scores q.k + q_v.v, output P.v, q varlen over a paged cache."""
    b, s_q = len(seqused_k), max_seqlen_q
    assert scheduler_metadata is not None and softcap == 0 and window_size_left == -1 and k.shape[-1] == 64
    assert torch.equal(cu_seqlens_q, torch.arange(b + 1, dtype=torch.int32) * s_q)
    h = q.shape[1]
    full_q = torch.cat([q_v, q], dim=-1).view(b, s_q, h, 576)
    o, lse = reference_mla_decode(full_q, torch.cat([v, k], dim=-1), page_table, seqused_k, 512, softmax_scale,
                                  is_causal)
    return [o.bfloat16().reshape(b * s_q, h, 512), lse.permute(1, 0, 2).reshape(h, b * s_q), torch.empty(0),
            torch.empty(0)]


def _fa3_schedule(**kwargs):
    assert kwargs["headdim"] == 64 and kwargs["headdim_v"] == 512 and kwargs["qkv_dtype"] == torch.bfloat16
    return torch.zeros(5, dtype=torch.int32)


FAKE_CALLS = []  # what the fakes saw, for the test to check
# the dispatcher hands Python kernels their arguments by position: name them back from the schema
FA3_SCHEDULE_ARGS = [a.split()[-1] for a in SCHEMAS["_vllm_fa3_C"][1].split("(", 1)[1].split(")")[0].split(",")]
IMPLS = {"dense_decode_fwd": _dense_decode_fwd, "fwd_kvcache_mla_fp8": _fwd_kvcache_mla_fp8,
         "get_mla_decoding_metadata_dense_fp8": _dense_fp8_metadata, "fwd": _fa3_fwd,
         "get_scheduler_metadata": lambda *args: _fa3_schedule(**dict(zip(FA3_SCHEDULE_ARGS, args)))}


@pytest.fixture(scope="module")
def fake_peer_ops():
    """torch.ops namespaces with the binaries' exact schemas and CPU reference implementations."""
    libs, namespaces = [], {}
    for module, schemas in SCHEMAS.items():
        ns = f"_fp8mla_test{module}"
        lib = torch.library.Library(ns, "DEF")
        for schema in schemas:
            lib.define(schema)
            name = schema.split("(", 1)[0]
            lib.impl(name, IMPLS[name], "CPU")
        libs.append(lib)
        namespaces[module] = getattr(torch.ops, ns)
    yield namespaces


def test_peers_through_the_bench_with_the_binaries_schemas(fake_peer_ops, monkeypatch):
    monkeypatch.setattr(peers, "_load_ops", lambda module, directory, cache_dir: fake_peer_ops[module])
    loaded = peers.load_peers("unused")
    assert [p.name for p in loaded] == ["FlashMLA BF16", "FlashMLA dense FP8", "FA3-MLA BF16"]
    assert all(p.error is None for p in loaded)
    methods = [our_method("bf16", "portable"), our_method("fp8", "portable")] + [peer_method(p) for p in loaded]
    FAKE_CALLS.clear()
    def one_ms(call):
        call()
        return dict(ms=1.0)
    rows = run_suite([Config(2, 2, 16, 100, varlen=True)], methods, torch.device("cpu"), one_ms, seed=0,
                     progress=lambda message: None, suite="speed")
    by_method = {r["method"]: r for r in rows}
    assert all(r["error"] is None for r in rows), rows
    for name in ("FlashMLA BF16", "FA3-MLA BF16"):
        assert by_method[name]["cos_diff"] < 1e-5 and by_method[name]["lse_err"] < 1e-3
    assert by_method["FlashMLA dense FP8"]["cos_diff"] < 3e-3
    assert FAKE_CALLS == ["bf16 reused the schedule"] * 2  # the first call and the timed call
    assert by_method["fp8mla bf16 (portable)"]["speedup"] == {"FlashMLA BF16": 1.0, "FA3-MLA BF16": 1.0}
    assert by_method["fp8mla fp8 (portable)"]["speedup"] == {"FlashMLA dense FP8": 1.0}


def test_eager_and_host_times_come_from_alternating_rounds(monkeypatch):
    """gpu_timer's launched: every round takes the calls in turn; eager is the median of the rounds', host the
    best round's; a call that fails becomes its row's error and the others go on."""
    import triton.testing

    order, eager = [], {"a": iter([5.0, 1.0, 3.0, 9.0, 2.0]), "b": iter([4.0] * 5)}

    def do_bench(fn, warmup, rep, return_mode):
        fn()
        return next(eager[order[-1]])
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    clock = iter(range(10**6))
    monkeypatch.setattr(run.time, "perf_counter", lambda: next(clock))   # host_time's 50 calls: one tick

    def fails():
        raise RuntimeError("bad launch")
    calls = {0: lambda: order.append("a"), 1: lambda: order.append("b"), 2: fails}
    results = run.gpu_timer(warmup=25, rep=100).launched(calls)
    assert order == ["a"] * 52 + ["b"] * 52 + (["a"] * 52 + ["b"] * 52) * 4   # do_bench's call, host_time's 51
    assert results[0]["eager_ms"] == 3.0 and results[1]["eager_ms"] == 4.0
    assert results[0]["eager_rounds_ms"] == [5.0, 1.0, 3.0, 9.0, 2.0] and len(results[0]["host_rounds_us"]) == 5
    assert results[0]["host_us"] == results[1]["host_us"] == pytest.approx(1e6 / 50)   # one tick over 50 calls
    assert results[2] == {"error": "RuntimeError: bad launch"}


def test_peer_load_failures_are_messages(tmp_path):
    (tmp_path / "_flashmla_C.abi3.so").write_bytes(b"not an ELF file")
    with lzma.open(tmp_path / "_vllm_fa3_C.abi3.so.xz", "wb") as f:
        f.write(b"compressed junk")
    cache = tmp_path / "cache"
    loaded = {p.name: p for p in peers.load_peers(str(tmp_path), cache_dir=str(cache))}
    assert "cannot load _flashmla_C" in loaded["FlashMLA BF16"].error
    assert "no _flashmla_extension_C.abi3.so or" in loaded["FlashMLA dense FP8"].error
    assert "cannot load _vllm_fa3_C" in loaded["FA3-MLA BF16"].error
    [unpacked] = cache.glob("*/_vllm_fa3_C.abi3.so")
    assert unpacked.read_bytes() == b"compressed junk"
    row = run_suite([Config(1, 1, 16, 64)], [peer_method(loaded["FlashMLA BF16"])], torch.device("cpu"), None, 0,
                    lambda m: None, "accuracy")[0]
    assert row["error"].startswith("unavailable: cannot load _flashmla_C")


def test_speedups_and_failures_in_the_table():
    config = Config(64, 2, 64, 8192)
    base = dict(config=vars(config), label=config.label, error=None, cos_diff=1e-3, rmse=1e-3, amax=1e-2, lse_err=0.0)
    rows = [dict(base, method="fp8mla fp8 (hopper)", kind="fp8", peer=False, ms=0.110, tflops=1327, gbps=5520,
                 eager_ms=0.1123, host_us=123.4),
            dict(base, method="FlashMLA dense FP8", kind="fp8", peer=True, ms=0.220, tflops=664, gbps=2760),
            dict(base, method="FlashMLA BF16", kind="bf16", peer=True, ms=0.269, tflops=543, gbps=4000),
            dict(config=vars(config), label=config.label, method="FA3-MLA BF16", kind="bf16", peer=True,
                 error="RuntimeError: a | b")]
    add_speedups(rows)
    assert rows[0]["speedup"] == {"FlashMLA dense FP8": 2.0}
    table = markdown(rows, "speed", dict(device="H200", torch="t", triton="3.6.0", date="d", command="c"))
    assert "| b=64 s_q=2 h_q=64 sk=8192 causal | fp8mla fp8 (hopper) | 0.110 ms, 1327 TFLOPS, 5520 GB/s | " \
           "0.112 ms | 123 | 2.00× FlashMLA dense FP8 | 1.00e-03 |" in table
    assert "|  | FA3-MLA BF16 | **failed**: RuntimeError: a \\| b |" in table


def test_sparse_report_plots_the_speedups(tmp_path):
    """A timed suite's report: the table, the JSON, the TFLOPS plot and a bar per fp8mla method and config of its
    speedup over the peer (here the sparse suite's one, FlashMLA's sparse kernel); no speedup plot where no peer
    was timed, no plot at all for the accuracy suite."""
    rows = []
    for b in (1, 8, 64):
        config = Config(b, 1, 128, 8192, causal=False, topk=2048)
        base = dict(config=vars(config), label=config.label, error=None, cos_diff=2e-3, rmse=1e-3, amax=1e-2,
                    lse_err=0.0)
        config_rows = [dict(base, method=f"fp8mla {f} (hopper)", kind="fp8", peer=False, ms=0.05 * b ** 0.5,
                            tflops=b, gbps=b) for f in ("fp8_ds_mla", "fp8_rope_bf16")]
        config_rows.append(dict(base, method="FlashMLA sparse", kind="fp8", peer=True, ms=0.06 * b ** 0.5, tflops=b,
                                gbps=b))
        add_speedups(config_rows)   # (per config, as run_suite does)
        rows += config_rows
    assert rows[0]["speedup"] == {"FlashMLA sparse": pytest.approx(1.2)}
    messages = []
    write_report(rows, "sparse", torch.device("cpu"), "c", str(tmp_path), messages.append)
    report = json.loads((tmp_path / "sparse.json").read_text())
    for name in ("tflops_vs_batch.png", "speedup_vs_peers.png"):
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000, name
    assert report["plot"].endswith("tflops_vs_batch.png") and report["speedup_plot"].endswith("speedup_vs_peers.png")
    alone = [dict(r, speedup={}) for r in rows if not r["peer"]]
    write_report(alone, "sparse", torch.device("cpu"), "c", str(tmp_path / "alone"), messages.append)
    assert json.loads((tmp_path / "alone" / "sparse.json").read_text())["speedup_plot"] is None
    assert not (tmp_path / "alone" / "speedup_vs_peers.png").exists()
    assert any(m.startswith("speedup plot: skipped") for m in messages)
    accuracy = [dict(r, config=dict(r["config"], name="randn")) for r in alone]
    for r in accuracy:
        del r["ms"], r["speedup"]
    write_report(accuracy, "accuracy", torch.device("cpu"), "c", str(tmp_path / "acc"), messages.append)
    assert sorted(p.name for p in (tmp_path / "acc").iterdir()) == ["accuracy.json", "accuracy.md"]


# ---- the whole bench pipeline in the interpreter ----

def test_bench_allow_cpu_writes_table_json_and_png(tmp_path, capsys):
    junk = tmp_path / "peers"
    junk.mkdir()
    out = tmp_path / "out"
    assert main(["bench", "--allow-cpu", "--b", "1", "2", "--s-q", "1", "--h-q", "16", "--mean-sk", "70",
                 "--format", "fp8", "bf16", "--peers", str(junk), "--no-fa3", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "[speed 2/2] b=2 s_q=1 h_q=16 sk=70: " in captured.err  # progress on stderr
    assert "| b=1 s_q=1 h_q=16 sk=70 | fp8mla fp8 (portable) |" in captured.out   # (s_q=1: no mask to name)
    assert captured.out.count("**failed**: unavailable: cannot load _flashmla_C: FileNotFoundError: no _flashmla_C.abi3.so") == 2
    report = json.loads((out / "speed.json").read_text())
    assert report["environment"]["command"].startswith("python -m fp8mla bench --allow-cpu")
    rows = report["rows"]
    assert len(rows) == 2 * (2 + 2)
    ours = [r for r in rows if not r["peer"]]
    assert all(r["error"] is None and r["ms"] > 0 and r["tflops"] > 0 and r["cos_diff"] < 5e-3 for r in ours)
    assert {r["cache_format"] for r in ours} == {"fp8", "bf16"} and all(r["q_fp8"] == (r["kind"] == "fp8") for r in ours)
    assert (out / "speed.md").read_text() == captured.out
    png = (out / "tflops_vs_batch.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000 and report["plot"].endswith(".png")


def test_accuracy_suite_allow_cpu(tmp_path, capsys):
    assert main(["bench", "--allow-cpu", "--accuracy", "--format", "fp8_rope_bf16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())["rows"]
    assert [r["config"]["name"] for r in rows] == ["randn", "RoPE ×8", "long", "needle", "needle long"]
    assert all(r["error"] is None and "ms" not in r for r in rows)
    assert all(r["cos_diff"] < 3e-3 for r in rows)  # RoPE ×8 included: the RoPE part stays bf16
    needles = [r for r in rows if r["config"]["needle"]]
    assert all(r["needle_rows"] > 0 and r["needle_hits"] == r["needle_ref_hits"] == r["needle_rows"] for r in needles)
    assert "needle rows = its V" in capsys.readouterr().out


def test_fetch_peers_takes_the_binaries_out_of_the_wheel(tmp_path, monkeypatch):
    """fetch-peers: the two FlashMLA extensions (and FA3, xz-compressed, with --fa3) out of the vllm wheel pip
    downloads (here a fake wheel: the download itself needs the package index)."""
    import lzma
    import zipfile

    from fp8mla.bench import fetch

    def fake_download(version, python, folder, progress):
        wheel = tmp_path / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            for member in fetch.MEMBERS:
                z.writestr(member, member.encode())
            z.writestr(fetch.FA3_MEMBER[0], b"fa3 " * 1000)
            z.writestr("vllm/other.py", b"")
        return str(wheel)

    monkeypatch.setattr(fetch, "download_wheel", fake_download)
    lines = []
    written = fetch.fetch_peers(str(tmp_path / "peers"), fa3=True, progress=lines.append)
    assert written == ["_flashmla_C.abi3.so", "_flashmla_extension_C.abi3.so", "_vllm_fa3_C.abi3.so.xz"]
    assert (tmp_path / "peers" / "_flashmla_C.abi3.so").read_bytes() == b"vllm/_flashmla_C.abi3.so"
    assert lzma.decompress((tmp_path / "peers" / "_vllm_fa3_C.abi3.so.xz").read_bytes()) == b"fa3 " * 1000
    assert sorted(p.name for p in (tmp_path / "peers").iterdir()) == sorted(written) and lines
