"""A DeepSeek-V3 attention layer decoding on fp8mla, checked against transformers' own module.

transformers' ``DeepseekV3Attention`` (random weights, yarn RoPE with its mscale, interleaved RoPE as in the
released checkpoints) prefills one prompt per request, then decodes a few steps two ways:

* the module's eager forward with its own KV cache, in fp32: the reference;
* the absorbed path a serving engine runs: W_UK (from ``kv_b_proj``) folded into q_nope to make the 512-wide latent
  query, RoPE applied by the module's own function, the latent kv (after ``kv_a_layernorm``) and roped k_pe written
  into fp8mla's paged cache (pages handed out in shuffled order) by ``write_kv_cache``, one batched
  ``flash_mla_with_kvcache`` per step, W_UV applied to its 512-wide output, then ``o_proj``.

and prints the error of the layer output per cache format::

    PYTHONPATH=src python3 examples/deepseek_v3_decode.py                   # tiny (CPU via the interpreter, or GPU)
    PYTHONPATH=src python3 examples/deepseek_v3_decode.py --size realistic  # DeepSeek-V3's dimensions, on a GPU
"""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # run fp8mla's kernels in Triton's interpreter; must precede importing fp8mla
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import DeepseekV3Config  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

import fp8mla  # noqa: E402
from fp8mla.formats import PAGE_SIZE  # noqa: E402

SIZES = {
    # CI size: few heads and narrow heads, but the latent (512) and RoPE (64) widths fp8mla is built for
    "tiny": dict(dims=dict(hidden_size=256, num_attention_heads=8, q_lora_rank=64, qk_nope_head_dim=32,
                           v_head_dim=32),
                 prompts=[70, 45, 127], steps=3),
    # DeepSeek-V3's attention (one layer, all 128 heads)
    "realistic": dict(dims=dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, qk_nope_head_dim=128,
                                v_head_dim=128),
                      prompts=[1000, 2047, 300, 3000], steps=8),
}


def make_config(hidden_size, num_attention_heads, q_lora_rank, qk_nope_head_dim, v_head_dim) -> DeepseekV3Config:
    """DeepSeek-V3's attention settings (yarn x40 RoPE, mscale 1, interleaved RoPE) at the given dimensions."""
    return DeepseekV3Config(
        hidden_size=hidden_size, num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim, num_hidden_layers=1, max_position_embeddings=163840, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        attn_implementation="eager")


class AbsorbedMLA:
    """The decode path of one ``DeepseekV3Attention`` in absorbed form, using the module's weights as they are."""

    def __init__(self, attn: hf.DeepseekV3Attention, rotary: hf.DeepseekV3RotaryEmbedding):
        cfg = attn.config
        self.attn, self.rotary = attn, rotary
        self.heads, self.nope, self.rope_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
        w = attn.kv_b_proj.weight.view(self.heads, self.nope + attn.v_head_dim, attn.kv_lora_rank)
        self.w_uk = w[:, :self.nope]   # [h, nope, 512]: k_nope = W_UK c
        self.w_uv = w[:, self.nope:]   # [h, v, 512]:    v = W_UV c
        self.rope_fn = hf.apply_rotary_pos_emb_interleave if cfg.rope_interleave else hf.apply_rotary_pos_emb
        self.softmax_scale = attn.scaling  # qk_head_dim^-0.5 times yarn's mscale^2, as the module computes it

    def _rotate(self, x, hidden, positions):
        """The module's RoPE on ``x [T, n, 64]`` (it rotates q and k alike, so x goes in as both)."""
        cos, sin = self.rotary(hidden, positions[None])
        x = x.transpose(0, 1)[None]    # the module's [batch, heads, seq, dim]
        return self.rope_fn(x, x, cos, sin)[0][0].transpose(0, 1)

    def latent_kv(self, hidden, positions):
        """``(kv_c [T, 512], k_pe [T, 64])``: what the cache holds for tokens ``hidden [T, d]`` at ``positions``."""
        a = self.attn
        kv_c, k_pe = a.kv_a_proj_with_mqa(hidden).split([a.kv_lora_rank, self.rope_dim], dim=-1)
        return a.kv_a_layernorm(kv_c), self._rotate(k_pe[:, None], hidden, positions)[:, 0]

    def latent_query(self, hidden, positions):
        """``q [T, h, 576]``: W_UK^T q_nope (512) then the roped q_pe (64)."""
        a = self.attn
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hidden))) if a.q_lora_rank else a.q_proj(hidden)
        q_nope, q_pe = q.view(len(hidden), self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        q_lat = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        return torch.cat([q_lat, self._rotate(q_pe, hidden, positions)], dim=-1)

    def output(self, o_lat):
        """The layer output from fp8mla's ``[T, h, 512]`` output: W_UV per head, then ``o_proj``."""
        o = torch.einsum("thc,hvc->thv", o_lat.to(self.w_uv.dtype), self.w_uv)
        return self.attn.o_proj(o.flatten(1))


class PagedCache:
    """One layer's paged latent cache for a batch, with an engine's bookkeeping: pages handed out in shuffled
    order as each request grows."""

    def __init__(self, kv_format, batch, max_len, device, descale_k=None, seed=0, backend=None):
        self.kv_format, self.descale_k, self.device, self.backend = kv_format, descale_k, device, backend
        max_pages = -(-max_len // PAGE_SIZE)
        num_pages = batch * max_pages + 1
        self.cache = fp8mla.empty_kv_cache(num_pages, kv_format, device)
        self.cache.view(torch.uint8).fill_(0xFF)  # NaN in every format: a read of an unwritten slot shows
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.lens = [0] * batch
        self.block_table = torch.full((batch, max_pages), -1, dtype=torch.int32)

    def append(self, requests, kv_c, k_pe):
        """Write token t (``kv_c[t]``, ``k_pe[t]``) at the end of request ``requests[t]``."""
        slots = []
        for i in requests:
            pos = self.lens[i]
            if pos % PAGE_SIZE == 0:
                self.block_table[i, pos // PAGE_SIZE] = self.free.pop()
            slots.append(int(self.block_table[i, pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE)
            self.lens[i] += 1
        fp8mla.write_kv_cache(kv_c, k_pe, self.cache, torch.tensor(slots, device=self.device), self.kv_format,
                              self.descale_k)

    def decode(self, q, softmax_scale):
        """``q [b, h, 576]`` (one new token per request) -> ``[b, h, 512]``."""
        seqlens = torch.tensor(self.lens, dtype=torch.int32, device=self.device)
        meta, splits = fp8mla.get_mla_metadata(seqlens, q.shape[1], 1)  # once per step, shared by all layers
        out, _ = fp8mla.flash_mla_with_kvcache(q[:, None].to(torch.bfloat16), self.cache,
                                               self.block_table.to(self.device), seqlens, 512, meta, splits,
                                               softmax_scale=softmax_scale, descale_k=self.descale_k,
                                               kv_format=self.kv_format, backend=self.backend)
        return out[:, 0]


@torch.no_grad()
def compare(size="tiny", kv_formats=fp8mla.KV_FORMATS, device=None, seed=0,
            backend=None) -> dict[str, dict[str, float]]:
    """Prefill and decode with the module and with fp8mla per format; ``{format: cal_diff of the layer outputs}``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = SIZES[size]
    cfg = make_config(**spec["dims"])
    torch.manual_seed(seed)
    attn = hf.DeepseekV3Attention(cfg, layer_idx=0).to(device).eval()
    rotary = hf.DeepseekV3RotaryEmbedding(cfg).to(device)
    prompts = [torch.randn(n, cfg.hidden_size, device=device) for n in spec["prompts"]]
    steps = torch.randn(spec["steps"], len(prompts), cfg.hidden_size, device=device)

    # the module, one request at a time, with its own cache
    want = torch.empty(*steps.shape, device=device)
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        cache = DynamicCache(config=cfg)
        causal = torch.full((n, n), float("-inf"), device=device).triu(1)[None, None]
        attn(prompt[None], rotary(prompt[None], torch.arange(n, device=device)[None]), causal, past_key_values=cache)
        for s in range(len(steps)):
            h = steps[s, i][None, None]
            pos = torch.tensor([[n + s]], device=device)
            want[s, i] = attn(h, rotary(h, pos), None, past_key_values=cache)[0][0, 0]

    # the absorbed path on fp8mla, all requests batched
    mla = AbsorbedMLA(attn, rotary)
    prompt_kv = [mla.latent_kv(p, torch.arange(len(p), device=device)) for p in prompts]
    requests = [i for i, p in enumerate(prompts) for _ in range(len(p))]
    all_c, all_pe = (torch.cat(parts) for parts in zip(*prompt_kv))
    diffs = {}
    for kv_format in kv_formats:
        # "fp8" has one scale for the whole cache: set from the prompts, as an engine calibrates it (later tokens
        # beyond it saturate)
        descale_k = (torch.cat([all_c, all_pe], -1).abs().amax() / fp8mla.formats.FP8_MAX).reshape(1) \
            if kv_format == "fp8" else None
        paged = PagedCache(kv_format, len(prompts), max(map(len, prompts)) + len(steps), device, descale_k, seed,
                           backend)
        paged.append(requests, all_c, all_pe)
        got = torch.empty_like(want)
        for s in range(len(steps)):
            positions = torch.tensor(paged.lens, device=device)
            kv_c, k_pe = mla.latent_kv(steps[s], positions)
            paged.append(range(len(prompts)), kv_c, k_pe)
            got[s] = mla.output(paged.decode(mla.latent_query(steps[s], positions), mla.softmax_scale))
        diffs[kv_format] = fp8mla.cal_diff(got, want)
    return diffs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=fp8mla.BACKENDS, help="default: the fastest available")
    args = parser.parse_args()
    spec = SIZES[args.size]
    device = "cuda" if torch.cuda.is_available() else "cpu (Triton interpreter)"
    print(f"DeepSeek-V3 attention, {args.size}: {spec['dims']}, prompts {spec['prompts']}, {spec['steps']} decode "
          f"steps, on {device}, backend {args.backend or 'the fastest available'}")
    print("layer output (o_proj) vs the module's eager forward in fp32:")
    print(f"{'format':<15} {'cos_diff':>10} {'RMSE':>10} {'amax':>10}")
    for kv_format, d in compare(args.size, seed=args.seed, backend=args.backend).items():
        print(f"{kv_format:<15} {d['cos_diff']:>10.2e} {d['rmse']:>10.2e} {d['amax']:>10.2e}")


if __name__ == "__main__":
    main()
