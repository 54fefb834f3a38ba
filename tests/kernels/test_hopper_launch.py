"""The Hopper launchers' host side, their Triton launches faked (CPU tensors, or CUDA ones where there is a GPU):
which kernel the dispatch table gives a call, with which grid, TMA descriptors, scales and constexprs (the kernels
themselves are compiled in test_hopper.py and run on a GPU)."""
import math

import pytest
import torch

from fp8mla import get_mla_metadata
from fp8mla.checks import check_decode
from fp8mla.inputs import make_problem
from fp8mla.kernels import decoder_for, launcher
from fp8mla.kernels.constants import FORMAT_CODE, LOG2E
from fp8mla.kernels.hopper import LAUNCH, bf16, launch as hopper_launch, layouts
from fp8mla.runtime import triton_release

# the 64-row kernel reads fp8_ds_mla above 64 heads from Triton 3.9 on (under 3.6 it spills: docs/design.md)
DS_MLA_64_ROWS = triton_release() >= (3, 9)
# the calls' tensors: CUDA ones where there is a GPU (the interpreter then is not on, and the planner runs for real)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class RecordingLauncher:
    """Stands for a kernel's CachedLauncher: records each launch of its variants (constexprs and options fixed),
    whose constexprs must be the kernel's last parameters in their order, as CachedLauncher requires."""
    def __init__(self, name, calls, fn):
        self.name, self.calls, self.fn = name, calls, fn

    def variant(self, constexprs, **options):
        assert list(constexprs) == self.fn.arg_names[-len(constexprs):], (list(constexprs), self.fn.arg_names)
        return lambda grid, args, key=None, site=None: self.calls.append(
            (self.name, grid, args, constexprs, dict(key=key, site=site, **options)))


@pytest.fixture
def launches(monkeypatch):
    calls = []
    for name, attr in (("hopper", "_launch_fp8"), ("hopper_small", "_launch_small"), ("hopper_bf16", "_launch_bf16")):
        monkeypatch.setattr(hopper_launch, attr, RecordingLauncher(name, calls, getattr(hopper_launch, attr).fn))
    monkeypatch.setattr(launcher, "_plans", {})   # plans made before hold the real launchers
    return calls


def launch(kv_format, q_fp8, b=2, s_q=2, h_q=64, seqlens=(300, 70), scale=0.1, num_parts=None):
    """The Hopper decoder the dispatch table picks for the call, launched (its Triton launch faked)."""
    p = make_problem(b, s_q, h_q, list(seqlens), device=DEVICE, seed=0)
    x = p.quantized(kv_format, q_fp8)
    meta, num_splits = get_mla_metadata(p.cache_seqlens, s_q * h_q, 1, num_parts=num_parts)
    rows = s_q * h_q
    call = check_decode(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta, num_splits, scale, True,
                        x["descale_q"], x["descale_k"], kv_format, None, None)
    o_part, lse_part = (torch.empty(b + meta.shape[0], rows, 512, device=DEVICE),
                        torch.empty(b + meta.shape[0], rows, device=DEVICE))
    LAUNCH[decoder_for("hopper", kv_format, rows).name](call, o_part, lse_part, None)
    return p, x, meta, call


@pytest.mark.parametrize("h_q,s_q", [(64, 2), (128, 4), (16, 1)])
def test_bf16_cache_reaches_the_bf16_kernel(launches, h_q, s_q):
    p, x, meta, call = launch("bf16", False, s_q=s_q, h_q=h_q)
    ((name, grid, args, constexprs, options),) = launches
    assert name == "hopper_bf16" and constexprs == dict(CAUSAL=True, ABLATE=0)
    assert options == dict(key=call.signature, site=None, num_warps=4)
    assert grid == (meta.shape[0], math.ceil(s_q * h_q / 64))
    q, lat, rope = args[0], args[4], args[5]
    assert q is x["q"] and (args[-2], args[-1]) == (h_q, s_q) and args[-3] == pytest.approx(0.1 * LOG2E.value)
    assert list(lat.block_shape) == [64, bf16.K_BOX.value] and lat.layout == layouts.LAT_BF16_SMEM.value
    assert list(rope.block_shape) == [64, 64] and lat.base.dtype == rope.base.dtype == torch.bfloat16
    assert lat.base.data_ptr() == x["k_cache"].data_ptr() and rope.base.data_ptr() == x["k_cache"].data_ptr() + 1024


@pytest.mark.parametrize("kv_format,q_fp8", [("fp8_rope_bf16", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("num_parts", [2, 3])   # a part a request, 1.5 parts
@pytest.mark.parametrize("capturing", [False, True])   # an eager call, one captured in a CUDA graph: the same launch
def test_fp8_caches_reach_the_fp8_kernel(launches, monkeypatch, kv_format, q_fp8, num_parts, capturing):
    monkeypatch.setattr(launcher, "capturing", lambda device: capturing)
    p, x, meta, call = launch(kv_format, q_fp8, num_parts=num_parts)
    ((name, grid, args, constexprs, options),) = launches
    assert name == "hopper" and grid == (num_parts, 2)
    assert constexprs == dict(KV_FORMAT=FORMAT_CODE[kv_format], Q_FP8=q_fp8, CAUSAL=True, ABLATE=0, GATHER=False,
                              HAS_TOPK_LENGTH=False, HAS_SINK=False)
    assert options == dict(key=call.signature, site=None, num_warps=4)
    assert args[23:26] == (64, 2, 128)   # h_q, s_q and the query rows per request
    # the sparse call's: the cache's bytes, Q_GROUP 1 (Triton specializes it away), placeholders never read
    assert args[26] is x["k_cache"] and args[27] == 1 and args[28] is args[29] is p.cache_seqlens
    lat, rope, scale = args[4:7]
    assert list(lat.block_shape) == [64, 512] and lat.base.dtype == torch.float8_e4m3fn
    if kv_format == "fp8_rope_bf16":  # RoPE bf16 and each token's scale, from the same 656-byte rows
        assert rope.base.dtype == torch.bfloat16 and list(scale.block_shape) == [64, layouts.SCALE_COLS.value]
        assert scale.base.data_ptr() == x["k_cache"].data_ptr() + 512
    else:
        assert rope.base.dtype == torch.float8_e4m3fn and scale is rope   # no scale tile: a placeholder
    q, descale_q, descale_k = args[0], args[20], args[21]
    assert args[1:4] == x["q"].stride()[:3]
    assert args[9:11] == (p.block_table.shape[1], x["k_cache"].shape[0])   # the table's pages, the cache's
    assert args[14:16] == (2, 2 + num_parts)   # the requests, the split buffers' rows
    assert descale_k is (x["descale_k"] if kv_format == "fp8" else p.cache_seqlens)   # placeholder: never read
    # q as it is: an e4m3 q with its scale, a bf16 q quantized by the kernel (no descales: a placeholder)
    assert q is x["q"] and descale_q is (x["descale_q"] if q_fp8 else p.cache_seqlens)


@pytest.mark.parametrize("kv_format,h_q,kernel,decoder_name,grid_y",
                         [("fp8_rope_bf16", 64, "hopper", "hopper_sparse", 1),
                          ("fp8_rope_bf16", 16, "hopper_small", "hopper_small_sparse", 1),
                          ("fp8_ds_mla", 16, "hopper_small", "hopper_small_sparse", 1),
                          ("fp8_ds_mla", 64, "hopper_small", "hopper_small_sparse_wide", 2),
                          ("fp8_ds_mla", 128, "hopper", "hopper_sparse", 2) if DS_MLA_64_ROWS else
                          ("fp8_ds_mla", 128, "hopper_small", "hopper_small_sparse_wide", 4)])
@pytest.mark.parametrize("topk_length,sink", [(False, False), (True, True)])
def test_sparse_call_reaches_the_gather_ring(launches, topk_length, sink, kv_format, h_q, kernel, decoder_name,
                                             grid_y):
    """A sparse call: on the fp8_rope_bf16 reading fp8.py's kernel (64 heads) or small.py's (16), on fp8_ds_mla's
    small.py's (at most 32 heads a CTA; above 64 heads fp8.py's from Triton 3.9 on), with GATHER, its requests the
    query tokens (Q_GROUP s_q of them an entry), its block table the indices, each topk long (pages of 64
    indices)."""
    from fp8mla.checks import check_sparse
    from fp8mla.inputs import make_sparse_problem
    from fp8mla.schedule import MLASchedule
    b, s_q, topk = 2, 2, 130
    sp = make_sparse_problem(b, s_q, h_q, topk, device=DEVICE, seed=0)
    cache = sp.quantized("fp8_rope_bf16")["k_cache"]
    lengths, sinks = (sp.topk_length if topk_length else None), (sp.attn_sink if sink else None)
    call = check_sparse(sp.q, cache, sp.indices, lengths, sinks, 512, MLASchedule(), None, None, False, None, None,
                        kv_format, None, None)
    meta, splits = get_mla_metadata(call.cache_seqlens, h_q, 1)
    call = call._replace(meta=meta, num_splits=splits)
    decoder = decoder_for("hopper", kv_format, h_q, gather=True)
    assert decoder.name == decoder_name
    o_part, lse_part = (torch.empty(b * s_q + meta.shape[0], h_q, 512, device=DEVICE),
                        torch.empty(b * s_q + meta.shape[0], h_q, device=DEVICE))
    LAUNCH[decoder.name](call, o_part, lse_part, None)
    ((name, grid, args, constexprs, options),) = launches
    assert name == kernel and grid == (meta.shape[0], grid_y)
    assert constexprs == dict(KV_FORMAT=FORMAT_CODE[kv_format], Q_FP8=False, CAUSAL=False, GATHER=True,
                              HAS_TOPK_LENGTH=topk_length, HAS_SINK=sink,
                              **(dict(ABLATE=0) if kernel == "hopper" else dict(ROWS=min(h_q, 32))))
    assert args[7].data_ptr() == sp.indices.data_ptr() and args[8:11] == (topk, 3, cache.shape[0])
    assert (args[14], args[23:26]) == (b * s_q, (h_q, 1, h_q))   # requests: query tokens, of h_q rows each
    assert args[26] is cache and args[27] == s_q
    assert (args[28] is sp.topk_length) == topk_length and (args[29] is sp.attn_sink) == sink
    with pytest.raises(ValueError, match="no 'hopper' kernel takes a 'fp8_ds_mla' cache"):   # the dense call
        decoder_for("hopper", "fp8_ds_mla", 64)


@pytest.mark.parametrize("s_q,h_q,rows", [(1, 16, 16), (2, 16, 32), (3, 8, 32), (1, 32, 32)])
@pytest.mark.parametrize("kv_format,q_fp8", [("fp8_rope_bf16", False), ("fp8", True)])
def test_few_query_rows_reach_the_small_rows_kernel(launches, kv_format, q_fp8, s_q, h_q, rows):
    p, x, meta, call = launch(kv_format, q_fp8, s_q=s_q, h_q=h_q)
    ((name, grid, args, constexprs, options),) = launches
    assert name == "hopper_small" and grid == (meta.shape[0], 1) and args[0] is x["q"]   # quantized in the kernel
    assert constexprs == dict(KV_FORMAT=FORMAT_CODE[kv_format], Q_FP8=q_fp8, CAUSAL=True, ROWS=rows, GATHER=False,
                              HAS_TOPK_LENGTH=False, HAS_SINK=False)
    assert args[23:26] == (h_q, s_q, s_q * h_q) and args[27] == 1   # (Q_GROUP 1: a dense call)


def test_more_query_rows_stay_on_the_64_row_kernel(launches):
    launch("fp8", True, s_q=3, h_q=16)   # 48 rows
    assert [c[0] for c in launches] == ["hopper"]


def test_wide_group_descale_calls_cut_a_part_per_row_block_of_32():
    """hopper_small_sparse_wide takes 32 of a token's rows a CTA: its lazily planned schedule has a part per SM and
    32-row block, so that a part's row blocks run in one wave (sharing its gathered rows through L2); the other
    decoders keep the default cut (None)."""
    from fp8mla.kernels import schedule_parts
    from fp8mla.runtime import sm_count
    cpu = torch.device("cpu")
    wide = decoder_for("hopper", "fp8_ds_mla", 64, gather=True)
    assert wide.name == "hopper_small_sparse_wide" and schedule_parts(wide, cpu, 64) == sm_count(cpu) // 2
    assert schedule_parts(decoder_for("hopper", "fp8_rope_bf16", 128, gather=True), cpu, 128) is None
    assert schedule_parts(decoder_for("hopper", "fp8_ds_mla", 32, gather=True), cpu, 32) is None


def test_group_descale_calls_take_the_kernel_of_their_rows():
    """fp8_ds_mla: at most 32 heads the small-rows kernel, then 32-row CTAs of it, above 64 heads fp8.py's 64-row
    kernel from Triton 3.9 on, which keeps its loops in registers."""
    above_64 = "hopper_sparse" if DS_MLA_64_ROWS else "hopper_small_sparse_wide"
    assert [decoder_for("hopper", "fp8_ds_mla", h_q, gather=True).name for h_q in (16, 32, 33, 64, 65, 128)] == \
        ["hopper_small_sparse"] * 2 + ["hopper_small_sparse_wide"] * 2 + [above_64] * 2
