"""fp8mla's fixes to Triton's CPU interpreter (kernels/interpreter.py) that are not about arithmetic: numpy's
warnings about the infs and NaNs the kernels compute on purpose, kept from the user."""
import warnings

import torch

from fp8mla import flash_mla_with_kvcache, get_mla_metadata
from fp8mla.inputs import make_problem


def test_bad_data_makes_no_numpy_warning(device):
    """Run as a user runs (no pytest filter: every warning recorded): a page outside the cache, a negative seqlen, a
    seqlen beyond the block table and an empty request come back NaN, or 0 and +inf, without numpy's "divide by zero
    encountered in log" from inside Triton's interpreter."""
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
    assert [str(w.message) for w in caught] == []
