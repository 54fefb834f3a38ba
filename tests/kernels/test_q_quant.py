import torch

from fp8mla.kernels.q_quant import quantize_q


def test_quantize_q_packs_e4m3_latent_per_row_and_bf16_rope(device):
    """Each query row's latent part -> e4m3 times its descale amax / 448 (1 for a zero row), its RoPE part copied
    bf16 into the row's last 128 bytes; rows in (request, s, head) order, from a q that is a strided view (as a
    caller's q can be)."""
    b, s_q, h_q = 3, 2, 5
    base = torch.randn(b, s_q, h_q + 2, 640, device=device) * torch.logspace(-3, 2, h_q + 2, device=device)[:, None]
    q = base.to(torch.bfloat16)[:, :, 1:h_q + 1, :576]
    q[1, 0, 2, :512] = 0                                  # a zero latent row: descale 1
    packed, descale = quantize_q(q)
    assert packed.shape == (b, s_q, h_q, 640) and packed.dtype == torch.float8_e4m3fn
    lat = q[..., :512].float().reshape(b * s_q * h_q, 512)
    amax = lat.abs().amax(dim=1)
    want_descale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert torch.equal(descale, want_descale)
    want = (lat * (1.0 / want_descale)[:, None]).to(torch.float8_e4m3fn).view(b, s_q, h_q, 512)
    assert torch.equal(packed[..., :512].view(torch.uint8), want.view(torch.uint8))
    assert (packed[..., :512].float().abs().amax(dim=-1).flatten()[amax > 0] == 448).all()   # e4m3's top used
    assert torch.equal(packed[..., 512:].contiguous().view(torch.bfloat16), q[..., 512:])
