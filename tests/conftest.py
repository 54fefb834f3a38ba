"""Test setup: without a GPU every kernel runs in Triton's interpreter (with fp8mla's fixes for its defects)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = str(Path(__file__).resolve().parent.parent / "src")
# the subprocesses the tests start (SASS reports, the demo, the sanitizers' runs) import this tree's fp8mla too,
# as pytest's pythonpath makes this process do, not an installed copy of another tree
os.environ["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # must be set before any @triton.jit function is created
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _without_interpreter() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


# the SASS reports' fixtures and what each compiles (python -m fp8mla.kernels.sass WHICH, in a subprocess: ~40 s
# and ~20 s of one core without a Triton cache)
SASS_FIXTURES = {"hopper_sass": "hopper", "portable_sass": "portable"}
_compiles: dict = {}   # which -> its subprocess, started once


def _compile(which: str) -> subprocess.Popen:
    if which not in _compiles:
        _compiles[which] = subprocess.Popen([sys.executable, "-m", "fp8mla.kernels.sass", which],
                                            env=_without_interpreter(), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
    return _compiles[which]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_hopper = pytest.mark.skip(reason="needs an sm_90 GPU")
    is_hopper = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "hopper" in item.keywords and not is_hopper:
            item.add_marker(skip_hopper)


def pytest_collection_finish(session):
    """The selected tests (-k, -m applied) that read SASS reports go last, and their kernels compile in the
    background from now on, on another core than the tests before them."""
    def fixtures(item):
        return set(getattr(item, "fixturenames", ())) & set(SASS_FIXTURES)

    session.items.sort(key=lambda item: bool(fixtures(item)))   # (stable: each group keeps its order)
    for name in set().union(*map(fixtures, session.items)):
        _compile(SASS_FIXTURES[name])


def pytest_sessionfinish(session):
    for process in _compiles.values():   # (a session cut short leaves none running)
        if process.poll() is None:
            process.kill()


@pytest.fixture(scope="session")
def sass_reports():
    """``sass_reports(which)``: ``python -m fp8mla.kernels.sass which``'s reports by kernel name, from its
    subprocess (started by pytest_collection_finish, or now)."""
    def reports(which: str) -> dict:
        process = _compile(which)
        out, err = process.communicate(timeout=900)
        if process.returncode:
            raise RuntimeError(f"python -m fp8mla.kernels.sass {which} failed:\n{err}")
        return {r["name"]: r for r in map(json.loads, out.splitlines())}
    return reports


@pytest.fixture(scope="session")
def env_without_interpreter():
    """The environment for a subprocess that compiles kernels for sm_90a or picks its own mode (fp8mla's
    __main__): this process's (PYTHONPATH included), without the TRITON_INTERPRET set above."""
    return _without_interpreter()


@pytest.fixture
def device():
    """Where kernel tests run: the GPU if there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture(autouse=True)
def no_plans_from_other_tests(monkeypatch):
    """Each test plans its calls anew: plans are kept per argument signature (kernels/launcher.planned), and a test
    may change what they depend on beyond it (e.g. runtime.sm_count, fixed in a real process)."""
    from fp8mla.kernels import launcher
    monkeypatch.setattr(launcher, "_plans", {})
