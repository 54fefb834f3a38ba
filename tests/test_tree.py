"""The suite tests the fp8mla of the tree it is in, whichever copy is installed."""
import subprocess
import sys
from pathlib import Path

import fp8mla

SRC = Path(__file__).resolve().parent.parent / "src"


def test_imports_this_trees_fp8mla():
    assert Path(fp8mla.__file__).resolve().is_relative_to(SRC), fp8mla.__file__


def test_subprocesses_import_this_trees_fp8mla():
    out = subprocess.run([sys.executable, "-c", "import fp8mla; print(fp8mla.__file__)"], cwd="/", check=True,
                         capture_output=True, text=True).stdout.strip()   # inherits this process's environment
    assert Path(out).resolve().is_relative_to(SRC), out
