"""The Hopper kernel for the bf16 cache format. The schedule, the three warpgroups and their handshakes are fp8.py's;
what bf16 changes:

- no V^T: BF16 wgmma takes an N-contiguous B operand, so each PV warpgroup multiplies P straight by its half of
  the page's latent tile in the ring, and holds the ring slot until its P.V is done;
- shared memory: q (72 KB), two ring slots of a whole page (2 x 72 KB) and one P buffer fill 224 of the 227 KB;
- so page i + 2 can only arrive after P.V of page i. The left PV warpgroup issues the TMA loads right when its
  P.V is done, and the softmax warpgroup runs a page's softmax as soon as its Q.K^T is done (fp8.py instead
  overlaps it with the next page's Q.K^T: here that would put the P.V and the load behind the next Q.K^T);
- cache slots past a sequence's end may hold NaN, and 0 * NaN = NaN in P.V: on a request's last page each PV
  warpgroup zeroes those rows of its half of the tile (fp8.py's transposes do it on the way);
- a page arrives by TMA in 64-column boxes, each 128-column group (and the RoPE part) completing a barrier of
  its own (ready[slot, group]), so that Q.K^T starts on a page's first group while the rest is still on its way.
  P and alpha have one buffer, so their phase is the page position's parity.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..constants import D_LATENT, D_ROPE, METADATA_WIDTH, PAGE_SIZE
from ..triton_compat import reinterpret, tma_load
from .ablations import HALF_LOADS, SKIP_REFILLS, SKIP_RESCALE, SKIP_SOFTMAX
from .epilogue import pv_epilogue
from .handshakes import Handoff
from .layouts import (BLOCK_M, HALF, LAT_BF16_SMEM, LEFT, O_ACC_BF16, PV_REGS, RIGHT, ROPE_BF16_SMEM, S_BF16,
                      VEC_SMEM)
from .operands import Q_AS_IS, load_q
from .ring import (FLAG_SMEM, get_flag, load_cursor_start, load_cursor_step, open_part, page_index, planned_for,
                   put_flag, request_range)
from .softmax import key_limits, online_softmax, softmax_epilogue

STAGES = gl.constexpr(2)     # ring slots, a whole page each
K_BOX = gl.constexpr(64)     # latent columns per TMA box (a 128-byte swizzle span of bf16)
K_GROUP = gl.constexpr(128)  # latent columns per arrival barrier: Q.K^T starts on a page's first group
N_BOXES = gl.constexpr(D_LATENT // K_BOX)
N_GROUPS = gl.constexpr(D_LATENT // K_GROUP)   # then one barrier more, for the RoPE part
ZERO_CHUNK = gl.constexpr(64)  # V columns zeroed at a time
ZERO_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                          order=[1, 0]))


@gluon.jit
def _group_ready(kv_ready, s, group):
    """kv_ready[ring slot s, group]: a 128-column latent group's barrier (group N_GROUPS: the RoPE part's)."""
    return kv_ready.index(s * (N_GROUPS + 1) + group)


@gluon.jit
def _load_page(descs, table, ring, page, pos, ABLATE: gl.constexpr = 0):
    """TMA the block-table entry `page` into ring position pos, once the page before it there is released: its
    latent part in 128-column groups, each signalling its own barrier (ready[slot, group]), then its RoPE part.
    ring: (latent boxes, RoPE tiles, ready, empty, bad-page flags: ring.py)."""
    lat_desc, rope_desc = descs
    k_boxes, k_rope, kv_ready, kv_empty, bad = ring
    s = pos % STAGES
    mbarrier.wait(kv_empty.index(s), ((pos // STAGES) & 1) ^ 1)
    page, outside = page_index(table, page)
    put_flag(bad.index(s), outside)   # before the arrivals that publish the slot
    BOXES: gl.constexpr = K_GROUP // K_BOX
    for g in gl.static_range(N_GROUPS):
        ready = _group_ready(kv_ready, s, g)
        if ABLATE & HALF_LOADS:
            mine = g // 2 == gl.program_id(1) % 2
        else:
            mine = True
        if mine:
            mbarrier.expect(ready, BOXES * lat_desc.block_type.nbytes)
            for b in gl.static_range(BOXES):
                box = g * BOXES + b
                tma_load(lat_desc, [page * PAGE_SIZE, box * K_BOX], ready, k_boxes.index(s * N_BOXES + box))
        else:
            mbarrier.arrive(ready)
    ready = _group_ready(kv_ready, s, N_GROUPS)
    mbarrier.expect(ready, rope_desc.block_type.nbytes)
    tma_load(rope_desc, [page * PAGE_SIZE, 0], ready, k_rope.index(s))


@gluon.jit
def _fake_load(ring, pos):
    """ablations.SKIP_REFILLS: ring position pos's slot completes at once (every group), keeping its page."""
    k_boxes, k_rope, kv_ready, kv_empty, bad = ring
    s = pos % STAGES
    mbarrier.wait(kv_empty.index(s), ((pos // STAGES) & 1) ^ 1)
    for g in gl.static_range(N_GROUPS + 1):
        mbarrier.arrive(_group_ready(kv_ready, s, g))


@gluon.jit
def _softmax_page(hand, sc, blk, limits, m_i, l_i, it, sm_scale_log2, ABLATE: gl.constexpr):
    """Online softmax of one page's scores; hands P (bf16) and the row rescale factor to the PV warpgroups.
    Returns the new (m, l)."""
    if ABLATE & SKIP_SOFTMAX:
        p, alpha, m_new = sc, gl.full_like(m_i, 1.0), m_i
    else:
        p, alpha, m_new, l_i = online_softmax(sc, blk, limits, m_i, l_i, sm_scale_log2, P_LOG2=0.0)   # plain units
    mbarrier.wait(hand.p_free, (it & 1) ^ 1)
    hand.p.store(p.to(gl.bfloat16))
    hand.alpha.store(alpha)
    fence_async_shared()
    mbarrier.arrive(hand.p_ready)
    return m_new, l_i


@gluon.jit
def _softmax_wg(query, shape, sched, lse_outs, sm_scale_log2, q_smem, ring, hand, CAUSAL: gl.constexpr,
                ABLATE: gl.constexpr):
    """query: (q_ptr, its strides of b, s, h); shape: (h_q, s_q); ring: (latent [slot, page, 512], RoPE, ready,
    empty, bad-page flags)."""
    q_ptr, stride_qb, stride_qs, stride_qh = query
    H, S_Q = shape
    q_lat, q_rope = q_smem
    k_lat, k_rope, kv_ready, kv_empty, bad_pages = ring
    R = H * S_Q
    q_boxes = reinterpret(q_lat, gl.bfloat16, [N_BOXES, BLOCK_M, K_BOX], LAT_BF16_SMEM)   # [box] = its columns
    k_boxes = reinterpret(k_lat, gl.bfloat16, [STAGES * N_BOXES, PAGE_SIZE, K_BOX], LAT_BF16_SMEM)
    row_l: gl.constexpr = gl.SliceLayout(1, S_BF16)
    rows = gl.program_id(1) * BLOCK_M + gl.arange(0, BLOCK_M, row_l)
    s_idx = rows // H
    part = open_part(sched)
    begin_req = part[3]
    it = 0       # pages consumed (ring position)
    n_req = 0    # requests finished (epilogue barrier phase)
    for req in tl.range(begin_req, part[4] + 1, disable_licm=True):  # nothing hoisted: fewer spilled values
        seqlen, lo, hi = request_range(part, req)
        if lo < hi:
            load_q((q_ptr + req * stride_qb, stride_qs, stride_qh, H, R), q_lat, q_rope, Q_AS_IS)
            limits = key_limits(seqlen, s_idx, S_Q, CAUSAL)
            bad = not planned_for(part, req, seqlen)   # or, below, a page outside the cache
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
            l_i = gl.zeros([BLOCK_M], gl.float32, row_l)
            for blk in range(lo, hi):
                s = it % STAGES
                phase = (it // STAGES) & 1
                # each 128-column group's product as soon as its boxes are in (the page arrives group by group)
                acc = gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_BF16)
                for box in gl.static_range(N_BOXES):
                    if box % (K_GROUP // K_BOX) == 0:
                        mbarrier.wait(_group_ready(kv_ready, s, box // (K_GROUP // K_BOX)), phase)
                    acc = warpgroup_mma(q_boxes.index(box), k_boxes.index(s * N_BOXES + box).permute((1, 0)), acc,
                                        use_acc=box > 0, is_async=True)
                mbarrier.wait(_group_ready(kv_ready, s, N_GROUPS), phase)
                acc = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc, q_lat, q_rope, k_lat.index(s), k_rope.index(s)])[0]
                bad |= get_flag(bad_pages.index(s))
                mbarrier.arrive(kv_empty.index(s))
                m_i, l_i = _softmax_page(hand, acc, blk, limits, m_i, l_i, it, sm_scale_log2, ABLATE)
                it += 1

            # ---- a request's end: 1 / l to the PV warpgroups; lse ----
            softmax_epilogue(1.0, m_i, l_i, rows, req, begin_req, bad, (H, S_Q, R), sm_scale_log2, sched, lse_outs,
                             hand, n_req, P_LOG2=0.0)
            n_req += 1


@gluon.jit
def _zero_tail(v, valid):
    """Rows (tokens) >= valid of this warpgroup's [64, 256] V tile -> 0."""
    tok = gl.arange(0, PAGE_SIZE, gl.SliceLayout(1, ZERO_LOAD))[:, None]
    for c in gl.static_range(HALF // ZERO_CHUNK):
        chunk = v.slice(c * ZERO_CHUNK, ZERO_CHUNK, dim=1)
        x = chunk.load(ZERO_LOAD)
        chunk.store(gl.where(tok < valid, x, gl.zeros_like(x)))
    fence_async_shared()


@gluon.jit
def _pv_wg(descs, table, shape, sched, outs, ring, hand, WG: gl.constexpr, ABLATE: gl.constexpr):
    """O[:, 256 WG : 256 (WG + 1)] for every page of the part; the left warpgroup also loads the pages."""
    H, S_Q = shape
    k_lat, k_rope, kv_ready, kv_empty, bad = ring
    R = H * S_Q
    k_boxes = reinterpret(k_lat, gl.bfloat16, [STAGES * N_BOXES, PAGE_SIZE, K_BOX], LAT_BF16_SMEM)
    load_ring = (k_boxes, k_rope, kv_ready, kv_empty, bad)
    part = open_part(sched)
    begin_req = part[3]
    if WG == LEFT:  # the TMA cursor runs STAGES pages ahead, across requests (see fp8.py)
        load_cursor, load_page = load_cursor_start(part, table)
        loaded = 0
        while (loaded < STAGES) & load_cursor[2]:  # not unrolled (see fp8.py)
            _load_page(descs, table, load_ring, load_page, loaded, ABLATE)
            loaded += 1
            load_cursor, load_page = load_cursor_step(part, table, load_cursor)
    it = 0
    n_req = 0
    for req in tl.range(begin_req, part[4] + 1, disable_licm=True):  # see fp8.py
        seqlen, lo, hi = request_range(part, req)
        if lo < hi:
            o = gl.zeros([BLOCK_M, HALF], gl.float32, O_ACC_BF16)
            for blk in range(lo, hi):
                s = it % STAGES
                v = k_lat.index(s).slice(WG * HALF, HALF, dim=1)   # [64 tokens, 256 dims]: P.V's B operand
                for g in gl.static_range(HALF // K_GROUP):   # this half's column groups are in
                    mbarrier.wait(_group_ready(kv_ready, s, WG * (HALF // K_GROUP) + g), (it // STAGES) & 1)
                mbarrier.wait(hand.p_ready, it & 1)   # also: the softmax warpgroup's Q.K^T of the page is done
                if (blk + 1) * PAGE_SIZE > seqlen:
                    _zero_tail(v, seqlen - blk * PAGE_SIZE)
                alpha = hand.alpha.load(gl.SliceLayout(1, O_ACC_BF16))
                if not ABLATE & SKIP_RESCALE:
                    o = o * alpha[:, None]
                o = warpgroup_mma(hand.p, v, o, is_async=True)
                o = warpgroup_mma_wait(0, deps=[o, hand.p, v])[0]
                mbarrier.arrive(hand.p_free)
                mbarrier.arrive(kv_empty.index(s))
                it += 1
                if WG == LEFT:
                    if load_cursor[2]:  # the slot's next page: waits for the right warpgroup's P.V of this one
                        if ABLATE & SKIP_REFILLS:
                            _fake_load(load_ring, loaded)
                        else:
                            _load_page(descs, table, load_ring, load_page, loaded, ABLATE)
                        loaded += 1
                        load_cursor, load_page = load_cursor_step(part, table, load_cursor)

            # ---- a request's end: O times 1 / l -> out (a request with one split) or its partial slot ----
            pv_epilogue((o, ), req, begin_req, R, sched, outs, hand, n_req, WG, False)
            n_req += 1


@gluon.jit
def mla_decode_hopper_bf16_kernel(
        q_ptr, stride_qb, stride_qs, stride_qh, lat_desc, rope_desc, block_table_ptr, stride_bt, max_pages, num_pages,
        seqlens_ptr, meta_ptr, num_splits_ptr, B, SLOTS, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, sm_scale_log2, H,
        S_Q, CAUSAL: gl.constexpr, ABLATE: gl.constexpr):
    meta = meta_ptr + gl.program_id(0) * METADATA_WIDTH
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D_LATENT], LAT_BF16_SMEM)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D_ROPE], ROPE_BF16_SMEM)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE_SIZE, D_LATENT], LAT_BF16_SMEM)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE_SIZE, D_ROPE], ROPE_BF16_SMEM)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, PAGE_SIZE], ROPE_BF16_SMEM)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC_SMEM)
    norm_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC_SMEM)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES * (N_GROUPS + 1), 1], bar_l)   # [slot, group]
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    epi_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    for i in gl.static_range(STAGES * (N_GROUPS + 1)):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_empty.index(i), count=3)   # softmax WG after Q.K^T, each PV WG after its P.V
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=2)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=2)
    bad = gl.allocate_shared_memory(gl.int32, [STAGES, 1], FLAG_SMEM)
    ring = (k_lat, k_rope, kv_ready, kv_empty, bad)
    hand = Handoff(p_smem, alpha_smem, norm_smem, p_ready, p_free, epi_ready, epi_free)
    sched = (meta, seqlens_ptr, max_pages, num_splits_ptr, B, SLOTS)
    gl.warp_specialize([
        (_softmax_wg, ((q_ptr, stride_qb, stride_qs, stride_qh), (H, S_Q), sched, (lse_ptr, lse_part_ptr),
                       sm_scale_log2, (q_lat, q_rope), ring, hand, CAUSAL, ABLATE)),
        (_pv_wg, ((lat_desc, rope_desc), (block_table_ptr, stride_bt, num_pages), (H, S_Q), sched,
                  (out_ptr, o_part_ptr), ring, hand, LEFT, ABLATE)),
        (_pv_wg, ((lat_desc, rope_desc), (block_table_ptr, stride_bt, num_pages), (H, S_Q), sched,
                  (out_ptr, o_part_ptr), ring, hand, RIGHT, ABLATE)),
    ], [4, 4], [PV_REGS, PV_REGS])
