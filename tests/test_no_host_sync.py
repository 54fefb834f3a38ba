"""The serving path (metadata, cache write, decode) never reads a device value back to the host.

A host read-back (``.item()``, ``.tolist()``, ``int(t)``, ``if t:``, ``torch.nonzero``, boolean-mask indexing, ...)
stalls the CPU until the GPU catches up and breaks CUDA-graph capture. On the CPU we cannot watch the stream, so we
make every such call raise when fp8mla's own Python code makes it (directly or through torch), and run the path in
the interpreter (or on the GPU, where tests/test_cuda_graphs.py also runs it under torch's sync debugger). Triton
itself reads tensors freely (its interpreter, its launcher); the guard ignores calls that come from it.
"""
import sys
from contextlib import contextmanager

import pytest
import torch

from fp8mla import KV_FORMATS, flash_mla_with_kvcache, get_mla_metadata, quantize_fp8_per_tensor, write_kv_cache
from fp8mla.compat import concat_and_cache_mla, flash_mla_with_kvcache_fp8, get_mla_metadata_dense_fp8
from fp8mla.formats import empty_kv_cache, quantize_kv_cache
from fp8mla.inputs import make_problem

_SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                 "__array__", "unique", "__repr__", "__str__", "__format__")
_SYNC_FUNCTIONS = ("nonzero", "unique", "masked_select", "argwhere")


def _to_host(args, kwargs):
    return any(isinstance(t, (str, torch.device)) and str(t) == "cpu" for t in (*args[1:], kwargs.get("device")))


# calls that sync only in some forms: where(cond) is nonzero(); repeat_interleave must count its output
_SYNC_FORMS = {(torch, "where"): lambda args, kwargs: len(args) + len(kwargs) == 1,
               (torch, "repeat_interleave"): lambda args, kwargs: "output_size" not in kwargs,
               (torch.Tensor, "to"): _to_host}


class HostSync(AssertionError):
    pass


def _caller_is_fp8mla() -> bool:
    """Whether the nearest frame outside torch (and this file) belongs to fp8mla's serving code."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "torch" or name.startswith("torch.") or frame.f_code.co_filename == __file__):
            return name.startswith("fp8mla") and name != "fp8mla.kernels.interpreter"
        frame = frame.f_back
    return False


def _guard(name, original, syncs=lambda args, kwargs: True):
    def guarded(*args, **kwargs):
        if syncs(args, kwargs) and _caller_is_fp8mla():
            raise HostSync(f"host synchronisation: {name} called from fp8mla")
        return original(*args, **kwargs)
    return guarded


def _index_syncs(index) -> bool:
    """A boolean mask index is a nonzero() in disguise; a 0-d integer tensor index is read as a Python int."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and (i.dtype in (torch.bool, torch.uint8)
                                                or (i.dim() == 0 and not i.is_floating_point())) for i in items)


def _guard_indexing(name, original):
    def guarded(self, index, *rest):
        if _index_syncs(index) and _caller_is_fp8mla():
            raise HostSync(f"host synchronisation: mask or 0-d tensor index in {name} called from fp8mla")
        return original(self, index, *rest)
    return guarded


@contextmanager
def no_host_sync():
    saved = []
    for owner, names in ((torch.Tensor, _SYNC_METHODS), (torch, _SYNC_FUNCTIONS)):
        for name in names:
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, _guard(f"{owner.__name__}.{name}", getattr(owner, name)))
    for (owner, name), syncs in _SYNC_FORMS.items():
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, _guard(f"{owner.__name__}.{name}", getattr(owner, name), syncs))
    for name in ("__getitem__", "__setitem__"):
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, _guard_indexing(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def test_guard_catches_a_read_back(device):
    """The guard is live: the validating call reads the block table back, and says so."""
    p = make_problem(2, 1, 16, [100, 70], device=device, seed=0)
    meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1)
    with no_host_sync(), pytest.raises(HostSync, match="tolist"):
        flash_mla_with_kvcache(p.q, p.kv, p.block_table, p.cache_seqlens, 512, meta, splits, validate=True)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_serving_step_has_no_host_sync(kv_format, device):
    """One engine step as it would be captured: metadata, append one token per request, decode."""
    p = make_problem(3, 1, 16, [65, 1, 130], device=device, seed=1)
    cache, descale_k = quantize_kv_cache(p.kv, kv_format)
    # the last token of each request is this step's new token
    last = p.cache_seqlens.long() - 1
    slots = p.block_table[torch.arange(3, device=device), last // 64].long() * 64 + last % 64
    new = p.kv.reshape(-1, 576)[slots].float()
    expected = cache.clone()
    cache.view(torch.uint8).reshape(-1, cache.shape[-1] * cache.element_size())[slots] = 0
    with no_host_sync():
        meta, splits = get_mla_metadata(p.cache_seqlens, 16, 1)
        write_kv_cache(new[:, :512], new[:, 512:], cache, slots, kv_format, descale_k)
        out, lse = flash_mla_with_kvcache(p.q, cache, p.block_table, p.cache_seqlens, 512, meta, splits,
                                          descale_k=descale_k, kv_format=kv_format)   # the default call
        schedule, _ = get_mla_metadata()   # FlashMLA's current convention: planned by the first call
        out2, lse2 = flash_mla_with_kvcache(p.q, cache, p.block_table, p.cache_seqlens, 512, schedule, None,
                                            descale_k=descale_k, kv_format=kv_format)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    ref, ref_lse = flash_mla_with_kvcache(p.q, expected, p.block_table, p.cache_seqlens, 512,
                                          *get_mla_metadata(p.cache_seqlens, 16, 1), descale_k=descale_k,
                                          kv_format=kv_format)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(out2, ref) and torch.equal(lse2, ref_lse)


def test_compat_step_has_no_host_sync(device):
    """vLLM's calls: cache write into a uint8 [blocks, 64, 576] cache, then the dense-FP8 decode."""
    p = make_problem(2, 2, 16, [70, 128], device=device, seed=2)
    _, descale_k = quantize_fp8_per_tensor(p.kv.nan_to_num())
    kv_cache = empty_kv_cache(p.kv.shape[0], "fp8", device).view(torch.uint8).squeeze(2)
    slots = (p.block_table.long()[..., None] * 64 + torch.arange(64, device=device)).flatten()  # every row of the used pages
    tokens = p.kv.reshape(-1, 576)[slots].float().nan_to_num()
    q, descale_q = quantize_fp8_per_tensor(p.q)
    with no_host_sync():
        concat_and_cache_mla(tokens[:, :512], tokens[:, 512:], kv_cache, slots, "fp8", descale_k)
        meta, splits = get_mla_metadata_dense_fp8(p.cache_seqlens, 32, 1)
        flash_mla_with_kvcache_fp8(q, kv_cache.view(torch.float8_e4m3fn).unsqueeze(-2), p.block_table,
                                   p.cache_seqlens, 512, meta, splits, None, True, descale_q, descale_k)


def test_metadata_of_equal_requests_has_no_host_sync(device, monkeypatch):
    """The default cut of equal-length requests (pieces fitted to the combine's steps) stays on the device."""
    from fp8mla import runtime
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    with no_host_sync():
        meta, splits = get_mla_metadata(torch.full((1,), 8192, dtype=torch.int32, device=device), 128, 1)
    assert splits.tolist() == [0, 64]


def test_metadata_of_few_uneven_requests_has_no_host_sync(device, monkeypatch):
    """The default cut of a few requests of different lengths (pieces fitted to the combine's steps) stays on the
    device."""
    from fp8mla import runtime
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    with no_host_sync():
        meta, splits = get_mla_metadata(torch.tensor([8192, 1024], dtype=torch.int32, device=device), 16, 1)
    assert splits.tolist() == [0, 64, 72]
