"""Paged KV-cache formats as data: their layouts, and FP8 quantization of whole caches (torch only; the cache writer
that appends tokens is :func:`fp8mla.write_kv_cache`).

Every cache is paged: ``[num_pages, PAGE_SIZE, 1, row]`` (one KV head), pages reached through a block table.
A row holds one token's 512 latent values (the "NoPE" part, also used as V) and its 64 RoPE values.

``"bf16"``
    ``[num_pages, 64, 1, 576]`` bfloat16: latent then RoPE (FlashMLA's layout).
``"fp8"``
    ``[num_pages, 64, 1, 576]`` float8_e4m3fn with one per-tensor ``descale_k`` (shape ``[1]``, fp32): what
    vLLM's ``--kv-cache-dtype fp8`` stores. value = fp8 * descale_k, RoPE included.
``"fp8_rope_bf16"``
    ``[num_pages, 64, 1, 656]`` uint8, one 656-byte row per token (656 = 41 * 16, so rows stay 16-byte
    aligned for TMA)::

        bytes [  0, 512)  latent, float8_e4m3fn
        bytes [512, 528)  the token's latent descale, float32, a power of two (latent value = fp8 * descale),
                          stored four times: so the row is also a valid ``"fp8_ds_mla"`` row
        bytes [528, 656)  RoPE, 64 x bfloat16 (kept exact)

    The scale is per token, so appending a token never rescales old ones, and the RoPE part never shares a
    scale with the latent part (one large RoPE value would otherwise crush the latent values into a few FP8
    levels: see README). The descale is the power of two just above amax / 448 (the largest latent value lands
    in (224, 448]): e4m3's relative precision does not depend on the scale, and the kernels fold the ratio of a
    token's descale to its page's largest into P before P's e4m3 cast, a ratio that a power of two keeps exact.
    With arbitrary scales that ratio rounds too, which doubles the P error when one key dominates a row (RoPE
    ×8 on the CPU: out cos_diff 8.1e-4 with amax/448 scales, 4.0e-4 with powers of two).
``"fp8_ds_mla"``
    ``[num_pages, 64, 1, 656]`` uint8: FlashMLA's sparse (DeepSeek V3.2) cache, as vLLM writes it. Bytes 0-511
    latent e4m3, 512-527 four fp32 descales, one per 128 latent dims (``GROUP``), 528-655 RoPE as 64 bf16. The
    writer here makes each group's descale the power of two just above its amax / 448, as ``"fp8_rope_bf16"``
    does for the whole row.

One 656-byte cache, two readings: ``"fp8_rope_bf16"`` reads the first descale for the whole row (what fp8mla's
writer stores, all four slots equal), ``"fp8_ds_mla"`` reads all four. A cache fp8mla wrote reads the same
either way; a cache whose group descales differ (another writer's) is only right as ``"fp8_ds_mla"``. A uint8
656-wide cache is taken as ``"fp8_rope_bf16"`` by the dense call and as ``"fp8_ds_mla"`` by the sparse call
(``indices``) unless ``kv_format`` names it; ``validate=True`` rejects an ``"fp8_rope_bf16"`` reading of a cache
whose descales differ.
"""
from __future__ import annotations

import torch

PAGE_SIZE = 64
D_LATENT = 512  # also head_dim_v
D_ROPE = 64
D_QK = D_LATENT + D_ROPE
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn

# fp8_rope_bf16 / fp8_ds_mla row layout, in bytes
ROW_BYTES = 656
SCALE_OFFSET = 512
ROPE_OFFSET = 528
GROUP = 128                  # latent dims per fp8_ds_mla descale
GROUPS = D_LATENT // GROUP   # descales per row (four fp32 slots at SCALE_OFFSET)

KV_FORMATS = ("bf16", "fp8", "fp8_rope_bf16", "fp8_ds_mla")
TOKEN_SCALED = ("fp8_ds_mla", "fp8_rope_bf16")   # the 656-byte formats (descales in each row): the sparse call's readings
_ROW_WIDTH = {"bf16": D_QK, "fp8": D_QK, "fp8_rope_bf16": ROW_BYTES, "fp8_ds_mla": ROW_BYTES}
_ROW_DTYPE = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE, "fp8_rope_bf16": torch.uint8, "fp8_ds_mla": torch.uint8}


def infer_kv_format(k_cache: torch.Tensor, kv_format: str | None = None, sparse: bool = False) -> str:
    """The cache's format: ``kv_format`` when given (checked against the tensor), else from dtype and width (a
    656-byte cache: ``"fp8_ds_mla"`` for the sparse call, ``"fp8_rope_bf16"`` otherwise)."""
    if kv_format is None:
        if sparse and k_cache.dtype == torch.uint8 and k_cache.shape[-1] == ROW_BYTES:
            return "fp8_ds_mla"
        for name, dtype in _ROW_DTYPE.items():
            if k_cache.dtype == dtype and k_cache.shape[-1] == _ROW_WIDTH[name]:
                return name
        raise TypeError(
            f"cannot infer the KV-cache format from dtype {k_cache.dtype} and row width {k_cache.shape[-1]}: "
            f"expected bf16 [.., 576], float8_e4m3fn [.., 576] or uint8 [.., {ROW_BYTES}] (fp8_rope_bf16)")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    want_dtype, want_width = _ROW_DTYPE[kv_format], _ROW_WIDTH[kv_format]
    if k_cache.dtype != want_dtype or k_cache.shape[-1] != want_width:
        raise TypeError(f"kv_format {kv_format!r} needs a {want_dtype} cache with rows of {want_width}, "
                        f"got {k_cache.dtype} rows of {k_cache.shape[-1]}")
    return kv_format


def empty_kv_cache(num_pages: int, kv_format: str, device=None) -> torch.Tensor:
    """An uninitialised paged cache of ``num_pages`` pages in ``kv_format``."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    return torch.empty(num_pages, PAGE_SIZE, 1, _ROW_WIDTH[kv_format], dtype=_ROW_DTYPE[kv_format], device=device)


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, descale)`` with descale = amax / 448 (NaNs ignored for the amax, kept in the values)."""
    amax = x.detach().abs().float().nan_to_num(0.0).amax().clamp(min=1e-12)
    descale = (amax / FP8_MAX).reshape(1)
    return _to_fp8(x.float() / descale), descale


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even and saturate, as the GPU's cvt.rn.satfinite does."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def token_descale(amax: torch.Tensor) -> torch.Tensor:
    """The ``fp8_rope_bf16`` descale for a latent vector of largest magnitude ``amax``: the power of two just
    above ``amax / 448`` (``frexp``'s 2**exponent), 1 for an all-zero vector."""
    pow2 = torch.ldexp(torch.ones_like(amax), torch.frexp(amax / FP8_MAX).exponent)
    return torch.where(amax > 0, pow2, torch.ones_like(amax))


def _pack_rows(latent: torch.Tensor, rope: torch.Tensor, groups: int) -> torch.Tensor:
    """656-byte rows from ``latent [..., 512]`` and ``rope [..., 64]``, the latent part in ``groups`` equal groups
    of dims with a descale each (token_descale of the group's amax), the four descale slots filled in turn."""
    latent = latent.float().unflatten(-1, (groups, D_LATENT // groups))
    descale = token_descale(latent.abs().amax(dim=-1, keepdim=True))   # [..., groups, 1]
    rows = torch.empty(*latent.shape[:-2], ROW_BYTES, dtype=torch.uint8, device=latent.device)
    rows[..., :SCALE_OFFSET] = _to_fp8(latent / descale).flatten(-2).view(torch.uint8)
    slots = descale.flatten(-2).repeat_interleave(GROUPS // groups, dim=-1)   # [..., 4]
    rows[..., SCALE_OFFSET:ROPE_OFFSET] = slots.contiguous().view(torch.uint8)
    rows[..., ROPE_OFFSET:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return rows


def pack_fp8_rope_bf16(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rows of the ``fp8_rope_bf16`` format from ``latent [..., 512]`` and ``rope [..., 64]``."""
    return _pack_rows(latent, rope, 1)


def pack_fp8_ds_mla(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rows of the ``fp8_ds_mla`` format: a descale per 128 latent dims."""
    return _pack_rows(latent, rope, GROUPS)


def unpack_fp8_rope_bf16(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(latent_fp8, descale fp32 [..., 1], rope bf16)`` views of ``fp8_rope_bf16`` rows."""
    latent, descales, rope = unpack_fp8_ds_mla(rows)
    return latent, descales[..., :1], rope


def unpack_fp8_ds_mla(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(latent_fp8, descales fp32 [..., 4], rope bf16)`` of 656-byte rows."""
    latent = rows[..., :SCALE_OFFSET].view(FP8_DTYPE)
    descales = rows[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    rope = rows[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return latent, descales, rope


def quantize_kv_cache(kv: torch.Tensor, kv_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Convert a ``[num_pages, 64, 1, 576]`` bf16/fp32 cache into ``kv_format``.

    Returns ``(k_cache, descale_k)``; ``descale_k`` is the per-tensor ``[1]`` scale for ``"fp8"`` and None for
    the formats that keep their scales inside the cache (or need none).
    """
    if kv.dim() != 4 or kv.shape[1] != PAGE_SIZE or kv.shape[2] != 1 or kv.shape[3] != D_QK:
        raise ValueError(f"kv must be [num_pages, {PAGE_SIZE}, 1, {D_QK}], got {list(kv.shape)}")
    if kv_format == "bf16":
        return kv.to(torch.bfloat16).contiguous(), None
    if kv_format == "fp8":
        return quantize_fp8_per_tensor(kv)
    if kv_format == "fp8_rope_bf16":
        return pack_fp8_rope_bf16(kv[..., :D_LATENT], kv[..., D_LATENT:]), None
    if kv_format == "fp8_ds_mla":
        return pack_fp8_ds_mla(kv[..., :D_LATENT], kv[..., D_LATENT:]), None
    raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")


def dequantize_kv_cache(k_cache: torch.Tensor, descale_k: torch.Tensor | None = None,
                        kv_format: str | None = None) -> torch.Tensor:
    """The fp32 ``[num_pages, 64, 1, 576]`` values a cache of any format stands for."""
    kv_format = infer_kv_format(k_cache, kv_format)
    if kv_format == "bf16":
        return k_cache.float()
    if kv_format == "fp8":
        if descale_k is None:
            raise ValueError("the 'fp8' format needs descale_k")
        return k_cache.float() * descale_k.float()
    if kv_format == "fp8_rope_bf16":
        latent, descale, rope = unpack_fp8_rope_bf16(k_cache)
        return torch.cat([latent.float() * descale, rope.float()], dim=-1)
    latent, descales, rope = unpack_fp8_ds_mla(k_cache)
    scaled = latent.float().unflatten(-1, (GROUPS, GROUP)) * descales[..., None]
    return torch.cat([scaled.flatten(-2), rope.float()], dim=-1)
