"""Facts about the process and its devices that every layer may ask; imports nothing else of fp8mla.

The package's layers, each importing only those below it:

    runtime -> formats -> schedule -> kernels -> checks, api -> compat, bench, demo, __main__
    (reference and inputs sit beside schedule: they need formats only)
"""
from __future__ import annotations

import functools
import os
import re

import torch

CPU_SMS = 4   # the "SM" count the schedule assumes for the Triton interpreter (FP8MLA_CPU_SMS overrides it)


def interpreter_active() -> bool:
    """Whether Triton's CPU interpreter is on (TRITON_INTERPRET=1; it must be set before fp8mla.kernels is
    imported: kernels become interpreted functions when they are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_index(device: torch.device) -> int:
    """The CUDA device number of ``device`` (the current device for a plain "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs the schedule spreads a batch over: the GPU's, or CPU_SMS for the interpreter."""
    if device.type == "cuda":
        return _cuda_sms(device_index(device))
    return int(os.environ.get("FP8MLA_CPU_SMS", CPU_SMS))


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``, e.g. (9, 0) for Hopper."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def triton_release() -> tuple[int, int]:
    """The installed Triton's (major, minor), e.g. (3, 9). Imported when first asked (a call's kernel choice), not
    with fp8mla: the interpreter switch must come before Triton's functions are decorated."""
    import triton

    major, minor = re.findall(r"\d+", triton.__version__)[:2]
    return int(major), int(minor)
