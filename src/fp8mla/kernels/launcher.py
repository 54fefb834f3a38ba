"""Launching our compiled kernels without Triton's per-call argument binding.

``kernel[grid](*args)`` binds and specializes every argument, builds a cache key and re-checks each global the
kernel read (the Gluon kernels read ~30 module-level constexprs) on every call: ~100 µs of Python per launch on
the H200 machine's CPU, which made one eager decode call cost 150-350 µs of host time against the GPU's ~220 µs
(BENCHMARKS.md). ``CachedLauncher`` launches through Triton the first time it sees a *specialization key*, built
here from the argument properties Triton specializes on (dtypes; pointers 16-byte aligned or not; ints equal to
1, divisible by 16, 64-bit; tensor descriptors' dtype, block, layout, shape and strides), or given by the caller
(one key for a whole call's launches), and afterwards calls the driver's launcher directly
(``triton_compat.direct_launch``: no Python of Triton's between, TMA descriptors encoded once). The key is never
coarser than Triton's, so a launch with different properties compiles (or looks up) its own kernel through Triton
as before. ``planned`` keeps, per call signature, a decode call's launches with everything the signature fixes
worked out (grids, strides, sizes, each launcher's ``Variant`` of constexprs and options), so a call builds only its
tensor arguments.
"""
from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.runtime import driver

from ..runtime import interpreter_active
from .triton_compat import COMPILE_OPTIONS, compiling_for, direct_launch, hooked


# what Triton may specialize an argument of these exact types on (or more)
_PLAIN_SPECS = {torch.Tensor: lambda arg: (arg.dtype, arg.data_ptr() % 16 == 0),
                int: lambda arg: (int, arg == 1, arg % 16 == 0, -2 ** 31 <= arg < 2 ** 31),
                float: lambda arg: float,
                bool: lambda arg: (bool, arg)}


def _spec(arg):
    """What Triton may specialize a kernel argument on (or more)."""
    plain = _PLAIN_SPECS.get(type(arg))
    if plain is not None:
        return plain(arg)
    for kind in (torch.Tensor, bool, int, float):   # subclasses (bool before int, as it is one)
        if isinstance(arg, kind):
            return _PLAIN_SPECS[kind](arg)
    if hasattr(arg, "block_shape"):  # a host-side TMA descriptor
        return (type(arg), arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.block_shape), arg.layout,
                tuple(arg.shape), tuple(arg.strides))
    return type(arg), arg


_tokens: dict = {}


def _token(spec) -> tuple:
    """A small stand-in for a (hashable) spec, the same for equal specs."""
    return ("spec", _tokens.setdefault(spec, len(_tokens)))


@functools.lru_cache(maxsize=None)
def _interpreting() -> bool:
    """Whether the kernels are interpreted functions (decided when they were decorated, so once a process)."""
    return interpreter_active()


def _current_device() -> int:
    return driver.active.get_current_device()   # where Triton launches (not necessarily the tensors' device)


def _current_arch() -> int:
    return driver.active.get_current_target().arch   # e.g. 90: which ptxas compiles (triton_compat.compiling_for)


def _current_stream(device: int) -> int:
    return driver.active.get_current_stream(device)   # Triton's own (a raw handle, no torch Stream object)


ASK = object()   # CachedLauncher's site argument when the caller has none


class CachedLauncher:
    """``launcher(grid, args, constexprs, **options)`` = ``fn[grid](*args, **constexprs, **options)``, the compiled
    kernel reused for arguments of the same specialization on the same (current) device. The kernel's constexpr
    parameters must come last, in the order of ``constexprs``; ``args`` are the others, positional."""

    def __init__(self, fn):
        self.fn = fn
        self.kernels: dict = {}
        self._descriptors: dict = {}   # id -> (descriptor, a small int for its spec): computed once per object

    def _key(self, args: tuple) -> tuple:
        """``tuple(map(_spec, args))``, faster: this runs on every launch (tensors and ints, most of the arguments,
        inline; a TMA descriptor, rebuilt by nobody and reused call after call, by a token of its spec, worked
        out once per object and then hashed as an int instead of its layout)."""
        key = []
        for arg in args:
            kind = type(arg)
            if kind is torch.Tensor:
                key.append((arg.dtype, not arg.data_ptr() & 15))
            elif kind is int:
                key.append((arg == 1, not arg & 15, -2 ** 31 <= arg < 2 ** 31))
            elif kind in _PLAIN_SPECS:
                key.append(_PLAIN_SPECS[kind](arg))
            elif hasattr(arg, "block_shape"):
                known = self._descriptors.get(id(arg))
                if known is None or known[0] is not arg:   # (an id is only reused once its object is gone)
                    if len(self._descriptors) > 256:
                        self._descriptors.clear()
                    known = self._descriptors[id(arg)] = (arg, _token(_spec(arg)))
                key.append(known[1])
            else:
                key.append(_spec(arg))
        return tuple(key)

    def __call__(self, grid, args: tuple, constexprs: dict, key=None, site=ASK, **options):
        """``key``, where the caller has one, stands for ``self._key(args)``: a hashable value that determines
        every property of ``args`` Triton specializes on (e.g. checks.DecodeCall.signature, the number of a
        signature that holds every tensor's dtype, shape, strides and alignment). ``site``: ``launch_site()``, where
        the caller launches several kernels (asked here otherwise)."""
        self.launch(Variant(self, constexprs, options), grid, args, key, site)

    def variant(self, constexprs: dict, **options) -> Variant:
        """The launches of these constexprs and options, their part of the work done once (for plans)."""
        return Variant(self, constexprs, options)

    def launch(self, variant: Variant, grid, args: tuple, key, site) -> None:
        """One launch of ``variant``'s constexprs and options (``key`` and ``site`` as for ``__call__``)."""
        if site is ASK:
            site = launch_site()
        if site is None:
            if _interpreting():  # the interpreter compiles nothing (and has defects: interpreter.py)
                from . import interpreter
                interpreter.launch(self.fn, grid, args, {**variant.constexprs, **variant.options})
                return
            site = (_current_device(), None)   # a launch hook: every launch through Triton, which calls it
        device, stream = site
        key = (device, self._key(args) if key is None else key, variant.fixed)
        go = self.kernels.get(key)
        params = args + variant.values
        if go is None or stream is None:
            if tuple(self.fn.arg_names[len(args):]) != tuple(variant.constexprs):
                raise TypeError(f"{self.fn.arg_names} do not end with the constexprs {tuple(variant.constexprs)}")
            with compiling_for(_current_arch()):
                kernel = self.fn[grid](*args, **variant.constexprs, **COMPILE_OPTIONS, **variant.options)
            if go is None:
                self.kernels[key] = direct_launch(kernel, params) or _triton_launch(kernel)
            return
        go((*grid, 1, 1)[:3], stream, params)


_fixed_numbers: dict = {}   # (constexprs, options) -> a number of its own, never reused


class Variant:
    """A CachedLauncher's launches with given constexprs and options, ``variant(grid, args, key, site)``: their
    part of the cache key and the constexprs' values are worked out once, when a plan (``planned``) makes it."""
    __slots__ = ("launcher", "constexprs", "options", "fixed", "values")

    def __init__(self, launcher: CachedLauncher, constexprs: dict, options: dict):
        self.launcher, self.constexprs, self.options = launcher, constexprs, options
        # its part of the launch key, as a number (hashed on every launch)
        self.fixed = _fixed_numbers.setdefault((tuple(constexprs.items()), tuple(options.items())),
                                               len(_fixed_numbers))
        self.values = tuple(constexprs.values())

    def __call__(self, grid, args: tuple, key=None, site=ASK) -> None:
        self.launcher.launch(self, grid, args, key, site)


_plans: dict = {}


def planned(make, call, *extra):
    """``make(call, *extra)``: a function that launches calls of ``call``'s signature (checks.DecodeCall), made
    once with what the signature fixes (grids, strides, sizes, constexprs) and kept per (make, signature, *extra);
    made anew for a call of no known signature."""
    if call.signature is None:
        return make(call, *extra)
    key = (make, call.signature, *extra)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= 256:
            _plans.clear()
        plan = _plans[key] = make(call, *extra)
    return plan


def launch_site() -> tuple[int, int] | None:
    """(current device, its current stream), where our launches go, asked once for the launches of one call; None
    where they must go through Triton: in the interpreter, and while a launch hook (a profiler's) is set."""
    if _interpreting() or hooked():
        return None
    device = _current_device()
    return device, _current_stream(device)


def _triton_launch(kernel):
    """``go(grid, stream, params)`` through the compiled kernel's own launcher (where direct_launch cannot)."""
    def go(grid, stream, params):
        metadata = kernel.launch_metadata(grid, stream, *params)
        kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, metadata, knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *params)
    return go


def capturing(device: torch.device) -> bool:
    """Whether work launched now on ``device`` goes into a CUDA graph being captured (never on the CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_scratch: dict = {}


def scratch(device: torch.device, *specs: tuple[tuple, torch.dtype]) -> tuple[torch.Tensor, ...]:
    """Buffers of the given (shape, dtype)s for what the kernels of one call hand each other (split results, a
    quantized q), reused by later calls on the same stream: their kernels run after this call's, so they never
    overwrite them early. Under CUDA-graph capture (whose graph keeps what it captured) and on the CPU they are new
    ones each time."""
    if device.type != "cuda" or capturing(device):
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
    key = (_current_stream(device.index), specs)
    buffers = _scratch.get(key)
    if buffers is None:
        if len(_scratch) >= 64:   # (a freed buffer goes back to torch's allocator, for this stream's later work)
            _scratch.clear()
        buffers = _scratch[key] = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
    return buffers
