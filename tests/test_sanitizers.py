"""compute-sanitizer memcheck on the Hopper kernels (GPU, marked): every path (fp8_rope_bf16, fp8 with an e4m3
and a bf16 q, bf16) of the small-rows and the 64-row kernel, on a split schedule with a short last page, reads and
writes nothing outside its tensors. Each tensor is its own allocation (no caching allocator), so a read past a
sequence's pages or a tensor's end is an error memcheck sees. (racecheck is not clean: BENCHMARKS.md.)"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SANITIZER = shutil.which("compute-sanitizer")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer")
@pytest.mark.parametrize("rows", [("--s-q", "1", "--h-q", "16"), ("--s-q", "2", "--h-q", "64")],
                         ids=["small-rows kernel", "64-row kernel"])
def test_memcheck_finds_no_error(rows):
    check = [sys.executable, "scripts/hopper_check.py", "--no-time", "--seqlens", "1000", "70", "--parts", "5", *rows]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    # compiled first without the sanitizer (under it the first compile is slow)
    subprocess.run(check, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    run = subprocess.run([SANITIZER, "--tool", "memcheck", "--error-exitcode", "3", *check], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "ERROR SUMMARY: 0 errors" in log and "ALL OK" in run.stdout
