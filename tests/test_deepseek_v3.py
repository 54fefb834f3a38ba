"""A transformers DeepSeek-V3 attention layer decoding on fp8mla matches the module's own eager forward.

Runs examples/deepseek_v3_decode.py at its tiny size (CPU: interpreter), and at DeepSeek-V3's size on a GPU.
Bounds on the layer output's cos_diff, from 8 seeds at the tiny size on the CPU: bf16 4.2e-6 .. 5.7e-6, fp8
6.8e-4 .. 9.1e-4, fp8_rope_bf16 6.5e-4 .. 8.3e-4; the realistic size (run once in the interpreter, seed 0): 4.7e-6,
7.8e-4, 7.8e-4.
The FP8 level is e4m3's: 3 mantissa bits leave ~3.6 % RMS rounding error per value, ~6.5e-4 of cos_diff for each
operand whose error the attention does not average away (the query's latent part). A real defect is far above the
bounds: RoPE in the wrong layout gives 0.14, a softmax scale without yarn's mscale 0.05 (bf16 cache).
"""
import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v3")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v3_decode.py"
COS_BOUND = {"bf16": 2e-5, "fp8": 2e-3, "fp8_rope_bf16": 2e-3, "fp8_ds_mla": 2e-3}


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("deepseek_v3_decode", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def test_latent_cache_rows_are_the_modules(example):
    """What we write to the paged cache is exactly what the module caches: normed latent, roped k_pe."""
    from transformers.cache_utils import DynamicCache

    cfg = example.make_config(**example.SIZES["tiny"]["dims"])
    torch.manual_seed(0)
    attn = example.hf.DeepseekV3Attention(cfg, layer_idx=0).eval()
    rotary = example.hf.DeepseekV3RotaryEmbedding(cfg)
    hidden, pos = torch.randn(1, 10, cfg.hidden_size), torch.arange(10)
    cache = DynamicCache(config=cfg)
    causal = torch.full((10, 10), float("-inf")).triu(1)[None, None]
    attn(hidden, rotary(hidden, pos[None]), causal, past_key_values=cache)
    kv_c, k_pe = example.AbsorbedMLA(attn, rotary).latent_kv(hidden[0], pos)
    assert torch.equal(kv_c, cache.layers[0].keys[0, 0])
    assert torch.equal(k_pe, cache.layers[0].values[0, 0])


@pytest.mark.parametrize("size", ["tiny", pytest.param("realistic", marks=pytest.mark.gpu)])
def test_layer_output_matches_module(example, size):
    diffs = example.compare(size, seed=0)
    for kv_format, d in diffs.items():
        print(kv_format, d)
        assert d["cos_diff"] < COS_BOUND[kv_format], (kv_format, d)
