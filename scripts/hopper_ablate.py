"""Where a 64-row Hopper kernel's time goes: copies of it with one stage removed each (their results are wrong;
they are only timed), against the working tree's, on the headline config (b=64 s_q=2 h_q=64, 8192 tokens,
causal). ``--kernel fp8`` (kernels/hopper.py; fp8_rope_bf16 and fp8 with an e4m3 q: the no_rope_product /
no_token_scales / no_scale_loads copies change only fp8_rope_bf16's code, so fp8 is their control) or ``--kernel
bf16`` (kernels/hopper_bf16.py). none_of_the_three is the kernel's skeleton (ring, wgmmas, handshakes; compare
scripts/mma_ceiling.py, its wgmmas alone):

    PYTHONPATH=src python3 scripts/hopper_ablate.py [--kernel bf16] [--config B,S_Q,H_Q] [--out DIR]

Each ablation is a text substitution that must match the kernel exactly once (an error says which one no longer
does). The copies go to DIR (a temporary folder by default) and are timed like ``hopper_check.py --variants``.
"""
import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402

KERNELS = Path(__file__).parent.parent / "src" / "fp8mla" / "kernels"
SOFTMAX = ("p, alpha, m_new = softmax_step(sc, blk, key_limit, min_key_limit, m_i, sm_scale_log2, LOG2_FP8_MAX)",
           "p, alpha, m_new = sc, gl.full_like(m_i, 1.0), m_i")
SOFTMAX_BF16 = ("""p, alpha, m_new, l_i = online_softmax(sc, blk, key_limit, min_key_limit, m_i, l_i, sm_scale_log2,
                                          P_LOG2=0.0)""", "p, alpha, m_new, l_i = sc, gl.full_like(m_i, 1.0), m_i, l_i")
RESCALE = ("o * alpha[:, None],", "o,")
TRANSPOSE = ("""        if valid < PAGE_SIZE:
            _transpose_chunk(src, dst, valid, True)
        else:
            _transpose_chunk(src, dst, valid, False)
""", "        pass\n")
# fp8_rope_bf16's own work (the fp8 path with an e4m3 q is untouched: a control): its BF16 RoPE product and the
# product's merge into S, and the per-token scales (read from the ring slot; all 1 instead)
IN_PAGE_LOOP_BRANCH = " " * 20   # the indentation of these lines and of the ring refill's in the kernel
ROPE_WGMMA = textwrap.indent("""\
acc_rope = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)),
                         gl.zeros([BLOCK_M, PAGE_SIZE], gl.float32, S_BF16), use_acc=False,
                         is_async=True)
""", IN_PAGE_LOOP_BRANCH)
ROPE_MERGE = textwrap.indent("""\
acc, acc_rope = warpgroup_mma_wait(0, deps=[acc, acc_rope, q_lat, q_rope, k_lat.index(s),
                                            k_rope.index(s)])[:2]
acc = acc * q_scale[:, None] * k_scale[None, :] + gl.convert_layout(acc_rope, S_FP8,
                                                                    assert_trivial=True)
""", IN_PAGE_LOOP_BRANCH)
LATENT_ONLY = textwrap.indent("""\
acc = warpgroup_mma_wait(0, deps=[acc, q_lat, k_lat.index(s)])[0]
acc = acc * q_scale[:, None] * k_scale[None, :]
""", IN_PAGE_LOOP_BRANCH)
ROPE_PRODUCT = [(ROPE_WGMMA, IN_PAGE_LOOP_BRANCH + "pass\n"), (ROPE_MERGE, LATENT_ONLY)]
TOKEN_SCALES = [("k_scale = token_scales(k_scale_smem.index(s), blk, seqlen, SCALE_LOAD, col_l, KV_FORMAT)",
                 "k_scale = gl.full([PAGE_SIZE], 1.0, gl.float32, col_l)")]
# fp8_rope_bf16's scale tile's TMA box (64 rows of 16 bytes), and the scales all 1, so nothing reads the slot
IN_FORMAT_BRANCH = " " * 8
SCALE_LOAD = [(textwrap.indent("""\
mbarrier.expect(kv_ready.index(s), page_bytes + scale_desc.block_type.nbytes)
tma_load(scale_desc, [row, 0], kv_ready.index(s), k_scale.index(s))
""", IN_FORMAT_BRANCH), textwrap.indent("mbarrier.expect(kv_ready.index(s), page_bytes)\n", IN_FORMAT_BRANCH))]
SCALE_LOAD += TOKEN_SCALES
# the ring's refills: its first pages are loaded, then each refill completes kv_ready at once, so the slots keep
# real data (values move the tensor cores' power draw, and the clock with it) and no page crosses memory again
REFILLS = (textwrap.indent("""\
_load_page(lat_desc, rope_desc, scale_desc, k_lat, k_rope, k_scale_smem, kv_ready, kv_empty,
           load_page, loaded, KV_FORMAT)
""", IN_PAGE_LOOP_BRANCH), textwrap.indent("""\
mbarrier.wait(kv_empty.index(loaded % STAGES), ((loaded // STAGES) & 1) ^ 1)
mbarrier.arrive(kv_ready.index(loaded % STAGES))
""", IN_PAGE_LOOP_BRANCH))
ROPE_QK = ("                acc = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)), acc, is_async=True)\n", "")
# the bf16 kernel's copies are launched through hopper.py's descriptors, as launch_hopper does for "bf16"
BF16_LAUNCH = '''

SUPPORTED_FORMATS = ("bf16",)


def launch_hopper(q, k_cache, kv_format, block_table, cache_seqlens, meta, num_splits, out, lse, o_part, lse_part,
                  descale_q, descale_k, softmax_scale, causal):
    from .hopper import _cache_descriptors
    lat_desc, rope_desc, _ = _cache_descriptors(k_cache, kv_format)
    return launch_hopper_bf16(q, lat_desc, rope_desc, block_table, cache_seqlens, meta, num_splits, out, lse, o_part,
                              lse_part, softmax_scale, causal)
'''
SETUPS = {  # kernel: (source, timed formats, ablations, text appended to each copy)
    "fp8": ("hopper.py", [("fp8_rope_bf16", False), ("fp8", True)],
            {"no_softmax_math": [SOFTMAX], "no_transposes": [TRANSPOSE], "no_rescale": [RESCALE],
             "none_of_the_three": [SOFTMAX, TRANSPOSE, RESCALE], "no_refills": [REFILLS],
             "skeleton_without_refills": [SOFTMAX, TRANSPOSE, RESCALE, REFILLS], "no_rope_product": ROPE_PRODUCT,
             "no_token_scales": TOKEN_SCALES, "no_scale_loads": SCALE_LOAD,
             "neither_rope_nor_scales": ROPE_PRODUCT + TOKEN_SCALES}, ""),
    "bf16": ("hopper_bf16.py", [("bf16", False)],
             {"no_softmax_math": [SOFTMAX_BF16], "no_rescale": [RESCALE], "no_rope_qk": [ROPE_QK],
              "none_of_the_three": [SOFTMAX_BF16, RESCALE, ROPE_QK]}, BF16_LAUNCH),
}


def write_ablations(folder: Path, kernel: str = "fp8") -> list:
    source_name, _, ablations, appended = SETUPS[kernel]
    source = (KERNELS / source_name).read_text()
    paths = []
    for name, substitutions in ablations.items():
        text = source
        for old, new in substitutions:
            if text.count(old) != 1:
                raise SystemExit(f"{name}: {source_name} no longer has exactly one {old.strip()[:60]!r}")
            text = text.replace(old, new)
        path = folder / f"{kernel}_{name}.py"
        path.write_text(text + appended)
        paths.append(str(path))
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=sorted(SETUPS), default="fp8")
    parser.add_argument("--out", type=Path, help="where the ablated copies go")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", help="b,s_q,h_q instead of the headline 64,2,64")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    variants = hopper_check.load_variants(write_ablations(folder, args.kernel))
    hopper_check.TIMED = [tuple(map(int, args.config.split(","))) if args.config else hopper_check.TIMED[0]]
    hopper_check.PATHS = SETUPS[args.kernel][1]
    hopper_check.time_variants(variants, args.rounds)


if __name__ == "__main__":
    main()
