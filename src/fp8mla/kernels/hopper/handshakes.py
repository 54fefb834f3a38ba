"""The handshakes between a Hopper CTA's warpgroups: mbarriers, and the shared-memory buffers they guard.

Every kernel has a softmax warpgroup (Q.K^T, online softmax) and two PV warpgroups (each owns 256 of O's 512
columns); the FP8 kernels' PV warpgroups first transpose V into V^T (FP8 wgmma wants its B operand K-major). A
waiter's phase is (position // buffers) & 1, positions counted across requests (ring positions for the page slots,
P positions for the P buffers, finished requests for the epilogue).

  barrier          arrivals                                          waited by
  ring.ready[s]    TMA byte count of the page in slot s (gather      every warpgroup that reads the page
                   ring: 128, the issuing warpgroup's threads as
                   their cp.async copies land)
  ring.empty[s]    3: softmax WG after the page's Q.K^T, each PV      the TMA issuer, before it refills slot s
                   WG after its transpose (bf16: after its P.V)
  p_ready[b]       1: softmax WG wrote P and alpha into buffer b      both PV WGs
  p_free[b]        2: each PV WG after the P.V wgmma that read b      the softmax WG, before it writes b again
  epi_ready        1: softmax WG wrote the request's O scale (norm)   both PV WGs, at the request's end
  epi_free         2: each PV WG read it                              the softmax WG, at the next request's end
  q_ready          2: each PV WG quantized its half of a bf16 q's     the softmax WG, at the request's start
                   rows (fp8.py, a bf16 q)

Who issues the TMA loads: the softmax warpgroup (fp8.py, between its pages' products), a load warp of its own
(small.py), the left PV warpgroup right after its P.V (bf16.py). The bf16 kernel splits ring.ready by 128-column
groups of the page (bf16.py) and has one P buffer.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..triton_compat import aggregate
from .ablations import SKIP_P_STORE
from .ring import FLAG_SMEM, gather_arrivals

P_BUFFERS = gl.constexpr(2)   # P and alpha are double-buffered in the FP8 kernels (but fp8.py's fp8_ds_mla reading)


@aggregate
class Handoff:
    """The softmax warpgroup's hand-offs to the PV warpgroups: each page's P and the rows' rescale factor alpha
    (as many buffers as p_ready has: P_BUFFERS, or 1; p_ready / p_free), and each request's O scale
    per row, norm (epi_ready / epi_free)."""
    p: gl.shared_memory_descriptor
    alpha: gl.shared_memory_descriptor
    norm: gl.shared_memory_descriptor
    p_ready: gl.shared_memory_descriptor
    p_free: gl.shared_memory_descriptor
    epi_ready: gl.shared_memory_descriptor
    epi_free: gl.shared_memory_descriptor

    @triton.constexpr_function
    def __init__(self, p, alpha, norm, p_ready, p_free, epi_ready, epi_free):
        self.p = p
        self.alpha = alpha
        self.norm = norm
        self.p_ready = p_ready
        self.p_free = p_free
        self.epi_ready = epi_ready
        self.epi_free = epi_free

    @gluon.jit
    def put_p(self, p, group_units, alpha, pt, TOKEN_AXIS: gl.constexpr, ABLATE: gl.constexpr = 0):
        """P position pt's P (to e4m3) and alpha into buffer pt % (its buffers), once the PV warpgroups are done
        with what was there. group_units: () or fp8_ds_mla's token scales of each latent group (a tuple of
        p_groups), for a P a group, p times them (buffer b's group g is self.p[b * p_groups + g]), made one at a
        time (all at once, 32 rows' spill). TOKEN_AXIS: p's token axis (1; 0 for the small-rows kernel's P^T): P
        is stored [rows, tokens]. ABLATE: ablations.SKIP_P_STORE leaves a one-tile P unwritten."""
        BUFFERS: gl.constexpr = self.p_ready.shape[0]
        pb = pt % BUFFERS
        mbarrier.wait(self.p_free.index(pb), ((pt // BUFFERS) & 1) ^ 1)
        if len(group_units) == 0:
            if not ABLATE & SKIP_P_STORE:
                self.p.index(pb).store(_p_tile(p, TOKEN_AXIS))
        for g in gl.static_range(len(group_units)):
            self.p.index(pb * len(group_units) + g).store(
                _p_tile(p * gl.expand_dims(group_units[g], 1 - TOKEN_AXIS), TOKEN_AXIS))
        self.alpha.index(pb).store(alpha)
        fence_async_shared()
        mbarrier.arrive(self.p_ready.index(pb))

    @gluon.jit
    def wait_p(self, pt, layout: gl.constexpr):
        """A PV warpgroup's end of put_p: waits until P position pt's P is in buffer pt % (its buffers);
        returns its alpha."""
        BUFFERS: gl.constexpr = self.p_ready.shape[0]
        pb = pt % BUFFERS
        mbarrier.wait(self.p_ready.index(pb), (pt // BUFFERS) & 1)
        return self.alpha.index(pb).load(layout)

    @gluon.jit
    def free_p(self, pb):
        """A PV warpgroup's P.V that read P buffer pb is done: it may be written again."""
        mbarrier.arrive(self.p_free.index(pb))

    @gluon.jit
    def take_norm(self, n_req, layout: gl.constexpr):
        """Request n_req's O scale per row (a PV warpgroup's end of softmax.softmax_epilogue's hand-off)."""
        mbarrier.wait(self.epi_ready, n_req & 1)
        norm = self.norm.load(layout)
        mbarrier.arrive(self.epi_free)
        return norm


@gluon.jit
def _p_tile(p, TOKEN_AXIS: gl.constexpr):
    """p as e4m3, [rows, tokens]."""
    p = p.to(gl.float8e4nv)
    if TOKEN_AXIS == 0:
        p = gl.permute(p, (1, 0))
    return p


@gluon.jit
def init_barriers(RING: gl.constexpr, GATHER_WARPS: gl.constexpr = 0, P_BUFS: gl.constexpr = P_BUFFERS):
    """The FP8 kernels' mbarriers (the table above), initialised: ring ready / empty [RING], p_ready / p_free
    [P_BUFS], epi_ready, epi_free; and the ring's bad-page flags [RING, words]. GATHER_WARPS: 0 for a TMA ring
    (ready: the issuer's one expect; one flag word a slot), else the gather ring's issuing warps (ready: their
    threads, each as its copies land; a flag word a warp)."""
    READY_ARRIVALS: gl.constexpr = gather_arrivals(GATHER_WARPS) if GATHER_WARPS else 1
    FLAG_WORDS: gl.constexpr = GATHER_WARPS if GATHER_WARPS else 1
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_l)
    kv_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], bar_l)
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    epi_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    for i in gl.static_range(RING):
        mbarrier.init(kv_ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(kv_empty.index(i), count=3)   # softmax WG after Q.K^T, each PV WG after its transpose
    for i in gl.static_range(P_BUFS):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=2)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=2)
    bad = gl.allocate_shared_memory(gl.int32, [RING, FLAG_WORDS], FLAG_SMEM)
    return kv_ready, kv_empty, p_ready, p_free, epi_ready, epi_free, bad
