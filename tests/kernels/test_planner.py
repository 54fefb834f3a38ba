"""The schedule in one launch (kernels/planner.py) against its reference, schedule.plan (torch ops): the same
metadata and num_splits, bit for bit, on random batches of every kind the cut distinguishes."""
import random

import pytest
import torch

from fp8mla import get_mla_metadata, runtime, schedule
from fp8mla.kernels.planner import launch_plan


def batch(kind: str, b: int, g: torch.Generator) -> torch.Tensor:
    if kind == "equal":
        return torch.full((b,), int(torch.randint(0, 9000, (), generator=g)), dtype=torch.int32)
    if kind == "short":          # many requests of few pages, some empty, some negative (planned as empty)
        return torch.randint(-5, 200, (b,), generator=g, dtype=torch.int32)
    return torch.randint(0, 40000, (b,), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(16))
def test_planner_matches_the_reference(seed, device, monkeypatch):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sms = rnd.choice([4, 16, 66, 132])
    monkeypatch.setattr(runtime, "sm_count", lambda device: sms)
    b = rnd.choice([1, 2, 3, 5, 8, 17, 40, 64, 100, 140])
    rows = rnd.choice([16, 32, 64, 128])
    seqlens = batch(["equal", "short", "long"][seed % 3], b, g).to(device)
    num_parts = rnd.choice([None, None, None, 1, 7, sms])
    c = schedule.cut(b, rows, seqlens.device, num_parts)
    meta, num_splits = launch_plan(seqlens, rows, num_parts)
    want_meta, want_splits = schedule.plan(seqlens, rows, num_parts)
    assert torch.equal(meta, want_meta), (c, seqlens.tolist())
    assert torch.equal(num_splits, want_splits), (c, seqlens.tolist())


def test_get_mla_metadata_plans_by_the_kernel(device, monkeypatch):
    """The public call launches the planner where kernels run (a GPU, or the interpreter)."""
    from fp8mla.kernels import planner

    launched = []
    monkeypatch.setattr(planner, "launch_plan", lambda *args: launched.append(args) or schedule.plan(args[0], 16))
    get_mla_metadata(torch.full((3,), 100, dtype=torch.int32, device=device), 16, 1)
    assert len(launched) == 1


def test_a_planned_signature_schedules_each_steps_seqlens(device):
    """get_mla_metadata plans its launch once per argument signature; later steps' seqlens (same shape, new
    values) still get their own schedule, the reference's."""
    g = torch.Generator().manual_seed(0)
    for kind in ("long", "equal", "short", "long"):
        seqlens = batch(kind, 5, g).to(device)
        meta, num_splits = get_mla_metadata(seqlens, 64, 1)
        want_meta, want_splits = schedule.plan(seqlens, 64)
        assert torch.equal(meta, want_meta) and torch.equal(num_splits, want_splits), (kind, seqlens.tolist())
