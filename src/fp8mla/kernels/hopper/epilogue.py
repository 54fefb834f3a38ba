"""A PV warpgroup's end of a request: its O columns times the softmax warpgroup's per-row O scale, stored to out
(a request with one split: bf16, in place) or to the request's partial slot for the combine (kernels/combine.py).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from ..constants import D_LATENT
from .layouts import BLOCK_M, HALF, O_GROUP, V_CHUNK
from .ring import split_slot


@gluon.jit
def pieces_wait(o):
    """A PV warpgroup's O (or O^T) pieces, a tuple of one or two accumulators, once their P.V is done."""
    if len(o) == 1:
        return (warpgroup_mma_wait(0, deps=[o[0]]), )
    else:
        return warpgroup_mma_wait(0, deps=[o[0], o[1]])


@gluon.jit
def pv_epilogue(o, req, begin_req, R, sched, outs, hand, n_req, WG: gl.constexpr, VT_ORDER: gl.constexpr):
    """The 64-row kernels: this warpgroup's [64, 256] O (a tuple of its pieces: one accumulator, or two [64, 128]
    halves) times the request's O scale (hand.norm), to out or to its partial slot (store_o). outs:
    (out_ptr, o_part_ptr)."""
    out_ptr, o_part_ptr = outs
    norm = hand.take_norm(n_req, gl.SliceLayout(1, O_GROUP))   # O's rows, held as the accumulator holds them
    direct, split, owned = split_slot(sched, req, begin_req)
    rows = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, O_GROUP))
    out_row = out_ptr + (req * R + rows).to(gl.int64) * D_LATENT + WG * HALF
    part_row = o_part_ptr + (split.to(gl.int64) * R + rows) * D_LATENT + WG * HALF
    ok = (rows < R) & owned
    if len(o) == 1:   # (a [64, 256] accumulator as its two [64, 128] halves: a register relabel)
        o = gl.split(gl.permute(gl.reshape(o[0], [BLOCK_M, 2, HALF // 2]), (0, 2, 1)))
    for h in gl.static_range(2):
        _store_half(out_row, part_row, direct, o[h], h * (HALF // 2), norm, ok, VT_ORDER)


@gluon.jit
def _store_half(out_row, part_row, direct, o, col0: gl.constexpr, norm, ok, VT_ORDER: gl.constexpr):
    """A [64, 128] half of this warpgroup's O, columns col0.., times norm (per row): to out (bf16) if direct, else
    to its partial slot (bf16 for the FP8 formats, fp32 for bf16: the store casts), at X_row[row] + dim. One
    32-column group a (column 32a + n) at a time, so few registers are in flight.
    VT_ORDER: O's columns are in V^T's permuted dim order (see _store_group)."""
    x = gl.permute(gl.reshape(o, [BLOCK_M, 2, 2, 32]), (0, 3, 2, 1))   # [row, n, a bit 0, bit 1]
    x0, x1 = gl.split(x)
    g0, g1 = gl.split(x0)
    g2, g3 = gl.split(x1)
    _store_group(out_row, part_row, direct, g0, col0, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g1, col0 + 32, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g2, col0 + 64, norm, ok, VT_ORDER)
    _store_group(out_row, part_row, direct, g3, col0 + 96, norm, ok, VT_ORDER)


@gluon.jit
def _store_group(out_row, part_row, direct, g, col0: gl.constexpr, norm, ok, VT_ORDER: gl.constexpr):
    """One 32-column group. With VT_ORDER its accumulator column 8b + 2q + e holds V dim 8q + 4e + b (V^T's row
    order), so a register relabel puts each thread's 8 dims in order for 16-byte stores; without, column n is dim
    n and each thread stores pairs of dims. Row vectors come in SliceLayout(1, O_GROUP), which holds O's rows as
    the accumulator does (converting them moves nothing)."""
    if VT_ORDER:
        g = gl.reshape(gl.permute(gl.reshape(g, [BLOCK_M, 4, 4, 2]), (0, 2, 3, 1)), [BLOCK_M, 32])
        g = gl.convert_layout(g, O_GROUP, assert_trivial=True)
    layout: gl.constexpr = g.type.layout
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    g = g * gl.convert_layout(norm, row_l, assert_trivial=True)[:, None]
    ok = gl.convert_layout(ok, row_l, assert_trivial=True)[:, None]
    cols = (col0 + gl.arange(0, 32, gl.SliceLayout(0, layout)))[None, :]
    if direct:
        gl.store(gl.convert_layout(out_row, row_l, assert_trivial=True)[:, None] + cols, g.to(gl.bfloat16), mask=ok)
    else:
        gl.store(gl.convert_layout(part_row, row_l, assert_trivial=True)[:, None] + cols, g, mask=ok)


@gluon.jit
def pv_epilogue_t(o, req, begin_req, R, sched, outs, hand, n_req, WG: gl.constexpr):
    """small.py: this warpgroup's O^T [256 dims, ROWS] (a tuple of pieces, each its next rows) times the request's O
    scale, to out or to its partial slot. O^T row n holds V dim WG * 256 + the transposes' d(n)
    (transpose._transpose_chunk)."""
    out_ptr, o_part_ptr = outs
    ROWS: gl.constexpr = o[0].shape[1]
    M: gl.constexpr = o[0].shape[0]
    OT: gl.constexpr = o[0].type.layout
    norm = hand.take_norm(n_req, gl.SliceLayout(0, OT))
    direct, split, owned = split_slot(sched, req, begin_req)
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(0, OT))
    ok = ((rows < R) & owned)[None, :]
    for i in gl.static_range(len(o)):
        n = i * M + gl.arange(0, M, gl.SliceLayout(1, OT))
        c = n % V_CHUNK
        dim = WG * HALF + (n - c) + ((c & 0xE0) | ((c & 7) << 2) | ((c >> 3) & 3))
        piece = o[i] * norm[None, :]
        if direct:
            gl.store(out_ptr + (req * R + rows).to(gl.int64)[None, :] * D_LATENT + dim[:, None],
                     piece.to(gl.bfloat16), mask=ok)
        else:
            gl.store(o_part_ptr + (split.to(gl.int64) * R + rows)[None, :] * D_LATENT + dim[:, None], piece,
                     mask=ok)
