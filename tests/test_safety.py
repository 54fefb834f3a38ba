"""Bad data on the hot path (validate off, as engines call): nothing is read or written outside its tensor, and the
requests the bad data touches come back NaN in out and lse, the others as the reference has them, so no wrong answer
passes silently. (validate=True names the bad argument instead: test_api.py.) On the CPU the portable kernels run in
the interpreter, where an out-of-bounds read is a crash; on a GPU both backends run, all three formats."""
import pytest
import torch

from fp8mla import (KV_FORMATS, cal_diff, empty_kv_cache, flash_mla_with_kvcache, get_mla_metadata, hopper_available,
                    reference_mla_decode, write_kv_cache)
from fp8mla.inputs import make_problem
from fp8mla.kernels import HOPPER_FORMATS
from fp8mla.schedule import BEGIN_PAGE, BEGIN_REQ, BEGIN_SPLIT, END_REQ


def backends(device, kv_format=None):
    hopper = device.type == "cuda" and hopper_available(device) and kv_format in (None, *HOPPER_FORMATS)
    return ["portable"] + (["hopper"] if hopper else [])


def decode(p, kv_format, backend, seqlens=None, schedule=None, block_table=None):
    """The call with the problem's inputs, any of them replaced; its schedule planned for ``schedule`` (seqlens)
    if given, else for the call's seqlens."""
    x = p.quantized(kv_format)
    seqlens = p.cache_seqlens if seqlens is None else seqlens
    meta, splits = get_mla_metadata(seqlens if schedule is None else schedule, p.shape[1] * p.shape[2], 1)
    return flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table if block_table is None else block_table,
                                  seqlens, 512, meta, splits, causal=True, descale_k=x["descale_k"],
                                  kv_format=kv_format, backend=backend)


def check(p, out, lse, bad, seqlens=None, nan_required=True, ref=None):
    """Requests in ``bad`` all NaN (if ``nan_required``; else NaN or right), the others as the reference (``ref``
    if given) has them."""
    ref = ref if ref is not None else reference_mla_decode(
        p.q, p.kv, p.block_table, p.cache_seqlens if seqlens is None else seqlens.clamp(min=0), causal=True)[0]
    marked = []
    for i in range(p.shape[0]):
        nan = out[i].isnan().all() and lse[i].isnan().all()
        if i in bad and nan_required:
            assert nan, f"request {i}: not NaN"
        if nan:
            marked.append(i)
            continue
        assert not out[i].isnan().any() and not lse[i].isnan().any(), f"request {i}: partly NaN"
        assert cal_diff(out[i].float(), ref[i])["cos_diff"] < 3e-3, f"request {i}: wrong and not marked"
    return marked


@pytest.fixture(params=KV_FORMATS)
def kv_format(request):
    return request.param


@pytest.mark.parametrize("h_q", [16, 64])
def test_page_outside_the_cache(device, kv_format, h_q):
    p = make_problem(3, 1, h_q, [200, 130, 64], device=device, seed=1)
    for backend in backends(device, kv_format):
        table = p.block_table.clone()
        table[1, 1] = 10 ** 6        # far past the cache
        table[2, 0] = -5
        out, lse = decode(p, kv_format, backend, block_table=table)
        assert check(p, out, lse, {1, 2}) == [1, 2]


def test_seqlen_beyond_the_block_table(device, kv_format):
    """A seqlen whose pages the block table does not have: the kernels read the table's pages only."""
    p = make_problem(3, 1, 16, [200, 130, 64], device=device, seed=2)
    seqlens = p.cache_seqlens.clone()
    seqlens[0] = p.block_table.shape[1] * 64 + 10
    for backend in backends(device, kv_format):
        out, lse = decode(p, kv_format, backend, seqlens=seqlens)
        assert check(p, out, lse, {0}) == [0]


def test_negative_seqlen(device, kv_format):
    p = make_problem(3, 1, 16, [200, 130, 64], device=device, seed=3)
    seqlens = p.cache_seqlens.clone()
    seqlens[1] = -3
    for backend in backends(device, kv_format):
        out, lse = decode(p, kv_format, backend, seqlens=seqlens)
        assert check(p, out, lse, {1}, seqlens) == [1]


@pytest.mark.parametrize("planned,called,bad", [
    ([1000], [2000], {0}),               # one request, cut into pieces planned for half its pages
    ([0, 500], [300, 500], {0}),         # planned with no keys: no splits for it
    ([300, 500], [0, 500], {0}),         # planned with keys, now none
])
def test_stale_schedule(device, kv_format, planned, called, bad):
    p = make_problem(len(called), 1, 16, called, device=device, seed=4)
    schedule = torch.tensor(planned, dtype=torch.int32, device=device)
    for backend in backends(device, kv_format):
        out, lse = decode(p, kv_format, backend, schedule=schedule)
        assert check(p, out, lse, bad) == sorted(bad)


def test_stale_schedule_of_a_longer_batch_is_never_silently_wrong(device, kv_format):
    """A schedule of the step before (each request 64 tokens shorter): every request comes back right or NaN."""
    called = [700, 64, 129, 1000, 300, 65]
    p = make_problem(len(called), 1, 16, called, device=device, seed=5)
    schedule = (p.cache_seqlens - 64).clamp(min=0)
    for backend in backends(device, kv_format):
        out, lse = decode(p, kv_format, backend, schedule=schedule)
        marked = check(p, out, lse, set(range(len(called))), nan_required=False)
        assert marked, "some request changed its page count: the schedule cannot fit every one"


def _empty_part(meta, splits, k):
    meta[k] = torch.tensor([len(splits) - 1, 0, -1, 0, 0, 0, 0, 0])


def _shared_slot(meta, splits, k):
    meta[k, BEGIN_SPLIT] += 1   # two parts of its first request on one slot, one slot never written


def _page_twice(meta, splits, k):
    meta[k, BEGIN_PAGE] -= 1


def _slots_overlap(meta, splits, k):
    splits[2] = splits[3] + 1   # request 1's range reversed, request 2's overlapping request 0's


def _splits_wrap(meta, splits, k):
    splits[1:3] = torch.tensor([10, -2 ** 31 + 1])   # request 1's num_splits[2] - num_splits[1] wraps around to > 0


def _garbage(meta, splits, k):
    g = torch.Generator().manual_seed(k)
    meta.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, meta.shape, generator=g, dtype=torch.int64))
    splits.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, splits.shape, generator=g, dtype=torch.int64))


def _huge(meta, splits, k):
    meta.fill_(10 ** 9 * (-1) ** k)
    splits.fill_(10 ** 9 * (-1) ** k)


def _zeros(meta, splits, k):
    meta.zero_()
    splits.zero_()


# (how the schedule is damaged, the parts k it is tried on, which requests must come back NaN: those of part k, all)
DAMAGED = {"a part left out": (_empty_part, "part"), "two parts on one slot": (_shared_slot, "first"),
           "a page twice": (_page_twice, "first"), "split ranges overlap": (_slots_overlap, "all"),
           "split count wraps around": (_splits_wrap, "all"),
           "garbage": (_garbage, "all"), "huge indices": (_huge, "all"), "zeros": (_zeros, "all")}


@pytest.mark.parametrize("damage", DAMAGED)
def test_schedule_not_from_get_mla_metadata(device, kv_format, damage):
    """A schedule get_mla_metadata did not write (never written, overwritten, from elsewhere): the kernels read and
    write nothing outside their tensors, and every request the schedule does not cover as planned comes back NaN,
    the others right."""
    p = make_problem(4, 1, 16, [700, 64, 1000, 300], device=device, seed=6)
    meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1, num_parts=8)
    x = p.quantized(kv_format)
    ref = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)[0]
    fn, which = DAMAGED[damage]
    if which == "first":   # parts that start inside a request: the damage touches that request
        tried = [k for k, row in enumerate(meta.tolist()) if row[BEGIN_REQ] <= row[END_REQ] and row[BEGIN_PAGE] > 0]
    else:
        tried = range(meta.shape[0])
    for backend in backends(device, kv_format):
        for k in tried[:2]:
            row = meta[k].tolist()
            bad_meta, bad_splits = meta.clone(), splits.clone()
            fn(bad_meta, bad_splits, k)
            bad = {"part": set(range(row[BEGIN_REQ], row[END_REQ] + 1)), "first": {row[BEGIN_REQ]},
                   "all": set(range(4))}[which]
            out, lse = flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, bad_meta,
                                              bad_splits, causal=True, descale_k=x["descale_k"], kv_format=kv_format,
                                              backend=backend)
            assert set(check(p, out, lse, bad, ref=ref)) >= bad, (backend, k)


def test_schedule_checked_beyond_the_combines_first_step(device):
    """More parts than the combine checks at a time (combine.CHECK_STEP): a planned schedule decodes right, and one
    with a part of the second step left out gives that part's request NaN."""
    p = make_problem(2, 1, 16, [64 * 200, 64 * 130], device=device, seed=7)
    meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1, num_parts=300)
    x = p.quantized("fp8_rope_bf16")
    ref = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=True)[0]
    k = 280
    assert meta[k, BEGIN_REQ] == meta[k, END_REQ] == 1   # (a part of the second request)
    bad_meta = meta.clone()
    _empty_part(bad_meta, splits, k)
    for backend in backends(device):
        for schedule, bad in ((meta, set()), (bad_meta, {1})):
            out, lse = flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, schedule,
                                              splits, causal=True, kv_format="fp8_rope_bf16", backend=backend)
            assert check(p, out, lse, bad, ref=ref) == sorted(bad), backend


def test_cache_writer_skips_slots_outside_the_cache(device, kv_format):
    cache = empty_kv_cache(2, kv_format, device=device)
    cache.view(torch.uint8).fill_(7)
    before = cache.clone()
    kv_c, k_pe = torch.randn(4, 512, device=device), torch.randn(4, 64, device=device)
    slots = torch.tensor([5, 128, 10 ** 9, -1], device=device)   # one inside, one just past the end, far, padding
    descale_k = torch.ones(1, device=device) if kv_format == "fp8" else None
    write_kv_cache(kv_c, k_pe, cache, slots, kv_format, descale_k)
    changed = (cache.view(torch.uint8) != before.view(torch.uint8)).reshape(128, -1).any(dim=1)
    assert changed.nonzero().flatten().tolist() == [5]
