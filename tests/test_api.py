"""Every bad input gets a clear error before any launch."""
import warnings

import pytest
import torch

from fp8mla import (cal_diff, checks, flash_mla_with_kvcache, get_mla_metadata, hopper_available, quantize_kv_cache,
                    reference_mla_decode)
from fp8mla.inputs import make_problem
from fp8mla.schedule import END_REQ, PLANNED_ROWS


@pytest.fixture
def call(device):
    p = make_problem(2, 1, 16, [100, 70], device=device)
    meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1)
    base = dict(q=p.q, k_cache=p.kv, block_table=p.block_table, cache_seqlens=p.cache_seqlens, head_dim_v=512,
                tile_scheduler_metadata=meta, num_splits=splits)

    def run(**changes):
        return flash_mla_with_kvcache(**{**base, **changes})
    run.base = base
    run.problem = p
    return run


def test_valid_call_runs(call):
    out, lse = call()
    assert out.shape == (2, 1, 16, 512) and lse.shape == (2, 16, 1)


@pytest.mark.parametrize("change,error,match", [
    (lambda b: dict(q=b["q"].float()), TypeError, "q must be"),
    (lambda b: dict(q=b["q"][..., :512]), ValueError, "head dim must be 576"),
    (lambda b: dict(q=b["q"][0]), ValueError, "4 dimensions"),
    (lambda b: dict(q=b["q"].transpose(1, 3).contiguous().transpose(1, 3)), ValueError, "last dimension"),
    (lambda b: dict(head_dim_v=576), ValueError, "head_dim_v must be 512"),
    (lambda b: dict(k_cache=b["k_cache"].reshape(-1, 32, 1, 576)), ValueError, "page size 64"),
    (lambda b: dict(k_cache=b["k_cache"].reshape(-1, 64, 2, 288)), TypeError, "cannot infer"),
    (lambda b: dict(k_cache=b["k_cache"].half()), TypeError, "cannot infer"),
    (lambda b: dict(k_cache=b["k_cache"], kv_format="fp8"), TypeError, "needs a"),
    (lambda b: dict(k_cache=b["k_cache"][:, :, :, :].transpose(0, 1).contiguous().transpose(0, 1)),
     ValueError, "contiguous"),
    (lambda b: dict(block_table=b["block_table"].long()), TypeError, "block_table must be"),
    (lambda b: dict(block_table=b["block_table"][:1]), ValueError, "batch size"),
    (lambda b: dict(cache_seqlens=b["cache_seqlens"].long()), TypeError, "cache_seqlens must be"),
    (lambda b: dict(cache_seqlens=b["cache_seqlens"][:1].expand(2)), ValueError, "cache_seqlens must be contig"),
    (lambda b: dict(cache_seqlens=torch.stack([b["cache_seqlens"]] * 2, 1)[:, 0]), ValueError, "must be contig"),
    (lambda b: dict(num_splits=b["num_splits"][:-1]), ValueError, "num_splits must be"),
    (lambda b: dict(num_splits=torch.stack([b["num_splits"]] * 2, 1)[:, 0]), ValueError, "num_splits must be a "
                                                                                         "contiguous"),
    (lambda b: dict(tile_scheduler_metadata=b["tile_scheduler_metadata"][:, :4]), ValueError, "num_parts, 8"),
    (lambda b: dict(descale_k=torch.ones(1)), ValueError, "only for the 'fp8' format"),
    (lambda b: dict(descale_q=torch.ones(1)), ValueError, "only for a float8_e4m3fn q"),
    (lambda b: dict(out=torch.empty(2, 1, 16, 512)), ValueError, "out must be"),
    (lambda b: dict(lse=torch.empty(2, 1, 16)), ValueError, "lse must be"),
    (lambda b: dict(backend="cuda"), ValueError, "backend must be"),
    (lambda b: dict(softmax_scale=0.0), ValueError, "softmax_scale must be a positive"),
    (lambda b: dict(softmax_scale=-0.1), ValueError, "softmax_scale must be a positive"),
    (lambda b: dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a positive"),
])
def test_bad_inputs_raise_before_launch(call, change, error, match):
    # the checks remember a signature that passed (here: the valid call's, as flash_mla_with_kvcache checks it);
    # the bad call differs from it, so it is checked
    b = call.base
    checks.check_decode(b["q"], b["k_cache"], b["block_table"], b["cache_seqlens"], 512, b["tile_scheduler_metadata"],
                        b["num_splits"], None, False, None, None, None, None, None)
    with pytest.raises(error, match=match):
        call(**change(call.base))


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(block_table=b["block_table"][:, :1]), "block_table has 1 pages"),
    (lambda b: dict(block_table=b["block_table"] + 1000), "outside the cache"),
    (lambda b: dict(cache_seqlens=-b["cache_seqlens"]), ">= 0"),
    (lambda b: dict(cache_seqlens=torch.ones_like(b["cache_seqlens"])), "planned for other cache_seqlens"),
    # parts that cover no page (the kernels would leave out and lse unwritten), a schedule never written
    (lambda b: dict(tile_scheduler_metadata=torch.where(torch.arange(8, device=b["q"].device) == END_REQ, -1,
                                                        b["tile_scheduler_metadata"])), "or never written"),
    (lambda b: dict(tile_scheduler_metadata=torch.randint_like(b["tile_scheduler_metadata"], -3, 3)),
     "or never written"),
])
def test_validate_names_bad_data(call, change, match):
    """The opt-in data check names what is wrong (without it the kernels NaN-mark the requests: test_safety.py)."""
    with pytest.raises(ValueError, match=match):
        call(**change(call.base), validate=True)


@pytest.mark.parametrize("planned_s_q,s_q", [(1, 2), (2, 1)])
def test_validate_names_the_rows_a_schedule_was_planned_for(device, planned_s_q, s_q):
    """A schedule planned for another s_q (here 64 query rows a request against 128: other parts, one 64-row block
    against two) decodes right, the kernels reading its pages for all of the call's row blocks; validate=True says
    which rows it was planned for and which the call has."""
    p = make_problem(2, s_q, 64, [100, 70], device=device, seed=11)
    meta, splits = get_mla_metadata(p.cache_seqlens, planned_s_q * 64, 1)
    assert (meta[:, PLANNED_ROWS] == planned_s_q * 64).all()
    with warnings.catch_warnings(record=True) as caught:   # (not pytest.warns: it would show the interpreter's
        warnings.simplefilter("always")                    # DeprecationWarnings under Triton 3.6 again)
        out, lse = flash_mla_with_kvcache(p.q, p.kv, p.block_table, p.cache_seqlens, 512, meta, splits, causal=True,
                                          validate=True)
    planned, called = (f"{n * 64} query rows a request (s_q={n} at h_q=64)" for n in (planned_s_q, s_q))
    assert [f"planned for {planned}, and this call has {called}" in str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning)] == [True]
    ref, ref_lse = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)
    assert cal_diff(out.float(), ref)["cos_diff"] < 1e-5 and torch.allclose(lse, ref_lse, atol=1e-3)


def test_hopper_backend_where_it_cannot_run(call, device):
    if hopper_available(device):
        pytest.skip("the Hopper kernels run here")
    with pytest.raises(ValueError, match="sm_90"):
        call(backend="hopper")


def test_metadata_rejects_what_the_call_rejects(device):
    with pytest.raises(TypeError, match="cache_seqlens must be"):
        get_mla_metadata(torch.ones(2, dtype=torch.int64, device=device), 16, 1)
    with pytest.raises(ValueError, match="one KV head"):
        get_mla_metadata(torch.ones(2, dtype=torch.int32, device=device), 16, 2)
    with pytest.raises(ValueError, match=">= 1"):
        get_mla_metadata(torch.ones(2, dtype=torch.int32, device=device), 0, 1)
    with pytest.raises(ValueError, match="contiguous"):   # (an expanded one: its kernel would read past it)
        get_mla_metadata(torch.ones(1, dtype=torch.int32, device=device).expand(3), 16, 1)


def test_a_schedule_object_is_planned_once_per_batch_configuration(call, device, monkeypatch):
    """get_mla_metadata(): the first call plans it (one planner launch), calls of the same batch shape reuse it,
    a call of another shape plans it anew; num_splits must then be None."""
    from fp8mla import api

    plans = []
    real = api.get_mla_metadata
    monkeypatch.setattr(api, "get_mla_metadata", lambda *args, **kw: plans.append(args[1:]) or real(*args, **kw))
    schedule, none = get_mla_metadata()
    base = {**call.base, "tile_scheduler_metadata": schedule, "num_splits": none}
    out, _ = flash_mla_with_kvcache(**base)
    again, _ = flash_mla_with_kvcache(**base)
    assert plans == [(16, 1)] and torch.equal(out, again) and torch.equal(out, call()[0])
    p = call.problem
    q = torch.cat([p.q, p.q])   # 4 requests: another configuration
    flash_mla_with_kvcache(**{**base, "q": q, "block_table": torch.cat([p.block_table] * 2),
                              "cache_seqlens": torch.cat([p.cache_seqlens] * 2)})
    assert plans == [(16, 1), (16, 1)] and schedule.num_splits.shape == (5,)
    with pytest.raises(ValueError, match="num_splits must be None"):
        flash_mla_with_kvcache(**{**base, "num_splits": call.base["num_splits"]})


def test_fp8_cache_needs_scales(call):
    k_cache, descale_k = quantize_kv_cache(call.problem.kv, "fp8")
    with pytest.raises(ValueError, match="needs descale_k"):
        call(k_cache=k_cache)
    with pytest.raises(ValueError, match="shape \\[1\\]"):
        call(k_cache=k_cache, descale_k=descale_k.expand(2))
    q8 = call.base["q"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs descale_q"):
        call(k_cache=k_cache, descale_k=descale_k, q=q8)
    with pytest.raises(TypeError, match="'fp8' cache format"):
        call(q=q8, descale_q=torch.ones(1))


def test_cpu_tensors_need_the_interpreter(call, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        call(**{name: t.cpu() for name, t in call.base.items() if isinstance(t, torch.Tensor)})


def test_empty_batch(call, device):
    p = make_problem(0, 1, 16, [], device=device)
    meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1)
    out, lse = flash_mla_with_kvcache(p.q, p.kv, p.block_table, p.cache_seqlens, 512, meta, splits)
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 16, 1)


def test_all_requests_empty_with_a_table_of_no_columns(call, device):
    """Every request empty and block_table [b, 0]: zeros and lse +inf, no read of the table; a request that
    needs a page gets NaN, and with validate=True a clear error."""
    q = torch.randn(2, 1, 16, 576, dtype=torch.bfloat16, device=device)
    block_table = torch.zeros(2, 0, dtype=torch.int32, device=device)
    empty = torch.zeros(2, dtype=torch.int32, device=device)
    out, lse = flash_mla_with_kvcache(q, call.base["k_cache"], block_table, empty, 512,
                                      *get_mla_metadata(empty, 16, 1))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse > 0).all()
    one = torch.tensor([0, 5], dtype=torch.int32, device=device)
    out, lse = flash_mla_with_kvcache(q, call.base["k_cache"], block_table, one, 512, *get_mla_metadata(one, 16, 1))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].isnan().all() and lse[1].isnan().all()
    with pytest.raises(ValueError, match="0 pages per request but a seqlen needs 1"):
        flash_mla_with_kvcache(q, call.base["k_cache"], block_table, one, 512, *get_mla_metadata(one, 16, 1),
                               validate=True)


@pytest.mark.hopper
def test_an_sm90_gpu_on_the_portable_kernel_says_why_once(monkeypatch):
    """Where the Hopper kernels cannot run on an sm_90 GPU (here: a Triton whose Gluon lacked a builtin), the call
    still works, on the portable kernel, and a warning says why, once."""
    import warnings

    from fp8mla import cal_diff, kernels, reference_mla_decode
    from fp8mla.kernels import triton_compat

    monkeypatch.setattr(triton_compat, "hopper_missing", lambda: "triton 9.9's Gluon has no tma_load")
    for cached in (kernels.select, kernels._hopper_unavailable, kernels._warn_portable_on_hopper):
        cached.cache_clear()
    try:
        p = make_problem(2, 1, 16, [100, 70], device="cuda")
        meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1)
        with pytest.warns(RuntimeWarning, match="portable Triton kernels on an sm_90 GPU.*no tma_load"):
            out, _ = flash_mla_with_kvcache(p.q, p.kv, p.block_table, p.cache_seqlens, 512, meta, splits)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            flash_mla_with_kvcache(p.q, p.kv, p.block_table, p.cache_seqlens, 512, meta, splits)
        ref, _ = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens)
        assert cal_diff(out.float(), ref)["cos_diff"] < 1e-5
    finally:
        for cached in (kernels.select, kernels._hopper_unavailable, kernels._warn_portable_on_hopper):
            cached.cache_clear()


def test_a_signature_gets_one_number_and_another_signature_another(call):
    """check_decode's number for a call's signature (the launchers' key): equal for calls that differ in data only,
    different where a check or a kernel's specialization could differ (here: q not 16-byte aligned)."""
    b = call.base
    args = (b["k_cache"], b["block_table"], b["cache_seqlens"], 512, b["tile_scheduler_metadata"], b["num_splits"],
            None, False, None, None, None, None, None)
    first = checks.check_decode(b["q"], *args).signature
    again = checks.check_decode(b["q"].clone(), *args).signature
    padded = torch.empty(b["q"].numel() + 8, dtype=b["q"].dtype, device=b["q"].device)
    unaligned = padded[1:b["q"].numel() + 1].view(b["q"].shape)
    other = checks.check_decode(unaligned, *args).signature
    assert first is not None and first == again and other not in (None, first)
