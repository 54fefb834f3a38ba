"""Compile fp8mla's kernels for sm_90a without a GPU and read their SASS.

Used by the CPU tests (and by hand: ``python -m fp8mla.kernels.sass``) to prove that a kernel lowers to the
instructions it is written for: QGMMA (FP8 wgmma), HGMMA (BF16 wgmma), UTMALDG (TMA loads), that nothing spills
to local memory (LDL/STL), and that ptxas did not serialize the wgmmas for want of registers (its C7512 note,
which triton.compile does not show). It must run in a process without ``TRITON_INTERPRET``. A refactor that must
not change the kernels: ``python -m fp8mla.kernels.sass hopper --dump A`` before, ``--dump B`` after,
``diff -r A B``.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

HOPPER = ("cuda", 90, 32)


@dataclass
class SassReport:
    name: str
    sass: str
    n_regs: int
    stack: int   # bytes of stack frame / local memory per thread: > 0 means spills or a register array in memory
    shared: int
    ptxas_log: str = ""   # ptxas -v's messages for the kernel's PTX

    @property
    def wgmma_serialized(self) -> bool:
        """ptxas made each wgmma wait for the one before (C7512: "wgmma.mma_async instructions are serialized"),
        which costs the tensor cores their overlap: a kernel that compiles and does not spill can still lose 10-20%
        this way."""
        return "C7512" in self.ptxas_log

    def count(self, opcode: str) -> int:
        """How many instructions start with ``opcode`` (e.g. "QGMMA", "LDL", "STS.128")."""
        return len(re.findall(rf"\b{re.escape(opcode)}[\s.]", self.sass))

    def summary(self) -> dict:
        keys = ("QGMMA", "HGMMA", "HMMA", "UTMALDG", "LDGSTS", "LDL", "STL", "LDS", "STS", "STG", "STG.E.128", "PRMT",
                "BAR", "SYNCS")
        return dict(name=self.name, regs=self.n_regs, stack=self.stack, shared=self.shared,
                    wgmma_serialized=self.wgmma_serialized,
                    wgmma_shapes=sorted(set(re.findall(r"\b[QH]GMMA\.\d+x\d+x\d+", self.sass))),
                    **{k: self.count(k) for k in keys})


# the decode kernels' call constexprs: a dense call's (pages from the block table), a sparse call's compiled with
# topk_length and attn_sink (its Q_GROUP a parameter)
DENSE_CALL = dict(Q_GROUP=1, GATHER=False, HAS_TOPK_LENGTH=False, HAS_SINK=False)
SPARSE_CALL = dict(GATHER=True, HAS_TOPK_LENGTH=True, HAS_SINK=True)

# ints that are multiples of 16 in a typical call (a contiguous q of 576 columns, h_q in 16, 64, 128)
TYPICAL_DIVISIBLE = ("stride_qb", "stride_qs", "stride_qh", "H", "R")


# the decode kernels' parameters of one type whatever the kernel
DECODE_TYPES = {"stride_qb": "i32", "stride_qs": "i32", "stride_qh": "i32", "block_table_ptr": "*i32",
                "stride_bt": "i32", "max_pages": "i32", "num_pages": "i32", "seqlens_ptr": "*i32", "meta_ptr": "*i32",
                "num_splits_ptr": "*i32", "B": "i32", "SLOTS": "i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
                "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "descale_q_ptr": "*fp32", "descale_k_ptr": "*fp32",
                "sm_scale_log2": "fp32", "H": "i32", "S_Q": "i32", "R": "i32", "topk_length_ptr": "*i32",
                "sink_ptr": "*fp32"}
# Q_GROUP (1 but in a sparse call) is a constexpr here, as the launcher specializes a 1


def _part_type(kv_format: str) -> str:
    """The o_part_ptr type the decode kernels get for a cache format (kernels.partial_dtype)."""
    import torch

    from . import partial_dtype
    return "*fp32" if partial_dtype(kv_format) == torch.float32 else "*bf16"


def decode_signature(fn, **types) -> dict:
    """A decode kernel's signature for triton.compile, in its parameter order: ``types`` (q, cache or descriptors),
    then DECODE_TYPES; the remaining parameters are constexprs."""
    return {name: types.get(name, DECODE_TYPES.get(name, "constexpr")) for name in fn.arg_names}


def compile_sm90(fn, signature: dict, constexprs: dict, gluon: bool = False, divisible=(), **options):
    """``triton.compile`` for sm_90a; ``fn`` is a @triton.jit / @gluon.jit function."""
    from ..runtime import interpreter_active
    from .triton_compat import COMPILE_OPTIONS, compiling_for

    if interpreter_active():
        raise RuntimeError("compile in a process without TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        Source = ASTSource
    constexprs = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    # what the launcher specializes at run time: pointers to torch's allocations and the given ints are multiples
    # of 16 (this is what lets loads and stores vectorize)
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in signature.items()
             if t.startswith("*") or k in divisible}
    with compiling_for(HOPPER[1]):
        return triton.compile(Source(fn, signature, constexprs, attrs), target=GPUTarget(*HOPPER),
                              options={**COMPILE_OPTIONS, **options})


def sass_report(compiled, name: str = "") -> SassReport:
    import triton

    from .triton_compat import ptxas_for

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = triton.knobs.nvidia.cuobjdump.path
        sass = subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
        usage = subprocess.run([tool, "-res-usage", path], check=True, capture_output=True, text=True).stdout
        # triton.compile ran ptxas -v too, but keeps its messages only on failure: run it again on the same PTX
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        arch = f"sm_{HOPPER[1]}a"
        log = subprocess.run([ptxas_for(HOPPER[1]), "-v", f"--gpu-name={arch}", ptx, "-o",
                              os.path.join(tmp, "k.o")], check=True, capture_output=True, text=True).stderr
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    stack = max(int(res.get("STACK", 0)), int(res.get("LOCAL", 0)))
    md = compiled.metadata
    return SassReport(name or md.name, sass, int(res.get("REG", 0)), stack, md.shared, log)


def portable_reports() -> list[SassReport]:
    """The portable decode kernel for every format, and the combine kernel."""
    from .. import schedule
    from . import combine, portable
    from .constants import D_LATENT

    reports = []
    kv_types = {"bf16": "*bf16", "fp8": "*fp8e4nv", "fp8_rope_bf16": "*u8", "fp8_ds_mla": "*u8"}
    for fmt, code in portable.FORMAT_CODE.items():
        for gather in (False, True) if fmt == "fp8_ds_mla" else (False,):
            types = dict(q_ptr="*bf16", kv_ptr=kv_types[fmt], o_part_ptr=_part_type(fmt))
            sig = decode_signature(portable.mla_decode_split_kernel, **types, **({"Q_GROUP": "i32"} if gather else {}))
            k = compile_sm90(portable.mla_decode_split_kernel, sig,
                             dict(KV_FORMAT=code, Q_FP8=False, CAUSAL=not gather, BLOCK_M=64,
                                  **(SPARSE_CALL if gather else DENSE_CALL)),
                             divisible=TYPICAL_DIVISIBLE, num_warps=8, num_stages=1)
            reports.append(sass_report(k, f"portable[{fmt}{', sparse' if gather else ''}]"))
    for part_type, name in [("*fp32", "combine"), ("*bf16", "combine[bf16 partials]")]:
        for slices in (1, int(D_LATENT // schedule.MIN_COMBINE_DIMS)):   # the widest and the narrowest tile
            k = compile_sm90(combine.mla_combine_kernel,
                             decode_signature(combine.mla_combine_kernel, o_part_ptr=part_type, parts="i32",
                                              sink_ptr="*i32"),
                             {**schedule.combine_tile(slices, pieces=64), "Q_GROUP": 1, "HAS_SINK": False},
                             num_warps=4)   # its longest step
            reports.append(sass_report(k, name if slices == 1 else f"{name}[{slices} slices]"))
    return reports


def hopper_reports(ablate: int = 0) -> list[SassReport]:
    """The Gluon sm_90a decode kernels for each format they support (the 64-row ones with ``ablate``'s stages
    skipped: hopper/ablations.py)."""
    from .constants import FORMAT_CODE
    from .hopper import bf16, fp8, layouts, small

    box = bf16.K_BOX.value   # the latent part's TMA box
    sig = decode_signature(bf16.mla_decode_hopper_bf16_kernel, q_ptr="*bf16",
                           lat_desc=f"tensordesc<bf16[64, {box}],{layouts.LAT_BF16_SMEM.value!r}>",
                           rope_desc=f"tensordesc<bf16[64, 64],{layouts.ROPE_BF16_SMEM.value!r}>")
    k = compile_sm90(bf16.mla_decode_hopper_bf16_kernel, sig, dict(CAUSAL=True, ABLATE=ablate), gluon=True,
                     divisible=TYPICAL_DIVISIBLE, num_warps=4)
    reports = [sass_report(k, "hopper[bf16]")]
    rope = {"fp8_rope_bf16": ("bf16", layouts.ROPE_BF16_SMEM), "fp8": ("fp8e4nv", layouts.ROPE_FP8_SMEM)}
    for fmt, q_fp8 in [("fp8_rope_bf16", False), ("fp8", False), ("fp8", True)]:
        rope_type, rope_layout = rope[fmt]
        rope_desc = f"tensordesc<{rope_type}[64, 64],{rope_layout.value!r}>"
        types = dict(q_ptr="*fp8e4nv" if q_fp8 else "*bf16", o_part_ptr=_part_type(fmt),
                     lat_desc=f"tensordesc<fp8e4nv[64, 512],{layouts.LAT_SMEM.value!r}>", rope_desc=rope_desc,
                     scale_desc=(f"tensordesc<fp32[64, {layouts.SCALE_COLS.value}],{layouts.SCALE_SMEM.value!r}>"
                                 if fmt == "fp8_rope_bf16" else rope_desc))
        constexprs = dict(KV_FORMAT=FORMAT_CODE[fmt], Q_FP8=q_fp8, CAUSAL=True)
        kernel = fp8.mla_decode_hopper_kernel
        k = compile_sm90(kernel, decode_signature(kernel, kv_ptr="*u8", **types),
                         {**constexprs, "ABLATE": ablate, **DENSE_CALL},
                         gluon=True, divisible=TYPICAL_DIVISIBLE, num_warps=4)
        q_kind = ", fp8 q" if q_fp8 else ""
        reports.append(sass_report(k, f"hopper[{fmt}{q_kind}]"))
        if fmt == "fp8_rope_bf16" and not ablate:   # the sparse call's gather ring (hopper_sparse), both readings
            for reading in ("fp8_rope_bf16", "fp8_ds_mla"):
                k = compile_sm90(kernel, decode_signature(kernel, kv_ptr="*u8", Q_GROUP="i32", **types),
                                 {**constexprs, "KV_FORMAT": FORMAT_CODE[reading], "CAUSAL": False, "ABLATE": 0,
                                  **SPARSE_CALL}, gluon=True, divisible=TYPICAL_DIVISIBLE, num_warps=4)
                reports.append(sass_report(k, f"hopper_sparse[{reading}]"))
        if ablate:   # the small-rows kernel has no ablations
            continue
        kernel = small.mla_decode_hopper_small_kernel   # the same parameters, and ROWS
        for rows in (16, 32):   # its two N
            k = compile_sm90(kernel, decode_signature(kernel, kv_ptr="*u8", **types),
                             {**constexprs, "ROWS": rows, **DENSE_CALL}, gluon=True, divisible=TYPICAL_DIVISIBLE,
                             num_warps=4)
            reports.append(sass_report(k, f"hopper_small{rows}[{fmt}{q_kind}]"))
            if fmt == "fp8_rope_bf16":   # the sparse call's gather ring (hopper_small_sparse), both readings
                for reading in ("fp8_rope_bf16", "fp8_ds_mla"):
                    k = compile_sm90(kernel, decode_signature(kernel, kv_ptr="*u8", Q_GROUP="i32", **types),
                                     {**constexprs, "KV_FORMAT": FORMAT_CODE[reading], "CAUSAL": False,
                                      "ROWS": rows, **SPARSE_CALL}, gluon=True, divisible=TYPICAL_DIVISIBLE,
                                     num_warps=4)
                    reports.append(sass_report(k, f"hopper_small_sparse{rows}[{reading}]"))
    return reports


def instructions(sass: str) -> str:
    """The SASS's instructions alone, one per line (no addresses, encodings or register numbers, uniform ones
    included): two compiles of a refactored kernel that print the same are the same program up to register
    allocation."""
    lines = (re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?;)", line) for line in sass.splitlines())
    return "\n".join(re.sub(r"\b(U?R)\d+\b", r"\1", m.group(1)) for m in lines if m) + "\n"


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="SASS summaries of the kernels, one JSON line each")
    parser.add_argument("which", nargs="*", help="portable, hopper (default: both)")
    parser.add_argument("--dump", metavar="DIR", help="also write each kernel's instructions() to DIR/NAME.sass "
                        "(compare two trees' kernels with diff -r)")
    parser.add_argument("--ablate", type=int, default=0, help="hopper/ablations.py's flags for the 64-row kernels")
    args = parser.parse_args()
    args.which = args.which or ["portable", "hopper"]
    for r in (portable_reports() if "portable" in args.which else []) + \
            (hopper_reports(args.ablate) if "hopper" in args.which else []):
        print(json.dumps(r.summary()))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", r.name).strip("_") + ".sass"), "w") as f:
                f.write(instructions(r.sass))
