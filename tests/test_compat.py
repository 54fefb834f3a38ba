"""vLLM-style entry points (fp8mla.compat) give exactly what the native calls give."""
import pytest
import torch

from fp8mla import (cal_diff, empty_kv_cache, flash_mla_with_kvcache, get_mla_metadata, quantize_fp8_per_tensor,
                    reference_mla_decode, write_kv_cache)
from fp8mla.compat import concat_and_cache_mla, flash_mla_with_kvcache_fp8, get_mla_metadata_dense_fp8
from fp8mla.formats import D_QK, dequantize_kv_cache
from fp8mla.inputs import make_problem


def tokens(n, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(n, 512, generator=g, device=device).to(torch.bfloat16),
            torch.randn(n, 64, generator=g, device=device).to(torch.bfloat16))


@pytest.mark.parametrize("kv_cache_dtype,kv_format", [("auto", "bf16"), ("fp8", "fp8"), ("fp8_e4m3", "fp8"),
                                                      ("fp8_rope_bf16", "fp8_rope_bf16")])
def test_concat_and_cache_mla_matches_native_writer(kv_cache_dtype, kv_format, device):
    kv_c, k_pe = tokens(10, device)
    slots = torch.tensor([5, 70, -1, 64, 127, 0, 3, -1], device=device)  # two padding tokens; 2 rows of padding after
    scale = torch.tensor(0.02, device=device)                         # vLLM's k_scale: a 0-d fp32 tensor
    native = empty_kv_cache(2, kv_format, device)
    native.view(torch.uint8).fill_(0x11)
    # vLLM allocates [blocks, 64, row], FP8 as uint8 storage
    vllm_cache = native.clone().squeeze(2)
    if kv_format == "fp8":
        vllm_cache = vllm_cache.view(torch.uint8)
    write_kv_cache(kv_c[:8], k_pe[:8], native, slots, kv_format, scale.reshape(1) if kv_format == "fp8" else None)
    concat_and_cache_mla(kv_c, k_pe, vllm_cache, slots, kv_cache_dtype, scale)
    assert torch.equal(vllm_cache.view(torch.uint8), native.view(torch.uint8).squeeze(2))
    # value = fp8 * scale, as in vLLM
    got = dequantize_kv_cache(native, scale.reshape(1) if kv_format == "fp8" else None, kv_format).reshape(-1, D_QK)
    want = torch.cat([kv_c, k_pe], -1).float()
    keep = slots >= 0
    assert torch.allclose(got[slots[keep]], want[:8][keep], rtol=2 ** -4, atol=0.02 * 2 ** -4)


def test_concat_and_cache_mla_rejects_unknown_dtype(device):
    kv_c, k_pe = tokens(1, device)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        concat_and_cache_mla(kv_c, k_pe, empty_kv_cache(1, "fp8", device).squeeze(2), torch.zeros(1, device=device,
                             dtype=torch.int64), "fp8_e5m2", torch.ones((), device=device))


@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
def test_flash_mla_with_kvcache_fp8_matches_native(s_q, causal, device):
    p = make_problem(3, s_q, 16, [150, 1, 64], device=device, seed=3)
    q, descale_q = quantize_fp8_per_tensor(p.q)
    k_cache, descale_k = quantize_fp8_per_tensor(p.kv)
    meta, splits = get_mla_metadata_dense_fp8(p.cache_seqlens, s_q * 16, 1)
    native_meta = get_mla_metadata(p.cache_seqlens, s_q * 16, 1)
    assert all(torch.equal(a, b) for a, b in zip((meta, splits), native_meta))
    # vLLM's argument order, all positional
    out, lse = flash_mla_with_kvcache_fp8(q, k_cache, p.block_table, p.cache_seqlens, 512, meta, splits, None,
                                          causal, descale_q, descale_k)
    ref, ref_lse = flash_mla_with_kvcache(q, k_cache, p.block_table, p.cache_seqlens, 512, meta, splits,
                                          softmax_scale=576 ** -0.5, causal=causal, descale_q=descale_q,
                                          descale_k=descale_k)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    exact, _ = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=causal)
    assert cal_diff(out.float(), exact)["cos_diff"] < 2.5e-3


def test_vllm_flow(device):
    """What vLLM's FlashMLA backend does per layer: write the step's tokens, view the uint8 cache as e4m3, decode."""
    b, h_q = 2, 16
    seqlens = torch.tensor([100, 65], dtype=torch.int32, device=device)
    block_table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32, device=device)
    kv_cache = torch.zeros(4, 64, 576, dtype=torch.uint8, device=device)
    pos = torch.cat([torch.arange(100), torch.arange(65)]).to(device)
    req = torch.cat([torch.zeros(100), torch.ones(65)]).long().to(device)
    slots = block_table[req, pos // 64].long() * 64 + pos % 64
    kv_c, k_pe = tokens(len(slots), device, seed=4)
    k_scale = (torch.cat([kv_c, k_pe], -1).float().abs().amax() / 448).reshape(1)
    concat_and_cache_mla(kv_c, k_pe, kv_cache, slots, "fp8", k_scale)
    q, q_scale = quantize_fp8_per_tensor(torch.randn(b, 1, h_q, 576, device=device))
    meta, splits = get_mla_metadata_dense_fp8(seqlens, h_q, 1)
    out, lse = flash_mla_with_kvcache_fp8(q=q, k_cache=kv_cache.view(torch.float8_e4m3fn).unsqueeze(-2),
                                          block_table=block_table, cache_seqlens=seqlens, head_dim_v=512,
                                          tile_scheduler_metadata=meta, num_splits=splits, softmax_scale=0.1,
                                          causal=True, descale_q=q_scale, descale_k=k_scale)
    kv = torch.full((4 * 64, 576), float("nan"), dtype=torch.bfloat16, device=device)
    kv[slots] = torch.cat([kv_c, k_pe], -1)
    exact, _ = reference_mla_decode(q.float() * q_scale, kv.view(4, 64, 1, 576), block_table, seqlens,
                                    softmax_scale=0.1)
    assert cal_diff(out.float(), exact)["cos_diff"] < 2.5e-3
    # the lse against the values the call was given (e4m3 q and cache with their scales): the cache's quantization
    # moves some rows' lse by more than 0.2 on random inputs, the kernel's own arithmetic does not
    _, seen_lse = reference_mla_decode(q, kv_cache.view(torch.float8_e4m3fn).unsqueeze(-2), block_table, seqlens,
                                       softmax_scale=0.1, descale_q=q_scale, descale_k=k_scale, kv_format="fp8")
    assert torch.allclose(lse, seen_lse, atol=0.05)
