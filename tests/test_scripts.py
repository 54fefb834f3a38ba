"""scripts/: the maintained tools (README "Tools") work where they can be checked without a GPU; the GPU ones are
run by the GPU tests (test_sanitizers.py runs hopper_check.py) and by scripts/gpu_suite.sh."""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))


def run_hopper_check(monkeypatch, argv, **stubs):
    """hopper_check.py's main() on argv, its GPU steps (name: function) replaced by stubs."""
    hopper_check = pytest.importorskip("hopper_check")
    for name, stub in stubs.items():
        monkeypatch.setattr(hopper_check, name, stub)
    monkeypatch.setattr(sys, "argv", ["hopper_check.py", *argv])
    hopper_check.main()


def test_scripts_are_the_documented_few():
    """At most six tools, each named in the README."""
    tools = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file())
    readme = (ROOT / "README.md").read_text()
    assert len(tools) <= 6, tools
    assert all(f"scripts/{t}" in readme for t in tools), [t for t in tools if f"scripts/{t}" not in readme]


def test_hopper_check_loads_a_tree_whole(tmp_path):
    """hopper_check --trees: a source tree is called through its own API, so its kernels come with the tree's own
    helpers (a change to ring.py is part of what is timed), not with the working tree's."""
    import shutil

    hopper_check = pytest.importorskip("hopper_check")
    src = ROOT / "src" / "fp8mla"
    shutil.copytree(src, tmp_path / "next" / "src" / "fp8mla", ignore=shutil.ignore_patterns("__pycache__"))
    ring = tmp_path / "next" / "src" / "fp8mla" / "kernels" / "hopper" / "ring.py"
    ring.write_text(ring.read_text() + "\nTREE_MARK = 1\n")
    tree = hopper_check.load_tree(tmp_path / "next", "fp8mla_tree_test")
    assert Path(tree.__file__).is_relative_to(tmp_path)
    import importlib

    tree_ring = importlib.import_module("fp8mla_tree_test.kernels.hopper.ring")
    assert tree_ring.TREE_MARK == 1 and Path(tree_ring.__file__).is_relative_to(tmp_path)
    assert not hasattr(importlib.import_module("fp8mla.kernels.hopper.ring"), "TREE_MARK")
    assert tree.flash_mla_with_kvcache is not hopper_check.fp8mla.flash_mla_with_kvcache


@pytest.mark.parametrize("argv,readings", [([], ("fp8_ds_mla", "fp8_rope_bf16")),
                                           (["--readings", "fp8_ds_mla"], ("fp8_ds_mla",)),
                                           (["--readings", "fp8_rope_bf16"], ("fp8_rope_bf16",))])
def test_hopper_check_sparse_ab_times_the_readings_asked_for(argv, readings, monkeypatch):
    """hopper_check --sparse's A/B checks and times both readings of a 656-byte cache, or --readings' (the A/B
    itself stubbed: it needs a GPU)."""
    asked = []
    with pytest.raises(SystemExit) as done:
        run_hopper_check(monkeypatch, ["--sparse", *argv], check_and_time_sparse=lambda variants, rounds, readings:
                         asked.append((list(variants), tuple(readings))) or True)
    assert done.value.code == 0 and asked == [(["working tree"], readings)]


@pytest.mark.parametrize("argv,timed,paths", [
    ([], [(64, 2, 64), (128, 1, 16)], [("fp8_rope_bf16", False), ("fp8", True), ("bf16", False)]),
    (["--timed", "64,2,64", "--paths", "fp8q", "fp8_rope_bf16"], [(64, 2, 64)], [("fp8", True), ("fp8_rope_bf16", False)]),
    (["--timed", "8,1,128", "32,2,64", "--paths", "fp8"], [(8, 1, 128), (32, 2, 64)], [("fp8", False)])])
def test_hopper_check_dense_ab_times_the_configs_and_paths_asked_for(argv, timed, paths, monkeypatch):
    """hopper_check's dense A/B times its default configs and paths, or --timed's and --paths' (the checks and the
    timing stubbed: they need a GPU)."""
    asked = []
    run_hopper_check(monkeypatch, ["--rounds", "1", *argv], check=lambda *args: True,
                     time_variants=lambda variants, rounds, timed, paths: asked.append((list(variants), timed, paths)))
    assert asked == [(["working tree"], timed, paths)]


@pytest.mark.parametrize("argv,checked", [
    (["--paths", "bf16"], [("fp8_rope_bf16", False), ("fp8", True), ("bf16", False), ("fp8", False)]),
    (["--paths", "bf16", "fp8q", "--check-timed-paths"], [("bf16", False), ("fp8", True)]),
    (["--seqlens", "1000", "70", "--check-timed-paths"], [("fp8_rope_bf16", False), ("fp8", True), ("bf16", False)])])
def test_hopper_check_checks_every_path_or_the_timed_ones(argv, checked, monkeypatch):
    """hopper_check's dense A/B checks every path, or with --check-timed-paths only those it times (the checks
    and the timing stubbed: they need a GPU)."""
    asked = []
    run_hopper_check(monkeypatch, ["--rounds", "1", *argv], time_variants=lambda *args: None,
                     check=lambda cases, parts, variants, paths: asked.append(paths) or True)
    assert asked == [checked]


@pytest.mark.parametrize("argv", [[], ["no P store", "no refills"]])
def test_hopper_check_ablates_every_stage_or_those_named(argv, monkeypatch):
    """hopper_check --ablate times the kernel beside each of ablations.ABLATIONS, or beside those it names; an
    unknown name is refused (the timing stubbed: it needs a GPU)."""
    pytest.importorskip("triton.experimental.gluon")
    from fp8mla.kernels.hopper.ablations import ABLATIONS

    asked = []
    run_hopper_check(monkeypatch, ["--ablate", *argv, "--rounds", "1"],
                     time_variants=lambda variants, *args: asked.append(list(variants)))
    assert asked == [["kernel", *(name for name in ABLATIONS if name in argv or not argv)]]
    assert len(asked[0]) == 1 + (len(argv) or len(ABLATIONS))
    with pytest.raises(SystemExit):
        run_hopper_check(monkeypatch, ["--ablate", "no such stage"], time_variants=lambda *args: None)


def test_hopper_check_times_an_ablation_only_on_the_kernels_it_changes():
    """hopper_check --ablate times a flag only on the paths whose kernel implements it ("no transposes" and "no P
    store" are fp8.py's, "half loads" bf16.py's; the skeleton's other flags are both's), and its table marks the
    rest."""
    hopper_check = pytest.importorskip("hopper_check")
    from fp8mla.kernels.hopper.ablations import ABLATIONS

    variants = {"kernel": hopper_check.Variant(None), **{n: hopper_check.Variant(None, f) for n, f in ABLATIONS.items()}}
    fp8_only, bf16_only = {"no transposes", "no P store"}, {"half loads"}
    assert set(hopper_check.variants_for(variants, "bf16")) == set(variants) - fp8_only
    for kv_format in ("fp8", "fp8_rope_bf16"):
        assert set(hopper_check.variants_for(variants, kv_format)) == set(variants) - bf16_only


def test_hopper_check_table_marks_variants_not_timed(capsys):
    hopper_check = pytest.importorskip("hopper_check")
    hopper_check.print_medians(["kernel", "a", "b"], [("x", {"kernel": 10.0, "a": 5.0}), ("y", {"kernel": 4.0, "b": 2.0})])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == ["| x | 10.0 | 5.0 | - | 0.500 | - |", "| y | 4.0 | - | 2.0 | - | 0.500 |"]


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8_rope_bf16"])
def test_hopper_check_profiles_the_sparse_call_as_the_bench_makes_it(kv_format):
    """hopper_check --profile --sparse's call (here on the portable kernel, on the CPU in the interpreter, or any
    GPU) decodes its problem as the fp32 reference does."""
    from fp8mla import cal_diff, reference_sparse_mla_decode
    from fp8mla.inputs import make_sparse_problem

    hopper_check = pytest.importorskip("hopper_check")
    p = make_sparse_problem(2, 2, 16, 64, 256, device="cuda" if torch.cuda.is_available() else "cpu", skipped=0)
    out, lse = hopper_check.sparse_call(p, kv_format, backend="portable")()
    ref_out, ref_lse = reference_sparse_mla_decode(p.q, p.kv, p.indices)
    assert cal_diff(out.float(), ref_out)["cos_diff"] < 4e-3
    assert torch.allclose(lse, ref_lse, atol=0.75, rtol=0)   # the x8 latent group's scores run large (test_sparse)


def test_ncu_stalls_summarises_a_source_report(tmp_path, capsys):
    """ncu_stalls.py on a small source-page CSV: the stall reasons overall, the page loop (a conditional backward
    branch around a wgmma) with its share of the samples, and the top instructions."""
    ncu_stalls = pytest.importorskip("ncu_stalls")
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_barrier"]
    rows = [("0x100", "MOV R1, R2 ;", 10, 10, 0), ("0x110", "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4] ;", 30, 20, 10),
            ("0x120", "@P0 BRA 0x110", 40, 0, 40), ("0x130", "EXIT ;", 20, 20, 0)]
    csv = tmp_path / "source.csv"
    csv.write_text("\n".join([",".join(f'"{h}"' for h in head)]
                             + [",".join(f'"{c}"' for c in row) for row in rows]) + "\n")
    sys.argv = ["ncu_stalls.py", str(csv), "--top", "2"]
    ncu_stalls.main()
    out = capsys.readouterr().out
    assert out.startswith("100 warp samples; stall reasons: wait=50% barrier=50%")
    assert "page loop [0x10, 0x20] (QGMMA.64x64x32): 2 instructions, 70.0% of samples" in out
    assert "0x20 40.00% @P0 BRA 0x110" in out


def test_host_cost_runs_with_launches_faked(env_without_interpreter):
    out = subprocess.run([sys.executable, str(SCRIPTS / "host_cost.py"), "--calls", "20", "--rounds", "1", "--parts"],
                         env=env_without_interpreter, check=True, capture_output=True, text=True, timeout=300).stdout
    paths, parts, sparse = out.split("\n\n")
    rows = [line.split("|") for line in paths.splitlines()[2:]]
    assert len(rows) == 3 * 5, out   # three shapes: four decode paths and the metadata call
    assert all(float(row[3]) > 0 for row in rows), out
    rows = [line.split("|") for line in sparse.splitlines()[2:]]
    assert [row[2].strip() for row in rows] == ["fp8_ds_mla", "fp8_rope_bf16"] * 3, out   # three sparse shapes
    assert all(float(row[3]) > 0 for row in rows), out
    steps = {row[1].strip(): float(row[2]) for row in (line.split("|") for line in parts.splitlines()[2:])}
    assert len(steps) == 11 and all(us > 0 for us in steps.values()), out   # the steps, the decode launch two ways


@pytest.mark.parametrize("script", ["gpu_suite.sh", "triton_bundle_env.sh"])
def test_shell_tools_parse_and_name_what_exists(script):
    text = (SCRIPTS / script).read_text()
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)
    for word in " ".join(shlex.split(text, comments=True)).split():
        if word.startswith(("tests/", "scripts/")) and word.endswith((".py", ".sh")):
            assert (ROOT / word).exists(), word


def test_hopper_check_sparse_ab_checks_and_times_every_tree(tmp_path, monkeypatch, capsys):
    """hopper_check --sparse --trees (the A/B the device scripts run), end to end on the portable kernel: every
    tree's sparse call in both readings checked against fp32 and timed (the timer stubbed), one table row a config
    and reading, each tree's column and ratio."""
    import functools
    import shutil

    hopper_check = pytest.importorskip("hopper_check")
    shutil.copytree(ROOT / "src" / "fp8mla", tmp_path / "other" / "src" / "fp8mla",
                    ignore=shutil.ignore_patterns("__pycache__"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(hopper_check, "SPARSE_TIMED", [(2, 1, 16), (1, 2, 64)])
    monkeypatch.setattr(hopper_check, "SPARSE_TOPK", 64)
    problem = hopper_check.make_sparse_problem
    monkeypatch.setattr(hopper_check, "make_sparse_problem", lambda *args, **kw: problem(*args, **{**kw, "device": device}))
    monkeypatch.setattr(hopper_check, "sparse_call", functools.partial(hopper_check.sparse_call, backend="portable"))
    monkeypatch.setattr(hopper_check.torch.cuda, "synchronize", lambda: None)
    calls = []

    def timer(fns, rounds):   # each call once a round; fake µs
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                calls.append(name)
                fn()
                times[name].append(10.0 if name == "working tree" else 12.5)
        return times, {name: ts[0] for name, ts in times.items()}
    monkeypatch.setattr(hopper_check, "alternating_medians", timer)
    variants = {"working tree": hopper_check.Variant(hopper_check.fp8mla),
                "other": hopper_check.Variant(hopper_check.load_tree(tmp_path / "other", "fp8mla_tree_sparse_ab"))}
    assert hopper_check.check_and_time_sparse(variants, rounds=2)
    out = capsys.readouterr().out
    assert out.count("check [") == 2 * 2 * 2 and "FAIL" not in out and "ALL OK" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| sparse")]
    assert len(rows) == 2 * 2 and all(row.rstrip().endswith("| 1.250 |") for row in rows), out
    assert calls.count("other") == calls.count("working tree") == 2 * 2 * 2


def test_gather_ceiling_kernel_sums_the_rows_the_indices_name(device):
    """gather_ceiling's kernel (the speed-of-light gather) reads exactly the rows the bench's indices name: its
    per-program sums equal torch's, on a tail program and with -1 entries too; and the draw is the bench's."""
    gather_ceiling = pytest.importorskip("gather_ceiling")
    from fp8mla.inputs import make_sparse_problem, sparse_indices

    g = torch.Generator(device=device)
    g.manual_seed(3)
    indices, num_pages = sparse_indices(2, 2, 40, 150, g)
    assert (indices == -1).any() and indices.max() < num_pages * 64
    cache = torch.randint(0, 2**16, (num_pages * 64, gather_ceiling.ROW_WORDS), dtype=torch.int32, device=device)
    flat = indices.reshape(-1)   # 160 indices: at 64 rows a program, a tail of 32
    for rows in (16, 64):
        sums = gather_ceiling.gather_sums(cache, flat, rows)
        assert sums.shape == (-(-160 // rows),)
        assert torch.equal(sums.cpu(), gather_ceiling.reference_sums(cache, flat, rows).cpu())
    cache[flat[5].long(), 7] += 1   # one word of a row program 0 names: its sum moves, as torch's does
    moved = gather_ceiling.gather_sums(cache, flat, 64)
    assert moved[0] != sums[0] and torch.equal(moved.cpu(), gather_ceiling.reference_sums(cache, flat, 64).cpu())
    p = make_sparse_problem(2, 2, 16, 40, 150, device=device, seed=3)
    assert torch.equal(p.indices, indices)   # the problem's indices are sparse_indices' draw
    with pytest.raises(SystemExit):   # (before any GPU work)
        gather_ceiling.main(["--rows", "24"])
