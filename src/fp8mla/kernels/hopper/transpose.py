"""The PV warpgroups' V transpose: FP8 wgmma wants its B operand K-major, and a page's latent tile [64 tokens, 512
dims] is dim-major, so each PV warpgroup transposes its half into V^T [256 dims, 64 tokens] in shared memory.

V^T rows are stored in a permuted dim order that makes both the LDSM reads and the 16-byte stores bank-conflict
free; the epilogue relabels O's registers (or, in small.py, O^T's rows) back to dim order.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from ..constants import PAGE_SIZE
from .ablations import SKIP_TRANSPOSE
from .layouts import HALF, V_CHUNK, dim_bit as _d, token_bit as _t
from .ring import advance


# A [64 tokens, 128 dims] chunk of V as read for the transpose: each thread holds 4 dims x 16 tokens, so the LDSM
# reads and (after the dim relabel) the 16-byte stores are both bank-conflict free.
V_LOAD = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_d(0), _d(1), _t(0), _t(1), _t(2), _t(3)],
                                                 lane_bases=[_d(2), _d(3), _d(4), _d(5), _d(6)],
                                                 warp_bases=[_t(4), _t(5)], block_bases=[], shape=[64, 128]))


@gluon.jit
def _transpose_chunk(src, dst, valid_tokens, MASK: gl.constexpr):
    """dst[n, t] = src[t, d(n)] for a [64, 128] e4m3 chunk, d(n) = (n & 0xE0) | ((n & 7) << 2) | ((n >> 3) & 3);
    tokens >= valid_tokens become 0 if MASK.

    The 4x4 byte transposes are 8 PRMT per 4 words (inline asm; each asm operand is the 32-bit word holding 4
    consecutive dims of one token). Every reshape/permute/split/join here only relabels registers.
    """
    # (token // 4, dim, token bit 1, bit 0): split on its last two axes, the asm's input words, 4 tokens each
    x = gl.permute(gl.reshape(src.load(V_LOAD), [PAGE_SIZE // 4, 2, 2, V_CHUNK]), (0, 3, 1, 2))
    xa, xb = gl.split(x)
    x0, x2 = gl.split(xa)
    x1, x3 = gl.split(xb)
    # 4 words of 4 dims of tokens 4i .. 4i + 3 -> 4 words of those tokens, one dim each
    TRANSPOSE: gl.constexpr = """
        prmt.b32 lo01, $4, $5, 0x5140;
        prmt.b32 hi01, $4, $5, 0x7362;
        prmt.b32 lo23, $6, $7, 0x5140;
        prmt.b32 hi23, $6, $7, 0x7362;
        prmt.b32 $0, lo01, lo23, 0x5410;
        prmt.b32 $1, lo01, lo23, 0x7632;
        prmt.b32 $2, hi01, hi23, 0x5410;
        prmt.b32 $3, hi01, hi23, 0x7632;
        """
    if MASK:  # cache slots past the sequence end may hold anything, NaN included, and P * NaN = NaN: each output
        # word (tokens 4i .. 4i + 3) keeps the bytes of tokens < valid_tokens, ANDed with 0xFFFFFFFF >> shift,
        # shift = 32 - 8 * clamp(valid_tokens - 4i, 0, 4) (no predicate per token: those cost the PV warpgroups
        # registers)
        word = gl.arange(0, PAGE_SIZE // 4, gl.SliceLayout(1, x0.type.layout))
        shift = gl.expand_dims(32 - 8 * gl.minimum(gl.maximum(valid_tokens - 4 * word, 0), 4), 1)
        y0, y1, y2, y3 = gl.inline_asm_elementwise(
            "{ .reg .b32 lo01, hi01, lo23, hi23, m;" + TRANSPOSE + """
            shr.b32 m, 0xFFFFFFFF, $8;
            and.b32 $0, $0, m;
            and.b32 $1, $1, m;
            and.b32 $2, $2, m;
            and.b32 $3, $3, m;
            }""", "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [x0, x1, x2, x3, shift],
            dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
    else:
        y0, y1, y2, y3 = gl.inline_asm_elementwise(
            "{ .reg .b32 lo01, hi01, lo23, hi23;" + TRANSPOSE + "}", "=r,=r,=r,=r,r,r,r,r", [x0, x1, x2, x3],
            dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
    # y_j[i, 4q + e] = V[4i + e, 4q + j]
    w = gl.join(gl.join(y0, y1), gl.join(y2, y3))
    w = gl.permute(gl.reshape(w, [16, V_CHUNK // 4, 4, 2, 2]), (0, 2, 1, 4, 3))
    z = gl.reshape(w, [PAGE_SIZE, V_CHUNK])                                    # z[token, dim]
    z = gl.reshape(gl.permute(gl.reshape(z, [PAGE_SIZE, V_CHUNK // 32, 8, 4]), (0, 1, 3, 2)),
                   [PAGE_SIZE, V_CHUNK])                                       # dim relabel
    dst.store(gl.permute(z, (1, 0)))


@gluon.jit
def _transpose_page(ring, vt, pos, valid, WG: gl.constexpr, ABLATE: gl.constexpr):
    """This warpgroup's half of ring position pos's latent tile -> V^T buffer pos % 2 (tokens >= valid as 0);
    then releases the slot."""
    RING: gl.constexpr = ring.lat.shape[0]
    s = pos % RING
    ring.wait(pos)
    if not ABLATE & SKIP_TRANSPOSE:
        for c in gl.static_range(HALF // V_CHUNK):
            src = ring.lat.index(s).slice(WG * HALF + c * V_CHUNK, V_CHUNK, dim=1)
            dst = vt.index(2 * WG + pos % 2).slice(c * V_CHUNK, V_CHUNK, dim=0)
            if valid < PAGE_SIZE:
                _transpose_chunk(src, dst, valid, True)
            else:
                _transpose_chunk(src, dst, valid, False)
    fence_async_shared()
    ring.release(pos)


@gluon.jit
def transpose_next(ring, vt, pos, part, cursor, WG: gl.constexpr, ABLATE: gl.constexpr = 0):
    """A PV warpgroup's transpose cursor (ring.advance): if it is on a page, that page's V^T half into ring
    position pos's buffer, and the cursor one page on."""
    req, blk, ok, seqlen, hi = cursor
    if ok:
        _transpose_page(ring, vt, pos, seqlen - blk * PAGE_SIZE, WG, ABLATE)
        cursor = advance(part, cursor)
    return cursor
