"""What differs between the Triton releases fp8mla supports (3.6 to 3.9), kept in this one module.

Gluon renamed some builtins between those releases; the kernels call them by the names below, which resolve to
whatever the installed release has (each is the same builtin under another name, so the kernels compile to the
same code):

  3.6                                      later                                       since
  gl.thread_barrier()                      gl.barrier()                                3.7 (old name removed)
  tma.async_copy_global_to_shared(...)     tma.async_load(...), same positions         3.8 (old name gone in 3.9)
  async_copy.async_copy_global_to_shared   async_copy.async_load, same positions       3.8 (likewise)
  smem._reinterpret(dtype, shape, layout)  smem.reinterpret(dtype, shape, layout)      3.9

``hopper_missing()`` says what the Hopper kernels would lack on the installed release (None if nothing): the
backend choice asks it rather than a version string. ``sm90_ptxas()`` picks the ptxas for sm_90a: Triton 3.9
compiles sm_90 with its ptxas 13.4, whose register allocation spills in five of these kernels where ptxas 12.x and
13.0 keep everything in registers; the same wheel ships ptxas 12.9, used instead for our kernels only.
``direct_launch`` calls the driver's launcher as each release's own launch path does (3.6: a launcher compiled per
kernel, its arguments flat; 3.7 on: one launcher, the arguments as a sequence with their annotations), which
tests/kernels/test_launcher.py checks against the installed release.
"""
from __future__ import annotations

import contextlib
import functools
import re

import triton
import triton.language as tl
from triton import knobs

# ---- Gluon, whatever the release calls it ----
try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import tma
    _GLUON_ERROR = None
except ImportError as e:   # a Triton without Gluon: the portable kernels only
    gl = async_copy = tma = None
    _GLUON_ERROR = f"triton {triton.__version__} has no Gluon for Hopper ({e})"


def _first(module, *names):
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    return None


barrier = _first(gl, "barrier", "thread_barrier")                         # a CTA-wide barrier
tma_load = _first(tma, "async_load", "async_copy_global_to_shared")       # TMA: global -> shared memory
cp_async_load = _first(async_copy, "async_load", "async_copy_global_to_shared")   # cp.async, likewise
# aggregates (named groups of values passed into jit functions as one argument) became public in 3.7
aggregate = _first(triton, "aggregate") or tl.core._aggregate


@tl.core.builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """``smem`` viewed as another dtype, shape and layout (a builtin: 3.6 cannot pass a layout into a jit
    function)."""
    view = getattr(smem, "reinterpret", None) or smem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


def hopper_missing() -> str | None:
    """What the Gluon Hopper kernels need and the installed Triton lacks, or None."""
    if _GLUON_ERROR:
        return _GLUON_ERROR
    needed = dict(barrier=barrier, tma_load=tma_load, cp_async_load=cp_async_load,
                  warp_specialize=getattr(gl, "warp_specialize", None))
    missing = [name for name, value in needed.items() if value is None]
    if missing:
        return f"triton {triton.__version__}'s Gluon has no {', '.join(missing)}"
    return None


# Our kernels are written for FP fusion (FMA contraction), 3.6's default; 3.9 warns that the default will change,
# 3.10 changes it. Passed on every compile (TRITON_FORCE_DISABLE_FP_FUSION still turns it off).
COMPILE_OPTIONS = dict(enable_fp_fusion=True)

# ---- ptxas for sm_90a ----
SPILLING_PTXAS = (13, 1)   # ptxas from this release on spills in five of these kernels (sm_90a)


def _release(tool) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", tool.version)[:2]) if tool is not None else ()


@functools.lru_cache(maxsize=None)
def sm90_ptxas() -> str | None:
    """The path of the ptxas to compile fp8mla's sm_90a kernels with when it is not the one Triton would take
    (None: Triton's own): the release's legacy ptxas where Triton's choice for sm_90 is 13.1 or newer."""
    from triton.backends.nvidia.compiler import get_ptxas

    chosen = get_ptxas(90)
    if _release(chosen) < SPILLING_PTXAS:
        return None
    legacy = knobs.nvidia.ptxas
    if legacy is not None and legacy.path != chosen.path and _release(legacy) < SPILLING_PTXAS:
        return legacy.path
    return None


def ptxas_for(arch: int) -> str:
    """The path of the ptxas our kernels are compiled with for ``arch``."""
    from triton.backends.nvidia.compiler import get_ptxas

    return (sm90_ptxas() if arch == 90 else None) or get_ptxas(arch).path


@contextlib.contextmanager
def compiling_for(arch: int):
    """Around a compile of our kernels for ``arch`` (e.g. 90): Triton takes sm90_ptxas() for sm_90."""
    path = sm90_ptxas() if arch == 90 else None
    if path is None:
        yield
        return
    with knobs.nvidia.scope():
        knobs.nvidia.ptxas_blackwell = path   # what Triton 3.9 runs for sm_90 and newer
        yield


# ---- a compiled kernel's launch without Triton's per-launch Python ----
def _raw_launcher(launch):
    """The driver's launcher under the wrapper that expands TMA descriptors (the wrapper itself where a kernel
    takes none): every release from 3.6 on wraps it in a closure over ``launcher``."""
    code = getattr(launch, "__code__", None)
    if code is None or "launcher" not in code.co_freevars:
        return launch
    return launch.__closure__[code.co_freevars.index("launcher")].cell_contents


def direct_launch(kernel, params: tuple):
    """``go(grid, stream, params)`` launching ``kernel`` (a CompiledKernel) as ``kernel.run`` would, for parameters
    typed like ``params``, or None where Triton's own path must run (scratch memory, sanitizers). What ``kernel.run``
    redoes at every launch is done once here: each TMA descriptor is expanded into the driver's arguments (its
    encoded tensor map, shape, strides) once per descriptor object, and the launch hooks (profilers) are asked for
    by the caller (``hooked``). Tensors go to the driver's launcher as their addresses: given a tensor, it asks the
    driver whether the address is a device one (``cuPointerGetAttribute``, a driver call per pointer and launch);
    given an int, it takes it as is (the API's checks put every tensor on the launch's device)."""
    from triton.backends.nvidia import driver as nvidia_driver

    run = kernel.run
    if run.global_scratch_size or run.profile_scratch_size or getattr(run, "gsan_enabled", False):
        return None
    raw = _raw_launcher(run.launch)
    make_arg = nvidia_driver.make_tensordesc_arg   # (arg, metadata), from 3.8 on (arg, metadata, base args)
    takes_base = make_arg.__code__.co_argcount == 3
    metas = list(getattr(kernel.metadata, "tensordesc_meta", None) or ())
    expanded: dict = {}   # (position, id) -> (descriptor, its driver arguments)

    def expand(position, desc, meta):
        known = expanded.get((position, id(desc)))
        if known is None or known[0] is not desc:   # (an id is only reused once its object is gone)
            if len(expanded) > 256:
                expanded.clear()
            known = expanded[(position, id(desc))] = (
                desc, tuple(make_arg(desc, meta, ()) if takes_base else make_arg(desc, meta)))
        return known[1]

    # the driver's arguments of the parameters p, written out once as straight-line code (as Triton's own binder
    # is): a tensor as its address, a descriptor expanded, anything else as it is
    kernel_args, descriptors = [], 0
    for i, param in enumerate(params):
        if hasattr(param, "data_ptr"):
            kernel_args.append(f"p[{i}].data_ptr()")
        elif hasattr(param, "block_shape"):
            meta = f"metas[{descriptors}]" if descriptors < len(metas) else "None"
            kernel_args.append(f"*expand({i}, p[{i}], {meta})")
            descriptors += 1
        else:
            kernel_args.append(f"p[{i}]")
    kernel_args = ", ".join(kernel_args)
    scope = dict(raw=raw, expand=expand, metas=metas, function=kernel.function, packed=kernel.packed_metadata,
                 coop=run.launch_cooperative_grid, pdl=run.launch_pdl)
    if hasattr(run, "kernel_signature"):   # 3.7 on: one launcher for all kernels, the arguments as a sequence
        scope.update(annotations=run.arg_annotations, signature=run.kernel_signature)
        source = ("lambda grid, stream, p: raw(*grid, stream, function, coop, pdl, packed, None, None, None, None, "
                  f"None, annotations, signature, [{kernel_args}])")
    else:   # 3.6: a launcher compiled for this kernel's signature, the arguments flat
        source = ("lambda grid, stream, p: raw(*grid, stream, function, coop, pdl, None, None, packed, None, None, "
                  f"None, {kernel_args})")
    return eval(source, scope)


def _active(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))   # (an empty HookChain calls nothing)


def hooked() -> bool:
    """Whether a launch hook (a profiler's) is set: then launches take Triton's own path, which calls it."""
    return _active(knobs.runtime.launch_enter_hook) or _active(knobs.runtime.launch_exit_hook)
