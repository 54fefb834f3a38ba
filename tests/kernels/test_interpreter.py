"""fp8mla's fixes to Triton's CPU interpreter (kernels/interpreter.py) that are not about arithmetic: reductions with
a combine function of our own, computed by whole halves, and numpy's warnings about the infs and NaNs the kernels
compute on purpose, kept from the user."""
import warnings

import pytest
import torch
import triton
import triton.language as tl

from fp8mla import flash_mla_with_kvcache, get_mla_metadata
from fp8mla.inputs import make_problem
from fp8mla.kernels import interpreter


@triton.jit
def _first_nonzero_and_sum(a, s, b, t):   # associative, and not commutative in its first half
    return tl.where(a != 0, a, b), s + t


@triton.jit
def _reduce_rows_kernel(x_ptr, out_ptr, N: tl.constexpr):
    rows = tl.arange(0, 4)
    x = tl.load(x_ptr + rows[:, None] * N + tl.arange(0, N)[None, :])
    first, total = tl.reduce((x, x), 1, _first_nonzero_and_sum)
    tl.store(out_ptr + rows, first)
    tl.store(out_ptr + 4 + rows, total)


def test_reduce_with_our_combine_function_keeps_the_order(device):
    """(The combine kernel's schedule check reduces four sums at once this way.) In order, as the interpreter's own
    fold: even a combine function that is not commutative gets its result."""
    if device.type == "cuda":
        pytest.skip("the interpreter's reduction (a GPU reduces in an order of its own: tl.reduce is for commutative "
                    "combine functions)")
    interpreter.apply()
    x = torch.randint(-3, 4, (4, 64), dtype=torch.int32, device=device)
    x[:, :5] = 0
    x[3] = 0
    x[2, 63] = 7
    out = torch.empty(8, dtype=torch.int32, device=device)
    _reduce_rows_kernel[(1,)](x, out, N=64)
    first = [next((int(v) for v in row if v != 0), 0) for row in x.cpu()]
    assert out[:4].tolist() == first and out[4:].tolist() == x.sum(1).tolist()


def test_bad_data_makes_no_numpy_warning(device):
    """Run as a user runs (no pytest filter: every warning recorded): a page outside the cache, a negative seqlen, a
    seqlen beyond the block table and an empty request come back NaN, or 0 and +inf, without numpy's RuntimeWarnings
    ("divide by zero encountered in log") from inside Triton's interpreter. (Triton 3.6's interpreter also makes
    numpy DeprecationWarnings, which Python shows only where __main__ makes them.)"""
    p = make_problem(3, 2, 16, [200, 130, 64], device=device, seed=1)
    outside = p.block_table.clone()
    outside[1, 1] = 10 ** 6
    negative, beyond, empty = (p.cache_seqlens.clone() for _ in range(3))
    negative[1] = -3
    beyond[0] = p.block_table.shape[1] * 64 + 10
    empty[2] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for table, seqlens in ((outside, p.cache_seqlens), (p.block_table, negative), (p.block_table, beyond),
                               (p.block_table, empty)):
            meta, splits = get_mla_metadata(seqlens, 32, 1)
            out, lse = flash_mla_with_kvcache(p.q, p.kv, table, seqlens, 512, meta, splits, causal=True)
            assert lse.isnan().any() or lse.isinf().any()
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
