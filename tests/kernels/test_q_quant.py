import pytest
import torch

from fp8mla.kernels.q_quant import quantize_q


@pytest.mark.parametrize("rope_fp8", [False, True])
def test_quantize_q_packs_rows_to_e4m3_with_a_scale_per_row(device, rope_fp8):
    """Each query row -> e4m3 times its descale amax / 448 (1 for a zero row): the latent part, then the RoPE part
    e4m3 under the same scale (rope_fp8: amax over the whole row) or copied bf16 into the row's last 128 bytes;
    rows in (request, s, head) order, from a q that is a strided view (as a caller's q can be)."""
    b, s_q, h_q = 3, 2, 5
    base = torch.randn(b, s_q, h_q + 2, 640, device=device) * torch.logspace(-3, 2, h_q + 2, device=device)[:, None]
    base[0, 1, :, 512:] *= 1000                           # RoPE parts far above their latent parts
    q = base.to(torch.bfloat16)[:, :, 1:h_q + 1, :576]
    q[1, 0, 2, :512] = 0                                  # a zero latent row: descale 1 (unless its RoPE sets it)
    packed, descale = quantize_q(q, rope_fp8)
    assert packed.shape == (b, s_q, h_q, 576 if rope_fp8 else 640) and packed.dtype == torch.float8_e4m3fn
    rows = q.float().reshape(b * s_q * h_q, 576)
    amax = rows[:, :576 if rope_fp8 else 512].abs().amax(dim=1)
    want_descale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert torch.equal(descale, want_descale)
    if rope_fp8:
        want = (rows * (1.0 / want_descale)[:, None]).to(torch.float8_e4m3fn).view(b, s_q, h_q, 576)
        assert torch.equal(packed.view(torch.uint8), want.view(torch.uint8))
    else:
        want = (rows[:, :512] * (1.0 / want_descale)[:, None]).to(torch.float8_e4m3fn).view(b, s_q, h_q, 512)
        assert torch.equal(packed[..., :512].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(packed[..., 512:].contiguous().view(torch.bfloat16), q[..., 512:])
    width = 576 if rope_fp8 else 512
    assert (packed[..., :width].float().abs().amax(dim=-1).flatten()[amax > 0] == 448).all()   # e4m3's top used
