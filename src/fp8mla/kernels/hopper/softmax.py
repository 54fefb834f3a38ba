"""The softmax warpgroup's arithmetic: each page's online-softmax step, P's hand-off to the PV warpgroups, and a
request's end (its O scale and lse).

Scores and the running max m stay unscaled (softmax_scale > 0, checked by the API): the scale goes into the
exp2's FFMA, and so does P's unit. FP8 P is in units of 1 / 448 (P_LOG2 = log2 448: p up to 448 fills e4m3's range
without a multiply per element); fp8_rope_bf16's P is also multiplied by each token's V scale over the page's
largest (the V unit), folded back into O at the request's end. The 64-row kernels hold scores as S [rows, tokens];
small.py holds S^T [tokens, rows] (TOKEN_AXIS says which axis holds the tokens).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..constants import FP8, FP8_DS_MLA, FP8_ROPE_BF16, LN2, PAGE_SIZE
from ..triton_compat import barrier
from .ablations import SKIP_SOFTMAX
from .ring import split_slot


@gluon.jit
def key_limits(seqlen, s_idx, S_Q, CAUSAL: gl.constexpr):
    """The request's limits: (each query row's key limit, the smallest of them); causal query token s (s_idx) sees keys
    [0, seqlen - (S_Q - 1 - s)), bottom-right aligned; without CAUSAL every row sees [0, seqlen)."""
    if CAUSAL:
        key_limit = gl.minimum(seqlen - (S_Q - 1 - s_idx), seqlen)
        min_key_limit = seqlen - (S_Q - 1)
    else:
        key_limit = gl.zeros_like(s_idx) + seqlen
        min_key_limit = seqlen
    return key_limit, min_key_limit


@gluon.jit
def score_scale_log2(sm_scale_log2, descale_q_ptr, descale_k_ptr, KV_FORMAT: gl.constexpr, Q_FP8: gl.constexpr):
    """The scores' exp2 scale: softmax_scale * log2(e), times the "fp8" format's per-tensor descales, which multiply
    every score."""
    if KV_FORMAT == FP8:
        sm_scale_log2 = sm_scale_log2 * gl.load(descale_k_ptr)
        if Q_FP8:
            sm_scale_log2 = sm_scale_log2 * gl.load(descale_q_ptr)
    return sm_scale_log2


@gluon.jit
def token_scales(scale_tile, blk, seqlen, LOAD: gl.constexpr, TOK: gl.constexpr, KV_FORMAT: gl.constexpr):
    """fp8_rope_bf16: page blk's per-token scales (column 0 of its [64, SCALE_COLS] tile), read with LOAD straight
    into TOK, the scores' token layout; 0 past the sequence's end, whose slots may hold NaN. fp8_ds_mla: the four
    columns, a scale per latent group (a tuple, in group order). Other formats: 1."""
    if KV_FORMAT >= FP8_ROPE_BF16:
        even, odd = gl.split(scale_tile.load(LOAD).reshape([PAGE_SIZE, 2, 2]))   # columns (0, 2), (1, 3)
        c0, c2 = gl.split(even)
        k_scale = _in_sequence(gl.convert_layout(c0, TOK, assert_trivial=True), blk, seqlen)
        if KV_FORMAT == FP8_DS_MLA:
            c1, c3 = gl.split(odd)
            k_scale = (k_scale, _in_sequence(gl.convert_layout(c1, TOK, assert_trivial=True), blk, seqlen),
                       _in_sequence(gl.convert_layout(c2, TOK, assert_trivial=True), blk, seqlen),
                       _in_sequence(gl.convert_layout(c3, TOK, assert_trivial=True), blk, seqlen))
    else:
        k_scale = gl.full([PAGE_SIZE], 1.0, gl.float32, TOK)
    return k_scale


@gluon.jit
def _in_sequence(k_scale, blk, seqlen):
    """Page blk's token scales, 0 past the sequence's end."""
    if (blk + 1) * PAGE_SIZE > seqlen:
        tok = blk * PAGE_SIZE + gl.arange(0, PAGE_SIZE, k_scale.type.layout)
        k_scale = gl.where(tok < seqlen, k_scale, 0.0)
    return k_scale


@gluon.jit
def no_scales(TOK: gl.constexpr, KV_FORMAT: gl.constexpr):
    """token_scales' form, all 1 (a request's first page's "page before")."""
    ones = gl.full([PAGE_SIZE], 1.0, gl.float32, TOK)
    if KV_FORMAT == FP8_DS_MLA:
        return (ones, ones, ones, ones)
    else:
        return ones


@gluon.jit
def largest_scale(k_scale, KV_FORMAT: gl.constexpr):
    """Each token's largest scale (token_scales'; fp8_ds_mla: over its four groups)."""
    if KV_FORMAT == FP8_DS_MLA:
        return gl.maximum(gl.maximum(k_scale[0], k_scale[1]), gl.maximum(k_scale[2], k_scale[3]))
    else:
        return k_scale


@gluon.jit
def mask_keys(sc, blk, limits, TOKEN_AXIS: gl.constexpr):
    """Scores sc of the keys [n blk, n (blk + 1)) (n tokens on TOKEN_AXIS, query rows on the other) with the keys a
    row must not see (limits: key_limits) at -inf. Only steps with such keys pay for the mask, which also drops NaN
    slots past the sequence's end."""
    key_limit, min_key_limit = limits
    N: gl.constexpr = sc.shape[TOKEN_AXIS]
    if (blk + 1) * N > min_key_limit:
        tok = blk * N + gl.arange(0, N, gl.SliceLayout(1 - TOKEN_AXIS, sc.type.layout))
        sc = gl.where(gl.expand_dims(tok, 1 - TOKEN_AXIS) < gl.expand_dims(key_limit, TOKEN_AXIS), sc,
                      float("-inf"))
    return sc


@gluon.jit
def exp_step(sc, m_i, m_new, sm_scale_log2, P_LOG2: gl.constexpr, TOKEN_AXIS: gl.constexpr):
    """(p, alpha) of an online softmax step, given the rows' new max m_new: p in units of 2^-P_LOG2, base 2; a row
    that has seen no key yet keeps m = -inf and p = 0."""
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc * sm_scale_log2 - gl.expand_dims(m_safe * sm_scale_log2 - P_LOG2, TOKEN_AXIS))
    alpha = gl.exp2((m_i - m_safe) * sm_scale_log2)
    return p, alpha


@gluon.jit
def softmax_step(sc, blk, limits, m_i, sm_scale_log2, P_LOG2: gl.constexpr):
    """One step of online softmax over scores sc [rows, n tokens] of the keys [n blk, n (blk + 1)): (p, alpha,
    new m), p in units of 2^-P_LOG2 (exp_step); the row sums are the caller's (online_softmax)."""
    sc = mask_keys(sc, blk, limits, 1)
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    p, alpha = exp_step(sc, m_i, m_new, sm_scale_log2, P_LOG2, 1)
    return p, alpha, m_new


@gluon.jit
def online_softmax(sc, blk, limits, m_i, l_i, sm_scale_log2, P_LOG2: gl.constexpr):
    """softmax_step and the rows' sums: (p, alpha, new m, new l), l in P's units."""
    p, alpha, m_new = softmax_step(sc, blk, limits, m_i, sm_scale_log2, P_LOG2)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def hand_p(hand, p, alpha, k_scale, scale_max, v_unit, pt, TOKEN_AXIS: gl.constexpr, KV_FORMAT: gl.constexpr,
           ABLATE: gl.constexpr = 0):
    """A page's P, as e4m3, and the rows' rescale factor to the PV warpgroups (P position pt); returns the V unit
    the page's P is in. p comes in units of 1 / 448; for fp8_rope_bf16 it is times each token's V scale in units of
    the page's largest scale (scale_max), so e4m3 keeps its whole range; fp8 has one unit throughout. fp8_ds_mla
    hands a P a latent group, each times its group's token scales in that unit."""
    group_units = ()
    if KV_FORMAT >= FP8_ROPE_BF16:
        page_unit = gl.maximum(scale_max, 1e-30)
        if KV_FORMAT == FP8_DS_MLA:
            per_unit = 1.0 / page_unit
            group_units = (k_scale[0] * per_unit, k_scale[1] * per_unit, k_scale[2] * per_unit, k_scale[3] * per_unit)
        else:
            p = p * gl.expand_dims(k_scale * (1.0 / page_unit), 1 - TOKEN_AXIS)
    else:
        page_unit = v_unit
    alpha = alpha * (v_unit / page_unit)
    hand.put_p(p, group_units, alpha, pt, TOKEN_AXIS, ABLATE)
    return page_unit


@gluon.jit
def o_scale(v_unit, descale_k_ptr, KV_FORMAT: gl.constexpr):
    """What O is multiplied by at a request's end, besides 1 / l (P and l share their unit, 1 / 448): the V scale,
    the "fp8" format's per-tensor descale or fp8_rope_bf16's current page unit."""
    if KV_FORMAT == FP8:
        scale = gl.load(descale_k_ptr)
    else:
        scale = v_unit
    return scale


# ---- the 64-row kernels' S [rows, tokens] ----
ROW_LANES = gl.constexpr(4)


@gluon.jit
def lane_sums(p, L_LANES: gl.constexpr):
    """Each thread's sum of the tokens it holds in each of its rows of p [64 rows, 64 tokens] (S_FP8): [64, 4]."""
    x = gl.reshape(p, [p.shape[0], 8, ROW_LANES, 2])   # token bits 3-5 (registers), 1-2 (lanes), 0 (registers)
    return gl.convert_layout(gl.sum(gl.sum(x, axis=3), axis=1), L_LANES, assert_trivial=True)


@gluon.jit
def softmax_page(page, blk, limits, state, pt, sm_scale_log2, hand, P_LOG2: gl.constexpr, L_LANES: gl.constexpr,
                 KV_FORMAT: gl.constexpr, ABLATE: gl.constexpr):
    """Online softmax of page blk: page = (its scores S [rows, tokens], its token scales, their largest); hands P
    and the row rescale factor to the PV warpgroups (P position pt). state: the request's (m, per-lane row sums,
    V unit), returned updated."""
    sc, k_scale, scale_max = page
    m_i, l_lanes, v_unit = state
    if ABLATE & SKIP_SOFTMAX:
        p, alpha, m_new = sc, gl.full_like(m_i, 1.0), m_i
    else:
        p, alpha, m_new = softmax_step(sc, blk, limits, m_i, sm_scale_log2, P_LOG2)
    alpha_lanes = gl.convert_layout(alpha, gl.SliceLayout(1, L_LANES), assert_trivial=True)
    l_lanes = l_lanes * alpha_lanes[:, None] + lane_sums(p, L_LANES)
    page_unit = hand_p(hand, p, alpha, k_scale, scale_max, v_unit, pt, 1, KV_FORMAT, ABLATE)
    return m_new, l_lanes, page_unit


# ---- small.py's S^T [tokens, rows] ----
@triton.constexpr_function
def warp_rows_layout(rows):
    """[4 warps, rows]: every thread holds the four warps' values of the query rows it holds in S^T (wgmma
    accumulator: row bit 0 and bits 3+ in registers, bits 1-2 in lanes 0-1), so a max over the warps is in-thread
    and leaves S^T's own row layout."""
    row_regs = [[0, 1]] + [[0, r] for r in (8, 16) if r < rows]
    return gl.DistributedLinearLayout(reg_bases=row_regs + [[1, 0], [2, 0]],
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, rows])


@gluon.jit
def page_max_t(sc, k_scale, red, red_scale, pt, KV_FORMAT: gl.constexpr):
    """(each query row's max score, the largest token scale, fp8_ds_mla's over the groups) of the page of S^T.
    Tokens span the four warps: each warp reduces its 16, and the warps meet in shared memory at one barrier
    (double-buffered by page, so a warp a page ahead cannot overwrite what another still reads)."""
    ROWS: gl.constexpr = sc.shape[1]
    buf = red.index(pt % 2)
    buf.store(gl.max(gl.reshape(sc, [4, PAGE_SIZE // 4, ROWS]), axis=1))
    if KV_FORMAT >= FP8_ROPE_BF16:
        red_scale.index(pt % 2).store(gl.max(gl.reshape(largest_scale(k_scale, KV_FORMAT), [4, PAGE_SIZE // 4]),
                                             axis=1))
    barrier()
    m = gl.convert_layout(gl.max(buf.load(warp_rows_layout(ROWS)), axis=0), gl.SliceLayout(0, sc.type.layout),
                          assert_trivial=True)
    if KV_FORMAT >= FP8_ROPE_BF16:
        scale_max = gl.max(red_scale.index(pt % 2).load(gl.BlockedLayout([4], [32], [4], [0])), axis=0)
    else:
        scale_max = 1.0
    return m, scale_max


@gluon.jit
def softmax_page_t(page, blk, limits, state, pt, sm_scale_log2, hand, red, red_scale, P_LOG2: gl.constexpr,
                   KV_FORMAT: gl.constexpr):
    """softmax_page on S^T (page = (S^T, its token scales)): rows are tokens, columns query rows; P^T goes to
    shared memory as P [rows, 64] (tokens contiguous: P.V's B operand). The row sums stay per thread (state's
    l_acc, S^T's shape) until the request's end: a sum over tokens would cost the page another meeting of the
    warps."""
    sc, k_scale = page
    m_i, l_acc, v_unit = state
    sc = mask_keys(sc, blk, limits, 0)
    page_max, scale_max = page_max_t(sc, k_scale, red, red_scale, pt, KV_FORMAT)
    m_new = gl.maximum(m_i, page_max)
    p, alpha = exp_step(sc, m_i, m_new, sm_scale_log2, P_LOG2, 0)
    l_acc = l_acc * alpha[None, :] + p
    page_unit = hand_p(hand, p, alpha, k_scale, scale_max, v_unit, pt, 0, KV_FORMAT)
    return m_new, l_acc, page_unit


# ---- a request's end ----
@gluon.jit
def softmax_epilogue(scale, m_i, l_i, rows, req, begin_req, bad, shape, sm_scale_log2, sched, lse_outs, hand, n_req,
                     P_LOG2: gl.constexpr, sparse=None, GATHER: gl.constexpr = False, HAS_SINK: gl.constexpr = False):
    """The softmax warpgroup's end of a request: scale / l per row to the PV warpgroups (request n_req's hand-off;
    epilogue.pv_epilogue takes it), and the lse to the output's lse (a request with one split) or to its partial
    slot; both NaN if the request is bad (ring.py). l is in P's units, 2^-P_LOG2. shape: (h_q, s_q, s_q * h_q);
    lse_outs: (lse_ptr, lse_part_ptr). A sparse call (GATHER; sparse: (Q_GROUP, topk_length_ptr, sink_ptr)): the
    request is a query token, its lse strided by Q_GROUP in lse [b, h_q, s_q], and with HAS_SINK a request of one
    split has its attention sink in the O scale (a split one gets it in the combine)."""
    H, S_Q, R = shape
    lse_ptr, lse_part_ptr = lse_outs
    seen = l_i > 0
    if HAS_SINK:   # a request of one split: exp(lse) / (exp(lse) + exp(sink)) per row
        lse = gl.where(seen, (m_i * sm_scale_log2 + gl.log2(l_i) - P_LOG2) * LN2, float("inf"))
        sink = gl.load(sparse[2] + rows % H, mask=rows < R, other=0.0)
        sink_scale = gl.where(split_slot(sched, req, begin_req)[0], 1.0 / (1.0 + gl.exp(sink - lse)), 1.0)
    mbarrier.wait(hand.epi_free, (n_req & 1) ^ 1)
    norm = gl.where(seen, scale / l_i, 0.0)
    if HAS_SINK:
        norm = norm * sink_scale
    hand.norm.store(gl.where(bad, float("nan"), norm))
    mbarrier.arrive(hand.epi_ready)
    direct, split, owned = split_slot(sched, req, begin_req)
    lse = gl.where(seen, (m_i * sm_scale_log2 + gl.log2(l_i) - P_LOG2) * LN2, float("inf"))
    row_ok = rows < R
    if direct:
        if GATHER:   # (S_Q 1: rows are heads)
            entry = req // sparse[0]
            lse_row = lse_ptr + entry * (R * sparse[0]) + (req - entry * sparse[0]) + rows * sparse[0]
        else:
            lse_row = lse_ptr + req * R + (rows % H) * S_Q + rows // H
        gl.store(lse_row, gl.where(bad, float("nan"), lse), mask=row_ok)
    else:
        lse = gl.where(bad, float("nan"), gl.where(seen, lse, float("-inf")))
        gl.store(lse_part_ptr + split.to(gl.int64) * R + rows, lse, mask=row_ok & owned)
