"""Fixes for known defects of Triton's CPU interpreter (``TRITON_INTERPRET=1``), 3.6 to 3.9.

1. A bf16 ``tl.dot`` multiplies the raw 16-bit patterns (upstream issue #11584): we widen bf16 operands to
   fp32 first, and decode fp8 operands exactly.
2. fp32/bf16 -> float8 casts round wrongly in ~2 % of values, do not saturate and turn NaN into 384 (upstream
   PR #11897): we convert through torch, saturating with round-to-nearest-even like the GPU's
   ``cvt.rn.satfinite``.
3. fp32 -> bf16 casts truncate where the GPU rounds to nearest even: we convert through torch.
4. 3.9: ``bool_tensor & (scalar comparison)`` comes out int32 (0 or 1), which loads and stores reject as a mask:
   we read such a mask as bool, as the compiled kernel does.
5. ``tl.reduce`` with a combine function of the kernel's own (the combine's schedule check, four sums at once)
   calls it once per element, in Python: a 256-long reduction took ~0.25 s, most of a small decode's time. We
   combine neighbouring pairs, whole halves of the axis at a time (log2 n calls), keeping the elements' order:
   for an associative combine function (a ``tl.reduce``'s is, and commutative too, as a GPU reduces in an order
   of its own) the result is the element-by-element fold's.
6. numpy warns ("divide by zero encountered in log", ...) where the kernels compute inf or NaN on purpose (a row
   that sees no key: log 0, x / 0; bad data marked NaN), as the GPU does silently: :func:`launch` runs a kernel
   with numpy's floating-point warnings off, for that launch only (the caller's own numpy code warns as before).

:func:`launch` patches the interpreter once (:func:`apply`) and runs a kernel; the library launches every kernel
in the interpreter through it, so CPU results match the GPU's arithmetic.
"""
from __future__ import annotations

import numpy as np
import torch

_FP8_TORCH = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
_FP8_MAX = {"fp8e4nv": 448.0, "fp8e5": 57344.0}
_applied = False
_generic_reduce = None   # the interpreter's own, element by element


def _to_float32(data: np.ndarray, dtype) -> np.ndarray:
    name = str(dtype)
    if name == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    if name in _FP8_TORCH:
        raw = torch.from_numpy(np.ascontiguousarray(data)).view(_FP8_TORCH[name])
        return raw.float().numpy()
    return data.astype(np.float32)


def launch(kernel, grid, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` in the interpreter, patched, without numpy's floating-point warnings."""
    apply()
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        kernel[grid](*args, **kwargs)


def _pairwise_reduce(self, input):
    """``ReduceOps.generic_reduce``: the same reduction, by whole neighbouring pairs along the axis (fix 5)."""
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    data = [arg.handle.data for arg in input]
    shape = data[0].shape
    if shape[axis] & (shape[axis] - 1):   # (Triton's shapes are powers of two)
        return _generic_reduce(self, input)
    while data[0].shape[axis] > 1:
        left = [d[(slice(None),) * axis + (slice(0, None, 2),)] for d in data]
        right = [d[(slice(None),) * axis + (slice(1, None, 2),)] for d in data]
        ret = self.combine_fn.fn(*(self.to_tensor(x, t) for x, t in zip(left, dtypes)),
                                 *(self.to_tensor(x, t) for x, t in zip(right, dtypes)))
        ret = ret if isinstance(ret, tuple) else (ret,)
        data = [np.broadcast_to(r.handle.data if isinstance(r, tl.core.tensor) else np.asarray(r), x.shape)
                .astype(x.dtype) for r, x in zip(ret, left)]
    out = []
    for d, dtype in zip(data, dtypes):
        d = np.squeeze(d, axis=axis)
        if self.keep_dims:
            d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * len(shape))
        elif original_axis is None:
            d = d.item()
        out.append(self.to_tensor(d, dtype))
    return out


def apply() -> None:
    """Patch ``triton.runtime.interpreter``'s builder and reductions (idempotent)."""
    global _applied, _generic_reduce
    if _applied:
        return
    from triton.runtime import interpreter as interp

    _generic_reduce = interp.ReduceOps.generic_reduce
    interp.ReduceOps.generic_reduce = _pairwise_reduce

    builder = interp.InterpreterBuilder
    original_dot = builder.create_dot
    original_fp_to_fp = builder.create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if str(a.dtype.scalar) in ("bf16", *_FP8_TORCH) or str(b.dtype.scalar) in ("bf16", *_FP8_TORCH):
            prod = np.matmul(_to_float32(a.data, a.dtype.scalar), _to_float32(b.data, b.dtype.scalar))
            return interp.TensorHandle((prod + d.data).astype(d.data.dtype), d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst = str(dst_type.scalar)
        if dst in _FP8_TORCH:
            x = torch.from_numpy(np.ascontiguousarray(_to_float32(src.data, src.dtype.scalar)))
            x = torch.where(x.isnan(), x, x.clamp(-_FP8_MAX[dst], _FP8_MAX[dst]))
            data = x.to(_FP8_TORCH[dst]).view(torch.uint8).numpy().reshape(src.data.shape)
            return interp.TensorHandle(data, dst_type.scalar)
        if str(src.dtype.scalar) in _FP8_TORCH and dst in ("fp32", "bf16", "fp16"):
            x = torch.from_numpy(_to_float32(src.data, src.dtype.scalar))
            torch_dst = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dst]
            data = x.to(torch_dst).view({"fp32": torch.int32, "bf16": torch.int16, "fp16": torch.int16}[dst])
            return interp.TensorHandle(data.numpy().view(interp._get_np_dtype(dst_type)).reshape(src.data.shape),
                                       dst_type.scalar)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    def cast_impl(self, src, dst_type):
        if str(src.dtype.scalar) == "fp32" and str(dst_type.scalar) == "bf16":
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interp.TensorHandle(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                       dst_type.scalar)
        return original_cast(self, src, dst_type)

    def create_masked_load(self, ptrs, mask, *rest):   # (the rest differ between releases)
        return original_load(self, ptrs, _bool_mask(mask), *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        return original_store(self, ptrs, value, _bool_mask(mask), *rest)

    def _bool_mask(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interp.TensorHandle(mask.data != 0, mask.dtype)

    original_load, original_store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    original_cast = builder.cast_impl
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_dot = create_dot
    builder.create_fp_to_fp = create_fp_to_fp
    _applied = True
