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

# the flags each kernel implements (any other leaves it as it is: hopper_check --ablate does not time it there)
FP8_FLAGS = gl.constexpr(SKIP_SOFTMAX | SKIP_TRANSPOSE | SKIP_RESCALE | SKIP_REFILLS | SKIP_P_STORE)
BF16_FLAGS = gl.constexpr(SKIP_SOFTMAX | SKIP_RESCALE | SKIP_REFILLS | HALF_LOADS)

# what hopper_check --ablate times (all, or those named); the skeleton: the ring, the wgmmas and the hand-offs alone
ABLATIONS = {"no softmax math": 1, "no transposes": 2, "no rescale": 4, "skeleton": 7, "no refills": 8,
             "skeleton without refills": 15, "no P store": 16, "half loads": 32}
