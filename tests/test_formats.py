import pytest
import torch

from fp8mla import dequantize_kv_cache, empty_kv_cache, quantize_kv_cache, write_kv_cache
from fp8mla.formats import (FP8_MAX, KV_FORMATS, ROPE_OFFSET, ROW_BYTES, SCALE_OFFSET, infer_kv_format,
                            unpack_fp8_ds_mla, unpack_fp8_rope_bf16)


def random_cache(num_pages=3, rope_scale=1.0):
    kv = torch.randn(num_pages, 64, 1, 576)
    kv[..., 512:] *= rope_scale
    return kv.to(torch.bfloat16)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_quantize_round_trip(kv_format):
    kv = random_cache()
    k_cache, descale_k = quantize_kv_cache(kv, kv_format)
    assert infer_kv_format(k_cache, sparse=kv_format == "fp8_ds_mla") == kv_format
    back = dequantize_kv_cache(k_cache, descale_k, kv_format)
    err = (back - kv.float()).abs() / kv.float().abs().amax()
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the value, and scales are per tensor/token
    assert err.max() <= (0 if kv_format == "bf16" else 2 ** -4 * 1.01)
    if kv_format in ("fp8_rope_bf16", "fp8_ds_mla"):
        assert torch.equal(back[..., 512:], kv[..., 512:].float())  # RoPE kept exactly


def test_fp8_rope_bf16_layout():
    kv = random_cache(1)
    kv[0, 5, 0, :512] = 0  # an all-zero latent vector gets descale 1, not a division by zero
    rows, _ = quantize_kv_cache(kv, "fp8_rope_bf16")
    assert rows.shape == (1, 64, 1, ROW_BYTES) and rows.dtype == torch.uint8 and ROW_BYTES % 16 == 0
    latent, descale, rope = unpack_fp8_rope_bf16(rows)
    amax = kv[..., :512].float().abs().amax(-1, keepdim=True)
    assert torch.equal(descale[amax == 0], torch.ones_like(descale[amax == 0]))
    # a power of two, the smallest that keeps the token's largest value within e4m3's range
    assert torch.equal(descale, torch.exp2(torch.log2(descale).round()))
    assert ((amax / descale <= FP8_MAX) & ((amax == 0) | (amax / descale >= FP8_MAX / 2))).all()
    assert torch.equal(rope, kv[..., 512:])
    slots = rows[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    assert torch.equal(slots, descale.expand_as(slots))   # in all four slots: also a valid fp8_ds_mla row
    assert (latent.float().abs().amax(-1) >= FP8_MAX / 2).sum() == amax.gt(0).sum()  # each uses its top binade


def test_fp8_ds_mla_layout():
    """A descale per 128 latent dims, each the power of two just above its group's amax / 448; one cache, two
    readings: the same values where the four descales are equal (fp8mla's fp8_rope_bf16 writer), else only
    fp8_ds_mla's are right."""
    kv = random_cache(1)
    for g, f in enumerate((1.0, 8.0, 0.25, 0.0)):   # the last group all zero: descale 1
        kv[..., 128 * g:128 * (g + 1)] *= f
    rows, _ = quantize_kv_cache(kv, "fp8_ds_mla")
    latent, descales, rope = unpack_fp8_ds_mla(rows)
    amax = kv[..., :512].float().unflatten(-1, (4, 128)).abs().amax(-1)
    assert torch.equal(descales[..., 3], torch.ones_like(descales[..., 3]))
    assert torch.equal(descales, torch.exp2(torch.log2(descales).round()))
    assert ((amax / descales <= FP8_MAX) & ((amax == 0) | (amax / descales >= FP8_MAX / 2))).all()
    assert torch.equal(rope, kv[..., 512:])
    assert infer_kv_format(rows) == "fp8_rope_bf16" and infer_kv_format(rows, sparse=True) == "fp8_ds_mla"
    as_ds = dequantize_kv_cache(rows, kv_format="fp8_ds_mla")
    assert not torch.equal(dequantize_kv_cache(rows, kv_format="fp8_rope_bf16"), as_ds)
    own, _ = quantize_kv_cache(kv, "fp8_rope_bf16")
    assert torch.equal(dequantize_kv_cache(own, kv_format="fp8_rope_bf16"),
                       dequantize_kv_cache(own, kv_format="fp8_ds_mla"))


def test_bf16_rope_keeps_large_scores_accurate():
    """Large RoPE values make the scores large; an FP8 RoPE part then errs by a large absolute amount (which
    the softmax exponentiates), a BF16 one does not."""
    kv = random_cache(2, rope_scale=8.0)
    q = torch.randn(16, 576)
    q[:, 512:] *= 8
    exact = q @ kv.float().reshape(-1, 576).T
    score_err = {}
    for kv_format in ("fp8", "fp8_rope_bf16"):
        k = dequantize_kv_cache(*quantize_kv_cache(kv, kv_format), kv_format).reshape(-1, 576)
        score_err[kv_format] = ((q @ k.T - exact).pow(2).mean().sqrt() / 24).item()  # in softmax units
    assert score_err["fp8_rope_bf16"] * 4 < score_err["fp8"]


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_writer_matches_quantizer(kv_format, device):
    kv = random_cache(4).to(device)
    expected, descale_k = quantize_kv_cache(kv, kv_format)
    cache = empty_kv_cache(4, kv_format, device)
    cache.view(torch.uint8).fill_(0x7F)  # NaN in every FP8 byte, garbage elsewhere
    slots = torch.randperm(4 * 64, device=device)
    tokens = kv.reshape(-1, 576)[slots]
    write_kv_cache(tokens[:, :512], tokens[:, 512:], cache, slots, kv_format, descale_k)
    if kv_format == "fp8_rope_bf16":
        assert torch.equal(cache, expected)
    else:
        assert torch.equal(dequantize_kv_cache(cache, descale_k, kv_format),
                           dequantize_kv_cache(expected, descale_k, kv_format))


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_writer_skips_negative_slots(kv_format, device):
    cache = empty_kv_cache(1, kv_format, device)
    cache.view(torch.uint8).fill_(0x11)
    before = cache.clone()
    kv_c, k_pe = torch.randn(3, 512, device=device), torch.randn(3, 64, device=device)
    descale = torch.tensor([0.05], device=device) if kv_format == "fp8" else None
    write_kv_cache(kv_c, k_pe, cache, torch.tensor([-1, 7, -5], device=device), kv_format, descale)
    changed = (cache.view(torch.uint8) != before.view(torch.uint8)).reshape(64, -1).any(-1)
    assert changed.nonzero().flatten().tolist() == [7]
    got = dequantize_kv_cache(cache, descale, kv_format)[0, 7, 0]
    want = torch.cat([kv_c[1], k_pe[1]])
    assert torch.allclose(got, want, rtol=2 ** -4, atol=0.05 * 2 ** -4 if descale is not None else 1e-2)


def test_bad_inputs():
    with pytest.raises(TypeError, match="cannot infer"):
        infer_kv_format(torch.zeros(1, 64, 1, 512))
    with pytest.raises(TypeError, match="needs a"):
        infer_kv_format(torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16), "fp8")
    with pytest.raises(ValueError, match="kv_format must be"):
        quantize_kv_cache(random_cache(), "int4")
    with pytest.raises(ValueError, match="must be"):
        quantize_kv_cache(torch.zeros(1, 32, 1, 576), "bf16")
    cache = empty_kv_cache(1, "fp8")
    with pytest.raises(ValueError, match="descale_k"):
        write_kv_cache(torch.zeros(1, 512), torch.zeros(1, 64), cache, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="k_pe"):
        write_kv_cache(torch.zeros(2, 512), torch.zeros(1, 64), empty_kv_cache(1, "bf16"),
                       torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_cache(torch.zeros(512, 2).t(), torch.zeros(2, 64), empty_kv_cache(1, "bf16"),
                       torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous"):   # (the kernel would read past it)
        write_kv_cache(torch.zeros(2, 512), torch.zeros(2, 64), empty_kv_cache(1, "bf16"),
                       torch.zeros(1, dtype=torch.int64).expand(2))
