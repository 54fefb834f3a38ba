"""The Hopper kernels' tile constants and the layouts they share: shared-memory tiles (NVMMA swizzles the wgmma
reads) and register layouts (wgmma accumulators, and linear layouts chosen so that a conversion between them moves
no data). Layouts one kernel alone uses are in its module."""
from triton.experimental.gluon import language as gl

BLOCK_M = gl.constexpr(64)    # query rows per CTA of the 64-row kernels (one wgmma M)
HALF = gl.constexpr(256)      # output columns per PV warpgroup
LEFT, RIGHT = gl.constexpr(0), gl.constexpr(1)  # the PV warpgroups' halves
PV_REGS = gl.constexpr(168)   # registers per thread: 65536 / 384, every warpgroup gets the same
# fp8_rope_bf16's PV warpgroups give 8 registers each to the softmax warpgroup (168 + 16 = 184), which holds the
# BF16 RoPE product's own accumulator: without them ptxas keeps a request's value in local memory
ROPE_PV_REGS = gl.constexpr(160)
STAGES = gl.constexpr(2)      # KV pages in flight per CTA (the ring's slots) in the 64-row kernels
Q_CHUNK = gl.constexpr(128)   # q columns copied at a time
V_CHUNK = gl.constexpr(128)   # V dims transposed at a time
SCALE_COLS = gl.constexpr(4)  # fp32 columns TMA fetches from each token's scale (16 bytes: TMA's narrowest box)


def token_bit(i):  # token (or O row) bit i of a [64, n] register layout's basis
    return [1 << i, 0]


def dim_bit(i):  # dim (column) bit i
    return [0, 1 << i]


# ---- shared memory ----
LAT_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))  # [64, 512] e4m3
LAT_BF16_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
ROPE_FP8_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
ROPE_BF16_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
SCALE_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))  # [64, 4] fp32
VT_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))  # [256, 64] e4m3
P_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))  # [64, 64] e4m3
VEC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))

# ---- registers ----
Q_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                       order=[1, 0]))
# S [64 rows, 64 tokens] of the fp8 wgmma (k = 32); it converts to S_BF16's (k = 16) for free
S_FP8 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
S_BF16 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32]))
O_ACC_BF16 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
# One 32-column group of O in dim order (see epilogue.store_group): each thread's 8 consecutive dims in register
# order, so the stores vectorize; these are the registers O_ACC holds the group in, so converting to it moves nothing.
O_GROUP = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[dim_bit(0), dim_bit(1), dim_bit(2), token_bit(3)],
    lane_bases=[dim_bit(3), dim_bit(4), token_bit(0), token_bit(1), token_bit(2)],
    warp_bases=[token_bit(4), token_bit(5)], block_bases=[], shape=[64, 32]))
