"""Stages the 64-row Hopper kernels (fp8.py, bf16.py) can skip, to measure what each costs
(``scripts/hopper_check.py --ablate``). The kernels' ABLATE constexpr is a sum of these flags, 0 in every real
call (launch.ABLATE); an ablated kernel's results are wrong, it is only timed."""
from triton.experimental.gluon import language as gl

SKIP_SOFTMAX = gl.constexpr(1)     # P = the raw scores, alpha = 1: no row max, exp or row sums
SKIP_TRANSPOSE = gl.constexpr(2)   # V^T left as it was: no transposes (fp8.py)
SKIP_RESCALE = gl.constexpr(4)     # O = O + P.V instead of O * alpha + P.V
SKIP_REFILLS = gl.constexpr(8)     # the ring's first pages only: each refill completes its slot at once, no bytes
SKIP_P_STORE = gl.constexpr(16)    # P not written to shared memory (its hand-off's barriers and alpha kept; fp8.py)
HALF_LOADS = gl.constexpr(32)      # bf16.py: row block r loads only latent groups 2r, 2r + 1 (and the RoPE part) of
                                   # each page, the others complete at once: a request's pair of row blocks reads
                                   # each page about once, as one TMA multicast a pair would

# the host's view (hopper_check --ablate), as ints: the flags each kernel implements (any other leaves it as it is,
# so it is not timed there), and what --ablate times (all, or those named); the skeleton: the ring, the wgmmas and
# the hand-offs alone
_SKELETON = SKIP_SOFTMAX.value | SKIP_TRANSPOSE.value | SKIP_RESCALE.value
FP8_FLAGS = _SKELETON | SKIP_REFILLS.value | SKIP_P_STORE.value
BF16_FLAGS = SKIP_SOFTMAX.value | SKIP_RESCALE.value | SKIP_REFILLS.value | HALF_LOADS.value
ABLATIONS = {"no softmax math": SKIP_SOFTMAX.value, "no transposes": SKIP_TRANSPOSE.value,
             "no rescale": SKIP_RESCALE.value, "skeleton": _SKELETON, "no refills": SKIP_REFILLS.value,
             "skeleton without refills": _SKELETON | SKIP_REFILLS.value, "no P store": SKIP_P_STORE.value,
             "half loads": HALF_LOADS.value}
