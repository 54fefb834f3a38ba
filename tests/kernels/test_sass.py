"""The kernels compile for sm_90a on a machine with no GPU, to the instructions they are written for."""
import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def portable_sass():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "fp8mla.kernels.sass"], env=env, check=True, capture_output=True,
                         text=True, timeout=600).stdout
    return {r["name"]: r for r in map(json.loads, out.splitlines())}


@pytest.mark.parametrize("fmt", ["fp8", "fp8_rope_bf16"])
def test_portable_fp8_uses_fp8_and_bf16_wgmma(portable_sass, fmt):
    r = portable_sass[f"portable[{fmt}]"]
    assert r["QGMMA"] > 0   # latent Q.K^T and P.V on FP8 tensor cores
    assert r["HGMMA"] > 0   # RoPE part in BF16


def test_portable_bf16_uses_bf16_wgmma(portable_sass):
    r = portable_sass["portable[bf16]"]
    assert r["HGMMA"] > 0 and r["QGMMA"] == 0


def test_combine_has_no_local_memory(portable_sass):
    r = portable_sass["combine"]
    assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0
