import math

import pytest
import torch

from fp8mla import runtime
from fp8mla.kernels.combine import plan_combine
from fp8mla.schedule import METADATA_WIDTH


def one_page_pieces(splits, device):
    """A schedule cutting request i into splits[i] parts of one page each, in request order."""
    rows = [[i, k, i, k + 1, k, n, n, 0] for i, n in enumerate(splits) for k in range(n)]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, METADATA_WIDTH)


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])   # bf16 format, FP8 formats
@pytest.mark.parametrize("sms", [4, 16, 132])   # column slices per program: 1-2, 2-4, 8
# several steps each (steps of 2 and 4 pieces: the o_part rows per request)
@pytest.mark.parametrize("splits", [[0, 3, 1, 11], [5]])
def test_combine_merges_by_lse(splits, sms, part_dtype, device, monkeypatch):
    monkeypatch.setattr(runtime, "sm_count", lambda device: sms)
    b, s_q, h_q = len(splits), 2, 16
    R = s_q * h_q
    num_splits = torch.tensor([0] + splits, device=device).cumsum(0).int()
    meta = one_page_pieces(splits, device)
    slots = b + meta.shape[0]   # the decode's split buffers' rows
    o_part = torch.randn(slots, R, 512, device=device).to(part_dtype)
    lse_part = torch.randn(slots, R, device=device) * 3
    lse_part[0, :5] = -math.inf          # a split in which some rows saw no key
    out = torch.full((b, s_q, h_q, 512), 7.0, dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h_q, s_q), 7.0, device=device)
    seqlens = torch.tensor([64 * max(n, 1) if n else 0 for n in splits], dtype=torch.int32, device=device)
    plan_combine(b, s_q, h_q, meta.shape[0], max(splits), device)(out, lse, o_part, lse_part, meta, num_splits,
                                                                  seqlens)
    for i, n in enumerate(splits):
        if n == 1:  # written by the decode kernel: untouched here
            assert (out[i] == 7).all() and (lse[i] == 7).all()
            continue
        parts = slice(int(num_splits[i]), int(num_splits[i + 1]))
        ref_lse = torch.logsumexp(lse_part[parts], dim=0)                # [R], -inf if n == 0
        w = torch.exp(lse_part[parts] - ref_lse).nan_to_num(0.0)
        ref_out = (w[..., None] * o_part[parts].float()).sum(0)
        ref_lse = torch.where(torch.isinf(ref_lse), math.inf, ref_lse)
        assert torch.allclose(out[i].reshape(R, 512).float(), ref_out, atol=2e-2, rtol=1e-2)
        assert torch.allclose(lse[i].transpose(0, 1).reshape(R), ref_lse, atol=1e-5)
