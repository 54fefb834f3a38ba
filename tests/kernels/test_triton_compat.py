"""The installed Triton release (3.6 to 3.9): the Gluon names the kernels use resolve, and sm_90a code is compiled
by a ptxas that keeps it in registers (the SASS checks in test_hopper.py hold with it)."""
import re

import pytest
import triton
from triton import knobs
from triton.backends.nvidia.compiler import get_ptxas

from fp8mla.kernels import triton_compat


def release(version: str) -> tuple[int, int]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def test_this_release_is_supported_and_has_what_the_hopper_kernels_use():
    assert (3, 6) <= release(triton.__version__) < (3, 10)
    assert triton_compat.hopper_missing() is None
    for builtin in (triton_compat.barrier, triton_compat.tma_load, triton_compat.cp_async_load,
                    triton_compat.reinterpret):
        assert getattr(builtin, "__triton_builtin__", False)


def test_sm90_is_compiled_by_a_ptxas_older_than_13_1():
    """3.9 takes its ptxas 13.4 for sm_90 (spills in five of our kernels); inside compiling_for(90) Triton takes
    the wheel's ptxas 12.9 instead. Outside, and for other archs, Triton's own choice stays."""
    own = get_ptxas(90)
    with triton_compat.compiling_for(90):
        inside = get_ptxas(90)
        assert triton_compat.ptxas_for(90) == inside.path
    assert release(inside.version) < triton_compat.SPILLING_PTXAS
    assert get_ptxas(90).path == own.path   # restored
    if release(own.version) >= triton_compat.SPILLING_PTXAS:
        assert inside.path == knobs.nvidia.ptxas.path != own.path
    else:
        assert inside.path == own.path and triton_compat.sm90_ptxas() is None
    blackwell = get_ptxas(100).path
    with triton_compat.compiling_for(100):
        assert get_ptxas(100).path == blackwell


def test_a_missing_builtin_is_named(monkeypatch):
    monkeypatch.setattr(triton_compat, "tma_load", None)
    assert "tma_load" in triton_compat.hopper_missing()


@pytest.mark.parametrize("name", ["barrier", "tma_load", "cp_async_load"])
def test_the_kernels_call_the_renamed_builtins_through_this_module(name):
    """No kernel names a release's own spelling (3.6's is removed in 3.9, 3.9's absent in 3.6)."""
    from pathlib import Path

    kernels = Path(triton_compat.__file__).parent
    old = {"barrier": "thread_barrier(", "tma_load": "async_copy_global_to_shared(",
           "cp_async_load": "async_copy_global_to_shared("}[name]
    for path in kernels.rglob("*.py"):
        if path.name != "triton_compat.py":
            text = path.read_text()
            assert old not in text and "._reinterpret(" not in text and ".async_load(" not in text, path
