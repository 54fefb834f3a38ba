import pytest
import torch

from fp8mla import get_mla_metadata, runtime, schedule
from fp8mla.schedule import (BEGIN_PAGE, BEGIN_REQ, BEGIN_SPLIT, COMBINE_ROWS_PER_PAGE, END_PAGE, END_REQ, FIXED_COST,
                             num_sm_parts)


def expand(meta, num_splits, seqlens):
    """Every (request, page) the schedule visits, with the split slot each one's partial result goes to."""
    visits = []
    pages = [(int(n) + 63) // 64 for n in seqlens]
    for p, row in enumerate(meta.tolist()):
        for req in range(row[BEGIN_REQ], row[END_REQ] + 1):
            lo = row[BEGIN_PAGE] if req == row[BEGIN_REQ] else 0
            hi = row[END_PAGE] if req == row[END_REQ] else pages[req]
            split = int(num_splits[req]) + (row[BEGIN_SPLIT] if req == row[BEGIN_REQ] else 0)
            visits += [(p, req, page, split) for page in range(lo, hi)]
    return visits, pages


def check_cover(meta, num_splits, seqlens, parts):
    """Every page of every request visited once; request i's partial results fill slots num_splits[i] ..
    num_splits[i + 1] - 1, one per part."""
    b = len(seqlens)
    assert meta.shape == (parts, 8) and meta.dtype == torch.int32
    assert num_splits.shape == (b + 1,) and num_splits.dtype == torch.int32
    visits, pages = expand(meta, num_splits, seqlens)
    covered = sorted((req, page) for _, req, page, _ in visits)
    assert covered == [(i, k) for i in range(b) for k in range(pages[i])]
    for i in range(b):
        slots = {(p, s) for p, req, _, s in visits if req == i}
        assert sorted(s for _, s in slots) == list(range(int(num_splits[i]), int(num_splits[i + 1])))
        assert len({p for p, _ in slots}) == int(num_splits[i + 1] - num_splits[i])
    assert int(num_splits[-1]) <= b + parts
    return visits, pages


@pytest.mark.parametrize("seed", range(12))
def test_default_cut_covers_every_page(seed, monkeypatch):
    """The default cut (aligned pieces, pieces fitted to the combine's steps) on random batches and SM counts,
    equal lengths half of the time."""
    g = torch.Generator().manual_seed(seed)
    sms = int(torch.randint(4, 140, (1,), generator=g))
    monkeypatch.setattr(runtime, "sm_count", lambda device: sms)
    b = int(torch.randint(1, 12, (1,), generator=g))
    seqlens = torch.randint(0, 40000, (b,), generator=g, dtype=torch.int32)
    if seed % 2:
        seqlens[:] = seqlens[0]
    rows = int([16, 32, 64, 128, 256][seed % 5])
    meta, num_splits = get_mla_metadata(seqlens, rows, 1)
    check_cover(meta, num_splits, seqlens, num_sm_parts(torch.device("cpu"), rows))


@pytest.mark.parametrize("seed", range(8))
def test_most_splits_is_the_planned_schedules(seed, monkeypatch):
    """most_splits (the host's reckoning of a batch of equal requests, which decides whether a sparse call launches
    the combine) gives what the planned schedule of such a batch splits, with the default parts and with given
    ones, on random SM counts."""
    g = torch.Generator().manual_seed(100 + seed)
    sms = int(torch.randint(4, 140, (1,), generator=g))
    monkeypatch.setattr(runtime, "sm_count", lambda device: sms)
    b = int(torch.randint(1, 160, (1,), generator=g))
    rows, seqlen = int([16, 32, 64, 128][seed % 4]), int(torch.randint(1, 9000, (1,), generator=g))
    for num_parts in (None, max(1, sms // 3)):
        _, num_splits = get_mla_metadata(torch.full((b,), seqlen, dtype=torch.int32), rows, 1, num_parts=num_parts)
        expected = int(num_splits.diff().max())
        assert schedule.most_splits(b, rows, seqlen, torch.device("cpu"), num_parts) == expected


@pytest.mark.parametrize("seed", range(12))
def test_every_page_exactly_once_and_balanced(seed):
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 40, (1,), generator=g))
    seqlens = torch.randint(0, 3000, (b,), generator=g, dtype=torch.int32)
    seqlens[torch.rand(b, generator=g) < 0.2] = 0
    parts = int(torch.randint(1, 140, (1,), generator=g))
    meta, num_splits = get_mla_metadata(seqlens, 64, 1, num_parts=parts)
    visits, pages = check_cover(meta, num_splits, seqlens, parts)
    # balance: the cost of each part (pages + per-split overhead) within one page + overhead of the mean
    cost = [0] * parts
    for p, req, page, s in visits:
        cost[p] += 1
    for p in {p for p, *_ in visits}:
        cost[p] += FIXED_COST * len({req for q, req, *_ in visits if q == p})
    total = sum(pages) + FIXED_COST * sum(1 for n in pages if n)
    if total >= parts:  # equal pieces, or one request per part when that is no slower than them plus the combine
        assert max(cost) <= total / parts + max(2 * FIXED_COST, -(-64 // COMBINE_ROWS_PER_PAGE)) + 1


def test_fewer_pages_than_parts_leaves_empty_parts_last():
    seqlens = torch.tensor([64, 1, 0], dtype=torch.int32)
    meta, num_splits = get_mla_metadata(seqlens, 16, 1, num_parts=10)
    visits, _ = expand(meta, num_splits, seqlens)
    assert sorted((r, k) for _, r, k, _ in visits) == [(0, 0), (1, 0)]
    assert num_splits.tolist() == [0, 1, 2, 2]


def test_all_empty_batch():
    meta, num_splits = get_mla_metadata(torch.zeros(5, dtype=torch.int32), 128, 1, num_parts=7)
    assert expand(meta, num_splits, [0] * 5)[0] == []
    assert num_splits.tolist() == [0] * 6


def test_long_request_is_split_over_all_parts():
    meta, num_splits = get_mla_metadata(torch.tensor([65536], dtype=torch.int32), 128, 1, num_parts=66)
    assert num_splits.tolist() == [0, 66]


def test_equal_requests_get_a_part_each_and_no_combine():
    """64 requests of 8192 tokens on 66 parts (the headline config): equal pieces would split every request,
    one part each costs 130 page-times instead of 126 but no partial results; 128 rows make the combine dearer."""
    seqlens = torch.full((64,), 8192, dtype=torch.int32)
    meta, num_splits = get_mla_metadata(seqlens, 128, 1, num_parts=66)
    assert num_splits.tolist() == list(range(65))
    assert meta[:64, BEGIN_REQ].tolist() == list(range(64)) and meta[:64, END_PAGE].tolist() == [128] * 64
    assert meta[64:, END_REQ].tolist() == [-1, -1]
    # with 16 rows the combine is cheap: equal pieces (every request split in two) stay
    meta, num_splits = get_mla_metadata(torch.full((128,), 8192, dtype=torch.int32), 16, 1, num_parts=132)
    assert (num_splits[1:] - num_splits[:-1]).tolist() == [2] * 128


def test_equal_requests_are_cut_into_aligned_pieces(monkeypatch):
    """By default (132 SMs), a batch of equal lengths uses b * (parts // b) parts, so each request is cut into the
    same number of pieces and no part holds two requests' ends; other batches and an explicit num_parts do not."""
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    full = lambda b, n: torch.full((b,), n, dtype=torch.int32)
    meta, num_splits = get_mla_metadata(full(128, 8192), 16, 1)   # 132 parts: 128 used, one request each
    assert meta.shape == (132, 8) and num_splits.tolist() == list(range(129))
    assert meta[:128, BEGIN_REQ].tolist() == meta[:128, END_REQ].tolist() == list(range(128))
    assert meta[128:, END_REQ].tolist() == [-1] * 4
    for b, n in [(64, 8192), (8, 5000)]:   # two pieces a request on 128 parts; 16 pieces a request on 128
        meta, num_splits = get_mla_metadata(full(b, n), 32, 1)
        visits, pages = expand(meta, num_splits, full(b, n))
        assert sorted((r, k) for _, r, k, _ in visits) == [(i, k) for i in range(b) for k in range(pages[0])]
        assert (num_splits[1:] - num_splits[:-1]).tolist() == [128 // b] * b
        assert (meta[:128, BEGIN_REQ] == meta[:128, END_REQ]).all() and (meta[128:, END_REQ] == -1).all()
    uneven = full(128, 8192)
    uneven[5] = 8000
    meta, _ = get_mla_metadata(uneven, 16, 1)
    assert int((meta[:, END_REQ] >= 0).sum()) == 132
    meta, _ = get_mla_metadata(full(100, 8192), 16, 1)   # 100 parts would leave 24% of the SMs idle
    assert int((meta[:, END_REQ] >= 0).sum()) == 132
    meta, _ = get_mla_metadata(full(128, 8192), 16, 1, num_parts=132)
    assert int((meta[:, END_REQ] >= 0).sum()) == 132


def test_uneven_requests_still_split():
    seqlens = torch.tensor([100, 9000, 300, 5000, 64, 64, 128, 20000], dtype=torch.int32)
    meta, num_splits = get_mla_metadata(seqlens, 128, 1, num_parts=66)
    assert int(num_splits[-1]) > len(seqlens)


def test_num_parts_follow_row_blocks():
    assert num_sm_parts(torch.device("cpu"), 128) * 2 <= num_sm_parts(torch.device("cpu"), 16) * 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="one KV head"):
        get_mla_metadata(torch.ones(2, dtype=torch.int32), 64, 2)
    with pytest.raises(TypeError, match="int32"):
        get_mla_metadata(torch.ones(2), 64, 1)
    with pytest.raises(ValueError, match="1-D"):
        get_mla_metadata(torch.ones(2, 2, dtype=torch.int32), 64, 1)


def test_equal_requests_fit_the_combine_steps(monkeypatch):
    """A lone long request cut into one piece per part (65 splits) costs the combine a third step of 32 pieces
    for one piece; the default cut makes 64 (measured on the H200: 18.6 -> 16.4 us, BENCHMARKS.md), and one page a
    piece (128 of them, four steps) becomes two pages (64, two steps). Short requests keep a piece per page."""
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    for b, rows, n, per_request in [(1, 128, 8192, 64), (1, 16, 8192, 64), (1, 16, 32768, 96), (2, 128, 8192, 32),
                                    (4, 16, 8192, 32), (1, 128, 2048, 32), (8, 16, 8192, 16)]:
        seqlens = torch.full((b,), n, dtype=torch.int32)
        meta, num_splits = get_mla_metadata(seqlens, rows, 1)
        assert (num_splits[1:] - num_splits[:-1]).tolist() == [per_request] * b, (b, rows, n)
        visits, pages = expand(meta, num_splits, seqlens)
        assert sorted((r, k) for _, r, k, _ in visits) == [(i, k) for i in range(b) for k in range(pages[0])]


@pytest.mark.parametrize("seed", range(6))
def test_few_uneven_requests_fit_the_combine_steps(seed):
    """_pieces_for_steps against a plain count: for every number of pieces, each request's pieces (equal pieces
    k * total // n of the timeline of pages and per-request overheads) and the model's cost (longest piece plus two
    page-times a combine step of the request cut into the most); the chosen number is the cheapest, the largest of
    equals."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(2, 6, (1,), generator=g))
    pages = torch.randint(0, 600, (b,), generator=g)
    pages[0] = max(int(pages[0]), 1)
    parts, step = int(torch.randint(8, 140, (1,), generator=g)), [16, 32, 64][seed % 3]
    cost = [int(p) + FIXED_COST * (int(p) > 0) for p in pages]
    total = sum(cost)
    best = None
    for n in range(min(parts, total), 0, -1):
        bounds = [k * total // n for k in range(n + 1)]
        start = 0
        most = 0
        for p, c in zip(pages.tolist(), cost):
            if p:
                most = max(most, sum(1 for k in range(n) if bounds[k] < start + p and bounds[k + 1] > start))
            start += c
        t = -(-total // n) + schedule.COMBINE_STEP_PAGES * (-(-most // step) if most > 1 else 0)
        if best is None or t < best[0]:
            best = (t, n)
    assert int(schedule._pieces_for_steps(pages, parts, step)) == best[1]


def test_few_uneven_requests_take_fewer_combine_steps(monkeypatch):
    """Two requests of 8192 and 1024 tokens, 16 query rows, 132 SMs: one piece per part gave the long one 115
    pieces (four steps of 32 in the combine); now 64 (two), over 72 parts: the longest piece three pages instead of
    two, one page-time for two combine steps."""
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    seqlens = torch.tensor([8192, 1024], dtype=torch.int32)
    meta, num_splits = get_mla_metadata(seqlens, 16, 1)
    check_cover(meta, num_splits, seqlens, 132)
    assert (num_splits[1:] - num_splits[:-1]).tolist() == [64, 8]
