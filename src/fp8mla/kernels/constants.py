"""The format and schedule numbers of formats.py / schedule.py as ``tl.constexpr``, for use inside kernels."""
import math

import triton.language as tl

from .. import formats, schedule

PAGE_SIZE = tl.constexpr(formats.PAGE_SIZE)
D_LATENT = tl.constexpr(formats.D_LATENT)
D_ROPE = tl.constexpr(formats.D_ROPE)
D_QK = tl.constexpr(formats.D_QK)
FP8_MAX = tl.constexpr(formats.FP8_MAX)
LOG2_FP8_MAX = tl.constexpr(math.log2(formats.FP8_MAX))  # P in units of 1 / 448: see online_softmax
ROW_BYTES = tl.constexpr(formats.ROW_BYTES)
SCALE_OFFSET = tl.constexpr(formats.SCALE_OFFSET)
ROPE_OFFSET = tl.constexpr(formats.ROPE_OFFSET)
GROUP = tl.constexpr(formats.GROUP)
GROUPS = tl.constexpr(formats.GROUPS)

METADATA_WIDTH = tl.constexpr(schedule.METADATA_WIDTH)
BEGIN_REQ = tl.constexpr(schedule.BEGIN_REQ)
BEGIN_PAGE = tl.constexpr(schedule.BEGIN_PAGE)
END_REQ = tl.constexpr(schedule.END_REQ)
END_PAGE = tl.constexpr(schedule.END_PAGE)
BEGIN_SPLIT = tl.constexpr(schedule.BEGIN_SPLIT)
BEGIN_REQ_PAGES = tl.constexpr(schedule.BEGIN_REQ_PAGES)
END_REQ_PAGES = tl.constexpr(schedule.END_REQ_PAGES)
PLANNED_ROWS = tl.constexpr(schedule.PLANNED_ROWS)
FIXED_COST = tl.constexpr(schedule.FIXED_COST)
COMBINE_STEP_PAGES = tl.constexpr(schedule.COMBINE_STEP_PAGES)

# KV_FORMAT codes the kernels specialise on (codes >= FP8_ROPE_BF16: the 656-byte rows that carry their descales)
BF16 = tl.constexpr(0)
FP8 = tl.constexpr(1)
FP8_ROPE_BF16 = tl.constexpr(2)
FP8_DS_MLA = tl.constexpr(3)
FORMAT_CODE = {"bf16": 0, "fp8": 1, "fp8_rope_bf16": 2, "fp8_ds_mla": 3}

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
