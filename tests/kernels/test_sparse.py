"""The sparse call (DeepSeek V3.2: each query token attends to the cache rows its indices name) end to end, in the
interpreter on the CPU and compiled on a GPU, against the fp32 reference over the gathered, unquantized rows."""
import math

import pytest
import torch

from fp8mla import (KV_FORMATS, cal_diff, empty_kv_cache, flash_mla_with_kvcache, get_mla_metadata,
                    quantize_kv_cache, write_kv_cache)
from fp8mla.formats import D_LATENT, FP8_DTYPE, FP8_MAX, PAGE_SIZE
from fp8mla.inputs import GROUP_SCALES, make_sparse_problem
from fp8mla.reference import reference_sparse_mla_decode

# a few dozen keys a query token, latent groups x1, x8, x0.25, x2: FP8 errs more than at topk 2048 (per-tensor "fp8"
# most: its one scale crushes the x0.25 group), and the x8 group's scores run large (lse errs ~0.3 in FP8, 2e-2 in
# bf16); a cache read with the wrong descales errs > 0.1
COS_BOUND = {"bf16": 1e-5, "fp8": 6e-3, "fp8_rope_bf16": 4e-3, "fp8_ds_mla": 4e-3}
LSE_ATOL = {"bf16": 0.05, "fp8": 0.75, "fp8_rope_bf16": 0.75, "fp8_ds_mla": 0.75}


def make_sparse(b, s_q, h_q, topk, pages=8, seed=0, device="cpu", **kw):
    """(q, kv, indices, topk_length, attn_sink) of a small problem: contexts of ``pages`` pages, latent groups
    scaled x1, x8, x0.25, x2 (so fp8_ds_mla's four descales differ), every 7th index -1, repeats where the
    context is shorter than topk, NaN in every row no index names."""
    p = make_sparse_problem(b, s_q, h_q, topk, context=pages * PAGE_SIZE // 2, device=device, seed=seed, **kw)
    return p.q, p.kv, p.indices, p.topk_length, p.attn_sink


def e4m3_rows(q):
    """q whose latent part a bf16 q's quantization (amax / FP8_MAX a row) takes to e4m3 exactly: each row's latent
    values rounded to e4m3 in units of a power of two, its largest set to +-FP8_MAX units."""
    lat = q[..., :D_LATENT].float()
    unit = torch.exp2(torch.ceil(torch.log2(lat.abs().amax(-1, keepdim=True) / FP8_MAX)))
    vals = (lat / unit).to(FP8_DTYPE).float()
    top = vals.abs().argmax(-1, keepdim=True)
    vals.scatter_(-1, top, FP8_MAX * torch.where(vals.gather(-1, top) < 0, -1.0, 1.0))
    return torch.cat([(vals * unit).to(q.dtype), q[..., D_LATENT:]], -1)


def sparse(q, cache, indices, **kw):
    schedule, _ = get_mla_metadata()
    return flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, indices=indices, **kw)


def check(out, lse, ref, ref_lse, kv_format):
    assert not out.isnan().any() and not lse.isnan().any()
    diff = cal_diff(out.float(), ref)
    assert diff["cos_diff"] <= COS_BOUND[kv_format], diff
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all()
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=LSE_ATOL[kv_format], rtol=0)
    return diff


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("b,s_q,h_q,topk", [(2, 1, 16, 100), (1, 2, 32, 130), (2, 2, 64, 64), (1, 1, 128, 70)])
def test_matches_reference(kv_format, b, s_q, h_q, topk, device):
    q, kv, indices, topk_length, sink = make_sparse(b, s_q, h_q, topk, device=device)
    cache, descale_k = quantize_kv_cache(kv, kv_format)
    out, lse = sparse(q, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format,
                      descale_k=descale_k)
    check(out, lse, *reference_sparse_mla_decode(q, kv, indices, topk_length, sink), kv_format)


def test_without_topk_length_or_sink(device):
    q, kv, indices, _, _ = make_sparse(2, 2, 16, 96, device=device, seed=1)
    cache, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    out, lse = sparse(q, cache, indices)   # a 656-byte cache: read as fp8_ds_mla
    check(out, lse, *reference_sparse_mla_decode(q, kv, indices), "fp8_ds_mla")


# (on an sm_90 GPU the last two run on the Hopper kernels' gather rings: fp8_rope_bf16, the 64-row kernel's and the
# small-rows kernel's)
KERNEL_CASES = [("fp8_ds_mla", 16), ("fp8_ds_mla", 64), ("fp8_rope_bf16", 64), ("fp8_rope_bf16", 16)]
ON_BOTH = pytest.mark.parametrize("kv_format,h_q", KERNEL_CASES)
# and fp8_ds_mla at 128 heads (the 64-row kernel from Triton 3.9 on) for bad data
ON_BOTH_BAD = pytest.mark.parametrize("kv_format,h_q", KERNEL_CASES + [("fp8_ds_mla", 128)])


def test_schedule_replanned_for_another_shape(device):
    """One get_mla_metadata() schedule passed to calls of another topk or batch is planned anew for each (a schedule
    of the wrong topk would cover other pages)."""
    q, kv, indices, _, _ = make_sparse(2, 1, 16, 128, device=device, seed=8)
    cache, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    schedule, _ = get_mla_metadata()
    for idx, qq in ((indices, q), (indices[..., :60].contiguous(), q), (indices[:1], q[:1])):   # 2, 1, 2 pages
        out, lse = flash_mla_with_kvcache(qq, cache, None, None, 512, schedule, None, indices=idx)
        check(out, lse, *reference_sparse_mla_decode(qq, kv, idx), "fp8_ds_mla")
        assert schedule.num_splits.shape[0] == idx.shape[0] * idx.shape[1] + 1


def test_preallocated_outputs_and_e4m3_q(device):
    """out and lse given (as a CUDA graph has them) are filled in place; an e4m3 q with its descale on the "fp8"
    cache, as vLLM's dense FP8 call passes it."""
    from fp8mla import quantize_fp8_per_tensor
    q, kv, indices, topk_length, sink = make_sparse(2, 2, 16, 96, device=device, seed=9)
    cache, descale_k = quantize_kv_cache(kv, "fp8")
    q8, descale_q = quantize_fp8_per_tensor(q)
    out = torch.full((2, 2, 16, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((2, 16, 2), float("nan"), device=device)
    res = sparse(q8, cache, indices, topk_length=topk_length, attn_sink=sink, descale_q=descale_q,
                 descale_k=descale_k, out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    check(out, lse, *reference_sparse_mla_decode(q8.float() * descale_q, kv, indices, topk_length, sink), "fp8")


def count_combines(monkeypatch) -> list:
    """A list that gets an entry each time a decode launches the combine (launch plans made anew)."""
    from fp8mla.kernels import combine, launcher
    monkeypatch.setattr(launcher, "_plans", {})
    plan_combine, launched = combine.plan_combine, []

    def counted(*args, **kwargs):
        run = plan_combine(*args, **kwargs)
        return lambda *a, **k: (launched.append(1), run(*a, **k))
    monkeypatch.setattr(combine, "plan_combine", counted)
    return launched


@ON_BOTH
def test_unsplit_requests_skip_the_combine(kv_format, h_q, device, monkeypatch):
    """As many query tokens as the schedule has parts (16 SMs; 8 parts for 32-row CTAs): no token is split, so each
    writes its out and lse itself and the call launches no combine; the host's reckoning of that
    (schedule.most_splits) agrees with the schedule the device planned."""
    from fp8mla import runtime
    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 16)
    launched = count_combines(monkeypatch)
    q, kv, indices, topk_length, sink = make_sparse(8, 2, h_q, 128, seed=10, device=device)
    cache, _ = quantize_kv_cache(kv, kv_format)
    schedule, _ = get_mla_metadata()
    out = torch.full((8, 2, h_q, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((8, h_q, 2), float("nan"), device=device)
    flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, indices=indices, topk_length=topk_length,
                           attn_sink=sink, kv_format=kv_format, out=out, lse=lse)
    assert (schedule.num_splits.diff() == 1).all() and launched == []
    check(out, lse, *reference_sparse_mla_decode(q, kv, indices, topk_length, sink), kv_format)


@ON_BOTH
def test_split_requests(kv_format, h_q, device, monkeypatch):
    """Few query tokens with many indices: the schedule cuts each into pieces, which the combine merges (and its
    attention sink applies there). 16 SMs: the parts are SMs per row block of the decoder's CTAs, and at 8 the
    32-row CTAs (fp8_ds_mla at 64 heads on Hopper) got 4 parts, too few for the schedule to cut a token's 7 pages."""
    from fp8mla import runtime
    monkeypatch.setattr(runtime, "sm_count", lambda device=None: 16)
    q, kv, indices, topk_length, sink = make_sparse(1, 2, h_q, 400, seed=2, device=device)
    cache, _ = quantize_kv_cache(kv, kv_format)
    schedule, _ = get_mla_metadata()
    launched = count_combines(monkeypatch)
    out, lse = flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, indices=indices,
                                      topk_length=topk_length, attn_sink=sink, kv_format=kv_format)
    assert int(schedule.num_splits[1] - schedule.num_splits[0]) > 1 and launched == [1]   # the first token split
    check(out, lse, *reference_sparse_mla_decode(q, kv, indices, topk_length, sink), kv_format)


def test_group_descales_read_per_group(device):
    """A cache whose four descales differ is right only when read per group, and validate says so when it is not;
    fp8mla's own writer's cache reads the same either way (bit for bit in the portable kernel; on Hopper the group
    reading sums four FP8 products in fp32, which rounds other than one product's accumulation in the tensor core).
    That comparison takes a q whose latent rows are e4m3 values times a power of two with one at +-448 (e4m3_rows),
    so the group reading's second part of q (the rows' e4m3 rounding error) is 0 and both readings multiply the
    same q: with this randn q, q's two parts alone put them 1.1e-3 apart (cos_diff, emulated in torch)."""
    q, kv, indices, _, _ = make_sparse(1, 1, 16, 64, device=device, seed=3)
    ref, _ = reference_sparse_mla_decode(q, kv, indices)
    ds_mla, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    out, _ = sparse(q, ds_mla, indices, kv_format="fp8_ds_mla")
    assert cal_diff(out.float(), ref)["cos_diff"] <= COS_BOUND["fp8_ds_mla"]
    misread, _ = sparse(q, ds_mla, indices, kv_format="fp8_rope_bf16")
    assert cal_diff(misread.float(), ref)["cos_diff"] > 0.1
    with pytest.raises(ValueError, match="four descales differ"):
        sparse(q, ds_mla, indices, kv_format="fp8_rope_bf16", validate=True)
    own, _ = quantize_kv_cache(kv, "fp8_rope_bf16")
    q = e4m3_rows(q)
    a, a_lse = sparse(q, own, indices, kv_format="fp8_rope_bf16", validate=True)
    b, b_lse = sparse(q, own, indices, kv_format="fp8_ds_mla")
    if device.type == "cpu":
        assert torch.equal(a, b) and torch.equal(a_lse, b_lse)
    else:
        assert cal_diff(a.float(), b.float())["cos_diff"] < 1e-4 and torch.allclose(a_lse, b_lse, atol=2e-2)


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8_rope_bf16"])
def test_writer(kv_format, device):
    """write_kv_cache writes the rows quantize_kv_cache makes (NaN tokens aside: none here)."""
    kv = torch.randn(2, PAGE_SIZE, 1, 576, device=device)
    for i, f in enumerate(GROUP_SCALES):
        kv[..., 128 * i:128 * (i + 1)] *= f
    cache = empty_kv_cache(2, kv_format, device)
    flat = kv.view(-1, 576)
    write_kv_cache(flat[:, :512], flat[:, 512:], cache, torch.arange(128, device=device), kv_format)
    assert torch.equal(cache, quantize_kv_cache(kv, kv_format)[0])


@ON_BOTH_BAD
def test_bad_indices_mark_their_token(kv_format, h_q, device):
    """An index below -1 or past the cache, or a topk_length outside [0, topk], NaN-marks the query tokens it
    touches (and is never read); the others come back right; validate=True names the argument."""
    q, kv, indices, topk_length, _ = make_sparse(3, 2, h_q, 64, device=device, seed=4)
    cache, _ = quantize_kv_cache(kv, kv_format)
    ref, _ = reference_sparse_mla_decode(q, kv, indices, topk_length.clamp(0, 64))
    bad = indices.clone()
    bad[0, 1, 3] = -2
    bad[1, 0, 5] = cache.shape[0] * PAGE_SIZE        # one past the last row
    lengths = topk_length.clone()
    lengths[2] = 65
    out, lse = sparse(q, cache, bad, topk_length=lengths, kv_format=kv_format)
    for i, s in [(0, 1), (1, 0), (2, 0), (2, 1)]:
        assert out[i, s].isnan().all() and lse[i, :, s].isnan().all(), (i, s)
    for i, s in [(0, 0), (1, 1)]:
        assert not out[i, s].isnan().any() and not lse[i, :, s].isnan().any()
        assert cal_diff(out[i, s].float(), ref[i, s])["cos_diff"] < 1e-2   # (one token: fewer keys, noisier)
    with pytest.raises(ValueError, match="indices holds -2"):
        sparse(q, cache, bad, topk_length=topk_length, validate=True, kv_format=kv_format)
    with pytest.raises(ValueError, match="topk_length holds 65"):
        sparse(q, cache, indices, topk_length=lengths, validate=True, kv_format=kv_format)
    lengths[2] = -1
    out, lse = sparse(q, cache, indices, topk_length=lengths, kv_format=kv_format)
    assert out[2].isnan().all() and not out[:2].isnan().any()


@ON_BOTH_BAD
def test_all_skipped(kv_format, h_q, device):
    """A query token whose indices are all -1 (or whose topk_length is 0) sees nothing: out 0, lse +inf."""
    q, kv, indices, topk_length, sink = make_sparse(2, 1, h_q, 64, device=device, seed=5)
    cache, _ = quantize_kv_cache(kv, kv_format)
    indices[0] = -1
    topk_length[1] = 0
    out, lse = sparse(q, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format)
    assert (out == 0).all() and (lse == math.inf).all()


def test_argument_errors(device):
    q, kv, indices, topk_length, sink = make_sparse(2, 1, 16, 64, device=device)
    cache, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    with pytest.raises(ValueError, match="causal"):
        sparse(q, cache, indices, causal=True)
    with pytest.raises(ValueError, match="indices must be"):
        sparse(q, cache, indices[:1])
    with pytest.raises(ValueError, match="topk_length must be"):
        sparse(q, cache, indices, topk_length=topk_length[:1])
    with pytest.raises(TypeError, match="attn_sink"):
        sparse(q, cache, indices, attn_sink=sink.double())
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        sparse(q, cache, indices, is_fp8_kvcache=False)
    meta, splits = get_mla_metadata(torch.full((2,), 64, dtype=torch.int32, device=device), 16, 1)
    with pytest.raises(ValueError, match="get_mla_metadata()"):
        flash_mla_with_kvcache(q, cache, None, None, 512, meta, splits, indices=indices)
    with pytest.raises(ValueError, match="sparse call"):
        flash_mla_with_kvcache(q, cache, None, None, 512, *get_mla_metadata(), attn_sink=sink)


def test_flashmla_sparse_metadata_call(device):
    """FlashMLA's sparse metadata call (num_heads_q, is_fp8_kvcache, topk) gives the schedule the decode plans."""
    q, kv, indices, _, _ = make_sparse(1, 1, 16, 64, device=device)
    cache, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    seqlens = torch.full((1,), 512, dtype=torch.int32, device=device)
    schedule, splits = get_mla_metadata(seqlens, 16, 1, 16, True, 64)
    assert splits is None
    out, _ = flash_mla_with_kvcache(q, cache, None, None, 512, schedule, splits, is_fp8_kvcache=True,
                                    indices=indices)
    assert torch.equal(out, sparse(q, cache, indices)[0])


@pytest.mark.hopper
@pytest.mark.parametrize("b,s_q,h_q,topk", [(3, 1, 64, 2048), (2, 2, 128, 130), (5, 2, 64, 700), (3, 1, 16, 2048),
                                            (5, 2, 32, 700), (2, 2, 16, 130)])
@pytest.mark.parametrize("kv_format", ["fp8_rope_bf16", "fp8_ds_mla"])
def test_hopper_gather_ring(b, s_q, h_q, topk, kv_format):
    """The Hopper kernels on the gather ring (64 rows; at most 32: the small-rows kernel's load warps gather;
    fp8_ds_mla up to 64 heads: the small-rows kernel, 32 rows a CTA), both readings, against the reference, their
    schedule as planned (few parts a query token at b=2, a part each at b=5)."""
    device = torch.device("cuda")
    q, kv, indices, topk_length, sink = make_sparse(b, s_q, h_q, topk, pages=80, device=device)
    cache, _ = quantize_kv_cache(kv, kv_format)
    out, lse = sparse(q, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format,
                      backend="hopper")
    check(out, lse, *reference_sparse_mla_decode(q, kv, indices, topk_length, sink), kv_format)


@pytest.mark.hopper
@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_hopper_zero_group_descale(h_q):
    """A vLLM cache may hold a latent group whose descale is 0 (an all-zero group: 2^ceil(log2(0 / 448)) = 0): that
    group adds nothing and the token's other groups count as they are. The 64-row kernel, which rescales its one
    score accumulator from each group's descales to the next's, takes such a descale as 2^-32 of the token's
    largest instead of dividing by 0."""
    device = torch.device("cuda")
    q, kv, indices, topk_length, sink = make_sparse(2, 1, h_q, 700, pages=80, device=device, seed=7)
    rows = kv.shape[0] * kv.shape[1]
    zeroed = torch.arange(rows, device=device) % 3 == 0   # every third row: group 1 (and for every sixth, 3) zero
    flat = kv.view(rows, -1)
    flat[zeroed, 128:256] = 0
    flat[zeroed & (torch.arange(rows, device=device) % 2 == 0), 384:512] = 0
    cache, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    scales = cache.view(rows, -1).view(torch.float32)[:, 128:132]   # the row's four descales (bytes 512-527)
    scales[flat[:, 128:256].abs().amax(-1) == 0, 1] = 0.0
    scales[flat[:, 384:512].abs().amax(-1) == 0, 3] = 0.0
    out, lse = sparse(q, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format="fp8_ds_mla",
                      backend="hopper")
    check(out, lse, *reference_sparse_mla_decode(q, kv, indices, topk_length, sink), "fp8_ds_mla")


@pytest.mark.hopper
@pytest.mark.parametrize("h_q", [16, 32, 64, 128])
def test_hopper_q_in_two_parts(h_q):
    """The fp8_ds_mla reading (the small-rows kernel at 16 and 32 rows, 32-row CTAs of it at 64, the 64-row kernel
    at 128 from Triton 3.9 on) takes a bf16 q as two e4m3 parts (hi + lo): its error is well below that of the
    same q rounded to e4m3 per row first (where lo is 0), which is what one e4m3 part would give."""
    kv_format = "fp8_ds_mla"
    device = torch.device("cuda")
    q, kv, indices, topk_length, sink = make_sparse(2, 1, h_q, 2048, pages=80, device=device, seed=6)
    cache, _ = quantize_kv_cache(kv, kv_format)
    ref, _ = reference_sparse_mla_decode(q, kv, indices, topk_length, sink)
    lat = q[..., :512].float()
    descale = lat.abs().amax(-1, keepdim=True) / 448
    q_e4m3 = torch.cat([((lat / descale).to(torch.float8_e4m3fn).float() * descale).bfloat16(), q[..., 512:]], -1)
    two, _ = sparse(q, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format,
                    backend="hopper")
    one, _ = sparse(q_e4m3, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format,
                    backend="hopper")
    err_two, err_one = cal_diff(two.float(), ref)["cos_diff"], cal_diff(one.float(), ref)["cos_diff"]
    assert err_two < 0.8 * err_one, (err_two, err_one)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8_rope_bf16"])
def test_graph_replay_reads_new_indices(kv_format):
    """A captured sparse step replays with the indices, topk_length and sink of the step, not the capture's."""
    device = torch.device("cuda")
    q, kv, indices, topk_length, sink = make_sparse(4, 2, 64, 256, device=device, pages=16)
    cache, _ = quantize_kv_cache(kv.nan_to_num(0.0), kv_format)
    schedule, _ = get_mla_metadata()
    args = dict(indices=indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format)
    flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, **args)   # plans the schedule before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, **args)
    for seed in (1, 2):
        new = make_sparse(4, 2, 64, 256, device=device, pages=16, seed=seed)
        q.copy_(new[0]), indices.copy_(new[2]), topk_length.copy_(new[3]), sink.copy_(new[4])
        graph.replay()
        ref, ref_lse = sparse(q, cache, indices, topk_length=topk_length, attn_sink=sink, kv_format=kv_format)
        assert torch.equal(g_out, ref) and torch.equal(g_lse, ref_lse)


def test_dense_validate_reads_the_descales_of_the_requests_tokens(device):
    """validate=True on a dense call reading fp8_rope_bf16: rows past a request's seqlen (NaN here) are not looked at;
    a request's token whose four descales differ is named."""
    from fp8mla.inputs import make_problem
    p = make_problem(2, 1, 16, [100, 70], device=device, seed=0)
    cache, _ = quantize_kv_cache(p.kv, "fp8_rope_bf16")
    meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1)
    flash_mla_with_kvcache(p.q, cache, p.block_table, p.cache_seqlens, 512, meta, splits, validate=True)
    row = int(p.block_table[1, 1]) * PAGE_SIZE + 3   # request 1's token 67
    cache.view(-1, 656)[row, 516:520] = torch.tensor([2.0]).view(torch.uint8).to(device)
    with pytest.raises(ValueError, match="four descales differ"):
        flash_mla_with_kvcache(p.q, cache, p.block_table, p.cache_seqlens, 512, meta, splits, validate=True)


def test_topk_seqlens_outlive_many_shapes(device):
    """The tensor of topk each that a sparse shape's schedule and kernels read (made by its first call) is the same
    after calls of 100 other shapes, as an engine makes capturing a CUDA graph a batch size: a graph does not keep
    alive what it reads."""
    from fp8mla import checks
    q, kv, indices, _, _ = make_sparse(1, 1, 16, 64, device=device, seed=5)
    cache, _ = quantize_kv_cache(kv.nan_to_num(0.0), "fp8_rope_bf16")
    schedule, _ = get_mla_metadata()

    def seqlens(b):
        args = (q.repeat(b, 1, 1, 1), cache, indices.repeat(b, 1, 1), None, None, 512, schedule, None, None,
                False, None, None, "fp8_rope_bf16", None, None)
        return checks.check_sparse(*args).cache_seqlens

    first = seqlens(1)
    for b in range(2, 102):
        assert seqlens(b).tolist() == [64] * b
    assert seqlens(1) is first


@pytest.mark.gpu
def test_graph_replays_right_after_other_shapes():
    """A captured sparse step replays right after eager calls of 100 other batch sizes have come and gone (the
    memory they freed filled with other values), as an engine that captures one graph a batch size runs them."""
    device = torch.device("cuda")
    q, kv, indices, topk_length, sink = make_sparse(3, 1, 64, 128, device=device, pages=8, seed=9)
    cache, _ = quantize_kv_cache(kv.nan_to_num(0.0), "fp8_rope_bf16")
    args = dict(topk_length=topk_length, attn_sink=sink, kv_format="fp8_rope_bf16")
    schedule, _ = get_mla_metadata()
    flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, indices=indices, **args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = flash_mla_with_kvcache(q, cache, None, None, 512, schedule, None, indices=indices, **args)
    for b in range(4, 104):   # (each shape's first call is eager, as the capture requires)
        sparse(q[:1].repeat(b, 1, 1, 1), cache, indices[:1].repeat(b, 1, 1), kv_format="fp8_rope_bf16")
    junk = [torch.full((n,), -7, dtype=torch.int32, device=device) for n in range(1, 400)]
    graph.replay()
    ref, ref_lse = sparse(q, cache, indices, **args)
    del junk
    assert torch.equal(g_out, ref) and torch.equal(g_lse, ref_lse)


@pytest.mark.gpu
def test_first_call_of_a_shape_is_not_captured():
    """A sparse shape's first call makes its tensor of topk each; captured, that fill would only happen at replays,
    so the call says to make an eager one first."""
    device = torch.device("cuda")
    q, kv, indices, _, _ = make_sparse(3, 1, 64, 192, device=device, pages=8, seed=7)
    cache, _ = quantize_kv_cache(kv.nan_to_num(0.0), "fp8_rope_bf16")
    with pytest.raises(ValueError, match="make one eager call of this shape first"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            sparse(q, cache, indices, kv_format="fp8_rope_bf16")
