"""The PV warpgroups' V transpose: FP8 wgmma wants its B operand K-major, and a page's latent tile [64 tokens, 512
dims] is dim-major, so each PV warpgroup transposes its half into V^T [256 dims, 64 tokens] in shared memory.

V^T rows are stored in a permuted dim order that makes both the LDSM reads and the 16-byte stores bank-conflict
free; the epilogue relabels O's registers (or, in small.py, O^T's rows) back to dim order.

In fp8.py's fp8_ds_mla reading the transposes also fold each latent group's descales into V: a token's bytes of
group g times its scale of g over its largest (a power of two at most 1 in caches FlashMLA's writer made: exact
but where the product falls below e4m3's normal range), so that P.V takes one P, in each token's largest scale, as
the fp8_rope_bf16 reading does. A V_CHUNK is one latent group.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..constants import PAGE_SIZE
from ..triton_compat import barrier
from .ablations import SKIP_TRANSPOSE
from .layouts import HALF, SCALE_COLS, V_CHUNK, dim_bit as _d, token_bit as _t
from .ring import advance


# A [64 tokens, 128 dims] chunk of V as read for the transpose: each thread holds 4 dims x 16 tokens, so the LDSM
# reads and (after the dim relabel) the 16-byte stores are both bank-conflict free.
V_LOAD = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[_d(0), _d(1), _t(0), _t(1), _t(2), _t(3)],
                                                 lane_bases=[_d(2), _d(3), _d(4), _d(5), _d(6)],
                                                 warp_bases=[_t(4), _t(5)], block_bases=[], shape=[64, 128]))


# A page's scale tile [64 tokens, SCALE_COLS], 4 consecutive tokens' scales a thread (16 lanes of each warp hold
# them, the rest repeat them)
SCALE_QUADS = gl.constexpr(gl.BlockedLayout([4, SCALE_COLS.value], [16, 2], [4, 1], [1, 0]))
# a latent group's descale below this share of its token's largest adds nothing an fp32 score keeps (2^-32); the
# group products' rescaling divides by it instead of a zero
GROUP_FLOOR = gl.constexpr(2.3283064365386963e-10)
# the rows of a page's entry in the group table (GROUP_ROWS a page parity): the rescalings of the two chains of
# group products (0 -> 1, 2 -> 3) and of the first chain's sum into the second's unit, that unit, each token's
# largest descale
RESCALE, UNIT, TOP, GROUP_ROWS = gl.constexpr(0), gl.constexpr(3), gl.constexpr(4), gl.constexpr(5)


@gluon.jit
def _group_factors(scale_tile, groups, pb, WG: gl.constexpr):
    """fp8_ds_mla: groups = (fac, table, table_ready). Into fac, each token's scale of latent group 2 WG + c (this
    warpgroup's) over its largest of the four (0 for a token not gathered: its scales zero-filled), as fp16 pairs:
    fac[4 pb + 2 c + h][i] holds tokens 4 i + 2 h and 4 i + 2 h + 1, the pairs a transposed word's two halves take
    (_transpose_chunk). The left warpgroup also fills the softmax warpgroup's group table for the page (its rows
    GROUP_ROWS pb + RESCALE..TOP; fp8._grouped_scores), off the softmax's chain; the caller's barrier, then its
    arrival on table_ready[pb], publish it."""
    fac, table, table_ready = groups
    d = scale_tile.load(SCALE_QUADS)
    d_max = gl.max(d, axis=1)
    first, second = gl.split(gl.permute(gl.reshape(d, [PAGE_SIZE, 2, 2]), (0, 2, 1)))   # groups 0-1, 2-3
    if WG == 0:
        pair = first
    else:
        pair = second
    d_max = gl.convert_layout(d_max, gl.SliceLayout(1, pair.type.layout))   # (each thread's own tokens)
    if WG == 0:
        d0, d1 = gl.split(first)
        d2, d3 = gl.split(second)
        floor = d_max * GROUP_FLOOR
        d1 = gl.maximum(d1, floor)
        d2 = gl.maximum(d2, floor)
        d3 = gl.maximum(d3, floor)
        rows = (d0 / d1, d2 / d3, d1 / d3, d3, d_max)
        for j in gl.static_range(GROUP_ROWS):
            table.index(GROUP_ROWS * pb + j).store(rows[j])
    f = gl.where(d_max[:, None] > 0, pair / gl.maximum(d_max, 1e-30)[:, None], 0.0).to(gl.float16)
    for c in gl.static_range(2):
        # [64] -> [16 quads, 2 halves, 2 tokens], all of a quad in the thread's registers
        g = gl.reshape(gl.split(f)[c], [PAGE_SIZE // 4, 2, 2])
        even, odd = gl.split(g)
        word = ((even.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF)
                | (odd.to(gl.int16, bitcast=True).to(gl.int32) << 16))
        lo_pair, hi_pair = gl.split(word)
        fac.index(4 * pb + 2 * c).store(lo_pair)
        fac.index(4 * pb + 2 * c + 1).store(hi_pair)


# 4 words of 4 dims of tokens 4i .. 4i + 3 -> 4 words of those tokens, one dim each ($0-$3 from $4-$7)
TRANSPOSE = """
    prmt.b32 lo01, $4, $5, 0x5140;
    prmt.b32 hi01, $4, $5, 0x7362;
    prmt.b32 lo23, $6, $7, 0x5140;
    prmt.b32 hi23, $6, $7, 0x7362;
    prmt.b32 $0, lo01, lo23, 0x5410;
    prmt.b32 $1, lo01, lo23, 0x7632;
    prmt.b32 $2, hi01, hi23, 0x5410;
    prmt.b32 $3, hi01, hi23, 0x7632;
"""


@triton.constexpr_function
def _transpose_asm(mask, scale):
    """The transposes' inline asm and its constraints: TRANSPOSE; with scale, each output word's 4 tokens times
    their factors (fp16 pairs $A: tokens 4i, 4i + 1, $B: 4i + 2, 4i + 3; exact for powers of two, rounded to e4m3
    again); with mask, ANDed with 0xFFFFFFFF >> $S (operands in that order). A 32-bit operand takes 4 registers
    (pack=4), all the same."""
    args = 8
    asm = "{ .reg .b32 lo01, hi01, lo23, hi23, m, fl, fh; .reg .b16 l, h;" + TRANSPOSE
    if scale:
        a, b = args, args + 4
        args += 8
        for k in range(4):
            asm += (f"mov.b32 {{l, h}}, ${k}; cvt.rn.f16x2.e4m3x2 fl, l; cvt.rn.f16x2.e4m3x2 fh, h; "
                    f"mul.rn.f16x2 fl, fl, ${a}; mul.rn.f16x2 fh, fh, ${b}; cvt.rn.satfinite.e4m3x2.f16x2 l, fl; "
                    f"cvt.rn.satfinite.e4m3x2.f16x2 h, fh; mov.b32 ${k}, {{l, h}};\n")
    if mask:
        asm += f"shr.b32 m, 0xFFFFFFFF, ${args};\n" + "".join(f"and.b32 ${k}, ${k}, m;\n" for k in range(4))
        args += 4
    return asm + "}"


@triton.constexpr_function
def _transpose_constraints(mask, scale):
    return ",".join(["=r"] * 4 + ["r"] * (4 + 8 * scale + 4 * mask))


@gluon.jit
def _transpose_chunk(src, dst, valid_tokens, MASK: gl.constexpr, fac=None, pb=0, c: gl.constexpr = 0):
    """dst[n, t] = src[t, d(n)] for a [64, 128] e4m3 chunk, d(n) = (n & 0xE0) | ((n & 7) << 2) | ((n >> 3) & 3);
    tokens >= valid_tokens become 0 if MASK. fac: None, or (fp8_ds_mla) _group_factors' buffers, of which page
    parity pb's group c scales the chunk's tokens.

    The 4x4 byte transposes are 8 PRMT per 4 words (inline asm; each asm operand is the 32-bit word holding 4
    consecutive dims of one token). Every reshape/permute/split/join here only relabels registers.
    """
    # (token // 4, dim, token bit 1, bit 0): split on its last two axes, the asm's input words, 4 tokens each
    x = gl.permute(gl.reshape(src.load(V_LOAD), [PAGE_SIZE // 4, 2, 2, V_CHUNK]), (0, 3, 1, 2))
    xa, xb = gl.split(x)
    x0, x2 = gl.split(xa)
    x1, x3 = gl.split(xb)
    quads: gl.constexpr = gl.SliceLayout(1, x0.type.layout)
    args = (x0, x1, x2, x3)
    if fac is not None:
        args = args + (gl.expand_dims(fac.index(4 * pb + 2 * c).load(quads), 1),
                       gl.expand_dims(fac.index(4 * pb + 2 * c + 1).load(quads), 1))
    if MASK:  # cache slots past the sequence end may hold anything, NaN included, and P * NaN = NaN: each output
        # word (tokens 4i .. 4i + 3) keeps the bytes of tokens < valid_tokens, ANDed with 0xFFFFFFFF >> shift,
        # shift = 32 - 8 * clamp(valid_tokens - 4i, 0, 4) (no predicate per token: those cost the PV warpgroups
        # registers)
        word = gl.arange(0, PAGE_SIZE // 4, quads)
        args = args + (gl.expand_dims(32 - 8 * gl.minimum(gl.maximum(valid_tokens - 4 * word, 0), 4), 1), )
    y0, y1, y2, y3 = gl.inline_asm_elementwise(_transpose_asm(MASK, fac is not None),
                                               _transpose_constraints(MASK, fac is not None), list(args),
                                               dtype=(gl.float8e4nv, gl.float8e4nv, gl.float8e4nv, gl.float8e4nv),
                                               is_pure=True, pack=4)
    # y_j[i, 4q + e] = V[4i + e, 4q + j]
    w = gl.join(gl.join(y0, y1), gl.join(y2, y3))
    w = gl.permute(gl.reshape(w, [16, V_CHUNK // 4, 4, 2, 2]), (0, 2, 1, 4, 3))
    z = gl.reshape(w, [PAGE_SIZE, V_CHUNK])                                    # z[token, dim]
    z = gl.reshape(gl.permute(gl.reshape(z, [PAGE_SIZE, V_CHUNK // 32, 8, 4]), (0, 1, 3, 2)),
                   [PAGE_SIZE, V_CHUNK])                                       # dim relabel
    dst.store(gl.permute(z, (1, 0)))


@gluon.jit
def _transpose_page(ring, vt, pos, valid, WG: gl.constexpr, ABLATE: gl.constexpr, fac=None):
    """This warpgroup's half of ring position pos's latent tile -> V^T buffer pos % 2 (tokens >= valid as 0);
    then releases the slot. fac: None, or (fp8_ds_mla) _group_factors' groups."""
    RING: gl.constexpr = ring.lat.shape[0]
    s = pos % RING
    ring.wait(pos)
    if fac is not None:   # (a buffer a page: a thread passes this barrier only once done with the page before)
        _group_factors(ring.scale.index(s), fac, pos % 2, WG)
        barrier()
        if WG == 0:   # (one arrival, the warpgroup's: every thread's table entries are in)
            mbarrier.arrive(fac[2].index(pos % 2))
    if not ABLATE & SKIP_TRANSPOSE:
        for c in gl.static_range(HALF // V_CHUNK):
            src = ring.lat.index(s).slice(WG * HALF + c * V_CHUNK, V_CHUNK, dim=1)
            dst = vt.index(2 * WG + pos % 2).slice(c * V_CHUNK, V_CHUNK, dim=0)
            f = fac
            if fac is not None:
                f = fac[0]
            if valid < PAGE_SIZE:
                _transpose_chunk(src, dst, valid, True, f, pos % 2, c)
            else:
                _transpose_chunk(src, dst, valid, False, f, pos % 2, c)
    fence_async_shared()
    ring.release(pos)


@gluon.jit
def transpose_next(ring, vt, pos, part, cursor, WG: gl.constexpr, ABLATE: gl.constexpr = 0, fac=None):
    """A PV warpgroup's transpose cursor (ring.advance): if it is on a page, that page's V^T half into ring
    position pos's buffer, and the cursor one page on. fac: _transpose_page's."""
    req, blk, ok, seqlen, hi = cursor
    if ok:
        _transpose_page(ring, vt, pos, seqlen - blk * PAGE_SIZE, WG, ABLATE, fac)
        cursor = advance(part, cursor)
    return cursor
