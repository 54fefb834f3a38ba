"""Test setup: without a GPU every kernel runs in Triton's interpreter (with fp8mla's fixes for its defects)."""
import os
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


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_hopper = pytest.mark.skip(reason="needs an sm_90 GPU")
    is_hopper = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "hopper" in item.keywords and not is_hopper:
            item.add_marker(skip_hopper)


@pytest.fixture(scope="session")
def env_without_interpreter():
    """The environment for a subprocess that compiles kernels for sm_90a or picks its own mode (fp8mla's
    __main__): this process's (PYTHONPATH included), without the TRITON_INTERPRET set above."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


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
