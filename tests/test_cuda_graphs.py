"""CUDA graphs: one engine step (metadata, cache write, decode) captured once and replayed with new inputs.

The graph reads its inputs from static buffers; each step the engine copies in the new q, the new tokens' latent
and RoPE vectors with their slots, the seqlens and the block table. Replays must give exactly what eager calls give
on the same inputs, as sequences grow across page boundaries, a finished request is replaced by a new one and a
request slot idles (seqlen 0, padding slots).
"""
import pytest
import torch

from fp8mla.kernels import HOPPER_FORMATS
from fp8mla import (BACKENDS, KV_FORMATS, cal_diff, empty_kv_cache, flash_mla_with_kvcache, get_mla_metadata,
                    hopper_available, reference_mla_decode, write_kv_cache)
from fp8mla.formats import PAGE_SIZE

pytestmark = pytest.mark.gpu

B, MAX_PAGES = 4, 6
PROMPTS = [62, 127, 1, 300]            # requests 0 and 1 cross a page boundary within the first replays
EVENTS = {3: ("replace", 2, 64),       # before replay 3: request 2 finishes, a new one (one full page) takes it
          4: ("idle", 3),              # replay 4: request 3's slot is padding
          5: ("replace", 3, 200)}
REPLAYS = 7
# vs fp32 attention over the cache's values
COS_BOUND = {"bf16": 1e-5, "fp8": 2.5e-3, "fp8_rope_bf16": 2.5e-3, "fp8_ds_mla": 2.5e-3}


class Batch:
    """An engine's host-side bookkeeping: each request's length and pages, pages handed out in shuffled order."""

    def __init__(self, num_pages, gen):
        self.free = torch.randperm(num_pages, generator=gen).tolist()
        self.lens = [0] * B
        self.pages = [[] for _ in range(B)]
        self.idle = set()

    def grow(self, i, n):
        """Slots for request i's next n tokens (-1 for an idle slot)."""
        if i in self.idle:
            return [-1] * n
        slots = []
        for pos in range(self.lens[i], self.lens[i] + n):
            if pos % PAGE_SIZE == 0:
                self.pages[i].append(self.free.pop())
            slots.append(self.pages[i][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        self.lens[i] += n
        return slots

    def finish(self, i):
        self.free += self.pages[i]
        self.pages[i], self.lens[i] = [], 0

    def block_table(self):
        return torch.tensor([p + [-1] * (MAX_PAGES - len(p)) for p in self.pages], dtype=torch.int32)


@pytest.mark.parametrize("s_q,h_q", [(1, 16), (2, 128)])
@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replays_match_eager(backend, kv_format, s_q, h_q):
    device = torch.device("cuda")
    if backend == "hopper" and not hopper_available(device):
        pytest.skip("the hopper backend needs an sm_90 GPU")
    if backend == "hopper" and kv_format not in HOPPER_FORMATS:
        pytest.skip(f"no hopper kernel takes {kv_format!r}")
    host_gen = torch.Generator().manual_seed(0)
    dev_gen = torch.Generator(device=device).manual_seed(0)
    num_pages = B * MAX_PAGES + 2
    batch = Batch(num_pages, host_gen)
    descale_k = torch.tensor([0.02], device=device) if kv_format == "fp8" else None
    caches = {}
    for mode in ("graph", "eager"):
        caches[mode] = empty_kv_cache(num_pages, kv_format, device)
        caches[mode].view(torch.uint8).fill_(0xFF)  # NaN in every format: reading an unused slot shows

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device).to(torch.bfloat16)

    def prefill(i, n):  # an engine writes a prompt outside the decode graph
        slots = torch.tensor(batch.grow(i, n), device=device)
        kv_c, k_pe = randn(n, 512), randn(n, 64)
        for cache in caches.values():
            write_kv_cache(kv_c, k_pe, cache, slots, kv_format, descale_k)

    def step(t, cache, out=None, lse=None, validate=False):
        meta, splits = get_mla_metadata(t["seqlens"], s_q * h_q, 1)
        write_kv_cache(t["kv_c"], t["k_pe"], cache, t["slots"], kv_format, descale_k)
        return flash_mla_with_kvcache(t["q"], cache, t["block_table"], t["seqlens"], 512, meta, splits,
                                      causal=s_q > 1, descale_k=descale_k, kv_format=kv_format, out=out, lse=lse,
                                      backend=backend, validate=validate)

    for i, n in enumerate(PROMPTS):
        prefill(i, n)
    static = None
    for replay in range(REPLAYS):
        event = EVENTS.get(replay)
        if event and event[0] == "replace":
            batch.idle.discard(event[1])
            batch.finish(event[1])
            prefill(event[1], event[2])
        elif event and event[0] == "idle":
            batch.finish(event[1])
            batch.idle.add(event[1])
        slots = sum((batch.grow(i, s_q) for i in range(B)), [])
        inputs = dict(q=randn(B, s_q, h_q, 576), kv_c=randn(B * s_q, 512), k_pe=randn(B * s_q, 64),
                      slots=torch.tensor(slots, device=device),
                      seqlens=torch.tensor(batch.lens, dtype=torch.int32, device=device),
                      block_table=batch.block_table().to(device))
        if static is None:  # capture once, after a warm-up (compiles the kernels) on a scratch cache
            static = {k: v.clone() for k, v in inputs.items()}
            out = torch.empty(B, s_q, h_q, 512, dtype=torch.bfloat16, device=device)
            lse = torch.empty(B, h_q, s_q, dtype=torch.float32, device=device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(static, caches["graph"].clone(), out, lse)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(static, caches["graph"], out, lse)
        for k, v in inputs.items():
            static[k].copy_(v)
        graph.replay()
        eager_out, eager_lse = step(inputs, caches["eager"], validate=True)
        torch.cuda.synchronize()
        assert torch.equal(caches["graph"].view(torch.uint8), caches["eager"].view(torch.uint8)), replay
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), replay
        ref, ref_lse = reference_mla_decode(inputs["q"], caches["eager"], inputs["block_table"], inputs["seqlens"],
                                            causal=s_q > 1, descale_k=descale_k, kv_format=kv_format)
        assert cal_diff(out.float(), ref)["cos_diff"] < COS_BOUND[kv_format], replay
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), replay  # the idle slot: lse +inf, out 0
    assert batch.lens[0] > 64 and batch.lens[1] > 128  # growth crossed page boundaries between replays


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_eager_step_has_no_host_sync(kv_format):
    """The same step outside a graph, under torch's sync debugger (every synchronising call raises)."""
    device = torch.device("cuda")
    seqlens = torch.tensor([70, 1, 200], dtype=torch.int32, device=device)
    block_table = torch.tensor([[5, 1, -1, -1], [0, -1, -1, -1], [2, 3, 6, 4]], dtype=torch.int32, device=device)
    slots = torch.tensor([1 * 64 + 5, 0, 4 * 64 + 7], device=device)
    cache = empty_kv_cache(7, kv_format, device)
    cache.view(torch.uint8).fill_(0)
    descale_k = torch.tensor([0.02], device=device) if kv_format == "fp8" else None
    q = torch.randn(3, 1, 16, 576, device=device).to(torch.bfloat16)
    kv = torch.randn(3, 576, device=device)

    def step():
        meta, splits = get_mla_metadata(seqlens, 16, 1)
        write_kv_cache(kv[:, :512], kv[:, 512:], cache, slots, kv_format, descale_k)
        return flash_mla_with_kvcache(q, cache, block_table, seqlens, 512, meta, splits, descale_k=descale_k,
                                      kv_format=kv_format, validate=False)

    step()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
