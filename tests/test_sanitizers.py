"""compute-sanitizer on the Hopper kernels (GPU, marked): every path (fp8_rope_bf16, fp8 with an e4m3 and a bf16 q,
bf16) of the small-rows and the 64-row kernel, on a split schedule with a short last page; and memcheck on
test_safety.py's bad inputs and test_sparse.py's.

memcheck: nothing is read or written outside its tensors. Each tensor is its own allocation (no caching
allocator), so a read past a sequence's pages or a tensor's end is an error memcheck sees. CUDA API errors are not
its subject and are not reported: Triton 3.9's loader asks for CU_SHARED_MEMORY_MODE_ALLOW_OVERSIZED_SHARED_MEMORY
on every kernel of more than 48 KB of shared memory and, refused by the H100's driver, takes the older call
(memcheck counted one error a kernel loaded, 2026-12-06).

racecheck is not clean and cannot be with this racecheck: it reports every shared-memory handoff that plain stores
make and an mbarrier orders (in scripts/racecheck_min.py even the arriving thread's own writes), and the state
bytes of Triton's warp_specialize at the kernel's entry (BENCHMARKS.md, 2026-11-30 03:53-04:01). The test pins
that down: every hazard it reports is between two accesses of those kinds, so any other shared-memory race
(e.g. a ring or reduction buffer reused too early) fails it."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SANITIZER = shutil.which("compute-sanitizer")
ROWS = pytest.mark.parametrize("rows", [("--s-q", "1", "--h-q", "16"), ("--s-q", "2", "--h-q", "64")],
                               ids=["small-rows kernel", "64-row kernel"])
NO_API_ERRORS = ("--report-api-errors", "no")   # memcheck's (the module docstring)


def _sanitize(tool, rows, *options):
    check = [sys.executable, "scripts/hopper_check.py", "--no-time", "--seqlens", "1000", "70", "--parts", "5", *rows]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    # compiled first without the sanitizer (under it the first compile is slow)
    subprocess.run(check, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    run = subprocess.run([SANITIZER, "--tool", tool, "--show-backtrace", "no", *options, *check], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert "ALL OK" in run.stdout, (run.stdout + run.stderr)[-4000:]
    return run


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer")
@ROWS
def test_memcheck_finds_no_error(rows):
    run = _sanitize("memcheck", rows, *NO_API_ERRORS, "--error-exitcode", "3")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "ERROR SUMMARY: 0 errors" in log


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer")
@pytest.mark.parametrize("tests", [["tests/test_safety.py"],
                                   ["tests/kernels/test_sparse.py", "-k", "bad_indices or all_skipped"]],
                         ids=["dense", "sparse"])
def test_memcheck_finds_no_error_on_bad_data(tests):
    """test_safety.py's bad inputs (pages outside the cache, seqlens beyond the block table or negative, schedules
    stale or not get_mla_metadata's, cache-writer slots past the cache), both backends, and the sparse call's
    (indices below -1 or past the cache, topk_length outside [0, topk], tokens that see nothing) on the portable
    kernel and both gather rings: nothing outside a tensor."""
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    subprocess.run(tests, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)   # compiled first
    run = subprocess.run([SANITIZER, "--tool", "memcheck", *NO_API_ERRORS, "--show-backtrace", "no", "--error-exitcode",
                          "3", *tests], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in log, log[-4000:]


# a hazard's access, as racecheck prints it: "Write Thread (96,0,0) at mla_decode_...+0xa60 in hopper.py:213"
ACCESS = re.compile(r"(Read|Write) Thread \(\d+,\d+,\d+\) at \S+ in (\S+\.py):(\d+)")
# the statements whose accesses racecheck cannot see ordered (see the module docstring): the softmax warpgroup's
# alpha and norm hand-offs (handshakes.py, softmax.py, bf16.py), the ring's bad-page flags (ring.py) and the
# 64-row kernel's q, which the PV warpgroups quantize for the softmax warpgroup (q_ready: operands.py, fp8.py)
MBARRIER_HANDOFF = re.compile(r"\b(alpha|norm|slot|q_lat|q_descale|descale_smem)\b(\.slice\([^)]*\))?[\w.()\[\]]*"
                              r"\.(store|load)\(")
WARP_SPECIALIZE_ENTRY = re.compile(r"^def mla_decode_\w+_kernel\(|gl\.warp_specialize\(")
BRANCH_HEADER = re.compile(r"\s*(if\b.*|else):\s*(#.*)?$")


def _statement(file, line):
    (path,) = (ROOT / "src" / "fp8mla" / "kernels").rglob(file)   # racecheck names a file by its base name
    lines = path.read_text().splitlines()
    if BRANCH_HEADER.match(lines[line - 1]):   # a constexpr branch's header stands for its body's first statement
        return lines[line - 1] + lines[line]
    return lines[line - 1]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer")
@ROWS
def test_racecheck_reports_only_mbarrier_handoffs_and_warp_specialize_entry(rows):
    run = _sanitize("racecheck", rows, "--racecheck-report", "hazard", "--print-limit", "1000000")
    log = run.stdout + run.stderr
    assert "RACECHECK SUMMARY" in log, log[-4000:]
    pairs = {}
    for hazard in log.split("Potential ")[1:]:
        kind = hazard.split()[0]
        accesses = tuple(ACCESS.findall(hazard)[:2])
        assert len(accesses) == 2, hazard[:600]
        pairs[(kind, *accesses)] = pairs.get((kind, *accesses), 0) + 1
    assert pairs, "racecheck found nothing: has it stopped flagging the handoffs (then make this test strict)?"
    for (kind, *accesses), n in pairs.items():
        statements = [_statement(file, int(line)) for _, file, line in accesses]
        handoff = all(MBARRIER_HANDOFF.search(t) for t in statements)
        entry = all(WARP_SPECIALIZE_ENTRY.search(t) for t in statements)
        assert handoff or entry, (kind, accesses, statements, n)
