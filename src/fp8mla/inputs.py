"""Random decode problems, as the tests, the bench and the demo use them.

Pages are handed out in a shuffled order (so a kernel that ignores the block table fails), every cache slot no
request uses is NaN (so a kernel that reads past a sequence's pages fails), and the RoPE dims can be scaled up
to model the large RoPE values real models have.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import D_LATENT, D_QK, PAGE_SIZE, quantize_fp8_per_tensor, quantize_kv_cache


@dataclass
class DecodeProblem:
    q: torch.Tensor             # [b, s_q, h_q, 576] bf16
    kv: torch.Tensor            # [num_pages, 64, 1, 576] bf16, the unquantized cache (NaN where unused)
    block_table: torch.Tensor   # [b, max_pages] int32, shuffled
    cache_seqlens: torch.Tensor  # [b] int32

    @property
    def shape(self):
        return tuple(self.q.shape[:3])

    def quantized(self, kv_format: str, q_fp8: bool = False) -> dict:
        """The kernel's inputs for ``kv_format``: ``q, k_cache, descale_q, descale_k`` (q pre-quantized to e4m3
        with a per-tensor scale when ``q_fp8``, as vLLM's dense-FP8 path does)."""
        k_cache, descale_k = quantize_kv_cache(self.kv, kv_format)
        q, descale_q = (quantize_fp8_per_tensor(self.q) if q_fp8 else (self.q, None))
        return dict(q=q, k_cache=k_cache, descale_q=descale_q, descale_k=descale_k)


def make_seqlens(b: int, mean_sk: int, varlen: bool = False, generator: torch.Generator | None = None,
                 device=None) -> torch.Tensor:
    """``[b]`` int32 lengths: all ``mean_sk``, or for varlen drawn around it (FlashMLA's test: N(mean, mean/2),
    clipped to [1, 2 * mean])."""
    if not varlen:
        return torch.full((b,), mean_sk, dtype=torch.int32, device=device)
    lens = torch.normal(float(mean_sk), mean_sk / 2, (b,), generator=generator)
    return lens.clamp(1, 2 * mean_sk).round().to(torch.int32).to(device)


def make_problem(b: int, s_q: int, h_q: int, seqlens: torch.Tensor | list[int], device=None, rope_scale: float = 1.0,
                 extra_pages: int = 2, seed: int | None = None) -> DecodeProblem:
    """A random problem on ``device``: randn q and cache (bf16), shuffled pages, NaN in every unused slot."""
    device = torch.device(device or "cpu")
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
    seqlens = torch.as_tensor(seqlens, dtype=torch.int32).cpu()
    pages = (seqlens.long() + PAGE_SIZE - 1) // PAGE_SIZE
    max_pages = max(int(pages.max()) if b else 0, 1)
    num_pages = int(pages.sum()) + extra_pages
    order = torch.randperm(num_pages, generator=g, device=device).int()
    block_table = torch.full((b, max_pages), -1, dtype=torch.int32, device=device)  # unused entries point nowhere
    used = pages.cumsum(0) - pages
    for i in range(b):
        block_table[i, :pages[i]] = order[used[i]:used[i] + pages[i]]
    # every token's cache row: page * 64 + offset
    req = torch.repeat_interleave(torch.arange(b), seqlens.long()).to(device)
    pos = torch.cat([torch.arange(int(n)) for n in seqlens]).to(device) if b else req
    slots = block_table[req, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
    kv = torch.full((num_pages * PAGE_SIZE, D_QK), float("nan"), dtype=torch.bfloat16, device=device)
    rows = torch.randn(len(slots), D_QK, generator=g, device=device)
    rows[:, D_LATENT:] *= rope_scale
    kv[slots] = rows.to(torch.bfloat16)
    q = torch.randn(b, s_q, h_q, D_QK, generator=g, device=device)
    q[..., D_LATENT:] *= rope_scale
    return DecodeProblem(q.to(torch.bfloat16), kv.view(num_pages, PAGE_SIZE, 1, D_QK), block_table,
                         seqlens.to(device))


GROUP_SCALES = (1.0, 8.0, 0.25, 2.0)   # latent groups of very different magnitude: fp8_ds_mla's descales differ


@dataclass
class SparseProblem:
    q: torch.Tensor             # [b, s_q, h_q, 576] bf16
    kv: torch.Tensor            # [num_pages, 64, 1, 576] fp32, the unquantized cache (NaN in rows no index names)
    indices: torch.Tensor       # [b, s_q, topk] int32: cache rows (page * 64 + offset), -1 skipped
    topk_length: torch.Tensor   # [b] int32 (in [1, topk])
    attn_sink: torch.Tensor     # [h_q] fp32

    @property
    def shape(self):
        return tuple(self.q.shape[:3])

    def quantized(self, kv_format: str) -> dict:
        """``q, k_cache, descale_k`` for ``kv_format``."""
        k_cache, descale_k = quantize_kv_cache(self.kv, kv_format)
        return dict(q=self.q, k_cache=k_cache, descale_k=descale_k)


def sparse_indices(b: int, s_q: int, topk: int, context: int, generator: torch.Generator,
                   skipped: int = 7) -> tuple[torch.Tensor, int]:
    """(indices [b, s_q, topk] int32, the cache's pages): each batch entry's ``context`` tokens on shuffled pages
    of a cache of ``b * pages + 2``, each query token attending to ``topk`` of them drawn without repeats (every
    ``skipped``-th -1; with context < topk the rest repeats), drawn on the generator's device."""
    device = generator.device
    pages = -(-context // PAGE_SIZE)
    num_pages = b * pages + 2
    order = torch.randperm(num_pages, generator=generator, device=device)[:b * pages].view(b, pages)
    picks = torch.rand(b, s_q, max(context, topk), generator=generator, device=device).argsort(dim=-1)[..., :topk]
    picks = picks % context
    rows = order.gather(1, (picks // PAGE_SIZE).view(b, -1)).view(b, s_q, topk) * PAGE_SIZE + picks % PAGE_SIZE
    indices = rows.int()
    if skipped:
        indices[..., ::skipped] = -1
    return indices, num_pages


def make_sparse_problem(b: int, s_q: int, h_q: int, topk: int, context: int | None = None, device=None,
                        group_scales=GROUP_SCALES, skipped: int = 7, seed: int | None = None) -> SparseProblem:
    """A random sparse (DeepSeek V3.2) decode problem: each batch entry has ``context`` cached tokens (default
    2 * topk) on shuffled pages, and each of its query tokens attends to ``topk`` of them drawn without
    repeats (every ``skipped``-th index -1; with context < topk the rest repeats); latent groups scaled by
    ``group_scales``; rows no index names NaN."""
    device = torch.device(device or "cpu")
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
    indices, num_pages = sparse_indices(b, s_q, topk, context or 2 * topk, g, skipped)
    kv = torch.randn(num_pages * PAGE_SIZE, D_QK, generator=g, device=device)
    for i, f in enumerate(group_scales):
        kv[:, i * D_LATENT // len(group_scales):(i + 1) * D_LATENT // len(group_scales)] *= f
    unused = torch.ones(num_pages * PAGE_SIZE, dtype=torch.bool, device=device)
    unused[indices[indices >= 0].long()] = False
    kv[unused] = float("nan")
    q = torch.randn(b, s_q, h_q, D_QK, generator=g, device=device).to(torch.bfloat16)
    topk_length = torch.randint(1, topk + 1, (b,), generator=g, device=device, dtype=torch.int32)
    sink = torch.randn(h_q, generator=g, device=device)
    return SparseProblem(q, kv.view(num_pages, PAGE_SIZE, 1, D_QK), indices, topk_length, sink)


def plant_needles(problem: DecodeProblem, score: float = 20.0, softmax_scale: float = D_QK ** -0.5,
                  seed: int = 0) -> list[tuple[int, int, int, int]]:
    """Overwrite one random key of every request so that it scores ``score`` (a softmax logit, after
    ``softmax_scale``) against one random head of the last query token, which sees every key under causal
    masking; randn keys score about N(0, 1), so that row's output should be the needle's V.

    The needle is the query row's own direction, scaled: its values stay in the randn range, so per-tensor FP8
    scales do not move. Returns ``(request, s, h, cache slot)`` per needle (none for empty requests).
    """
    g = torch.Generator().manual_seed(seed)
    b, s_q, h_q = problem.shape
    rows = problem.kv.view(-1, D_QK)
    needles = []
    for req, n in enumerate(problem.cache_seqlens.tolist()):
        if n == 0:
            continue
        h = int(torch.randint(h_q, (), generator=g))
        pos = int(torch.randint(n, (), generator=g))
        q = problem.q[req, s_q - 1, h].float()
        slot = int(problem.block_table[req, pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE
        rows[slot] = (q * (score / (softmax_scale * q.dot(q)))).to(rows.dtype)
        needles.append((req, s_q - 1, h, slot))
    return needles
