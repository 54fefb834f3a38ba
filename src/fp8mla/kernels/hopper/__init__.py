"""The Gluon sm_90a kernels, organised by role:

  layouts.py     tile constants and the layouts the kernels share
  ring.py        the walk through a CTA's part of the schedule (cursors), and the TMA page ring
  handshakes.py  the warpgroups' mbarriers (the handshake table) and the softmax -> PV hand-offs
  operands.py    the shared-memory operands, and each request's q into them
  softmax.py     the online softmax, P's hand-off, a request's lse and O scale
  transpose.py   V into V^T in shared memory (FP8 wgmma's B operand must be K-major)
  epilogue.py    O to out or to the split's partial slot
  fp8.py, small.py, bf16.py   the kernels composed from them: 64 query rows with the FP8 caches, at most 32 rows
                 (transposed: rows on the wgmma's N), and the bf16 cache
  launch.py      descriptors and launch functions (LAUNCH: one per decoder of kernels.DECODERS)
"""
from .launch import LAUNCH

__all__ = ["LAUNCH"]
