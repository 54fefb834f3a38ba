"""The Gluon sm_90a kernel: compiled here (SASS checked), run against the reference on a Hopper GPU."""
import pytest
import torch

from fp8mla import cal_diff, flash_mla_with_kvcache, get_mla_metadata, reference_mla_decode
from fp8mla.inputs import make_problem
from fp8mla.kernels import HOPPER_FORMATS, decoder_for


@pytest.fixture(scope="module")
def hopper_sass(sass_reports):
    return sass_reports("hopper")   # (compiled in the background: conftest.py)


Q_KINDS = ["fp8_rope_bf16", "fp8", "fp8, fp8 q"]   # a cache format, and the q the kernel reads
SMALL_VARIANTS = [f"hopper_small{rows}[{kind}]" for rows in (16, 32) for kind in Q_KINDS]
FP8_VARIANTS = [f"hopper[{kind}]" for kind in Q_KINDS]
VARIANTS = ["hopper[bf16]"] + FP8_VARIANTS
SPARSE_VARIANTS = [f"hopper_sparse[{f}]" for f in ("fp8_rope_bf16", "fp8_ds_mla")] + [
    f"hopper_small_sparse{rows}[{f}]" for rows in (16, 32) for f in ("fp8_rope_bf16", "fp8_ds_mla")]


def test_sass_variants_cover_the_supported_formats(hopper_sass):
    assert set(hopper_sass) == set(VARIANTS + SMALL_VARIANTS + SPARSE_VARIANTS)
    assert all(f"hopper[{f}]" in VARIANTS for f in HOPPER_FORMATS)


@pytest.mark.parametrize("variant", SPARSE_VARIANTS)
def test_sass_gather_ring_copies_rows(hopper_sass, variant):
    """The sparse call's kernel: the same FP8 and BF16 wgmmas, its pages by cp.async (LDGSTS) row by row, no TMA."""
    r = hopper_sass[variant]
    assert r["QGMMA"] >= 18 and r["HGMMA"] >= 4, r
    assert r["LDGSTS"] > 0 and r["UTMALDG"] == 0, r


@pytest.mark.parametrize("rows", [16, 32])
def test_sass_group_descales_keep_the_fp8_products(hopper_sass, rows):
    """fp8_ds_mla's descale a latent group: Q.K^T as four group products and P.V as two a warpgroup, the same
    FP8 wgmmas as one descale a row, in as many instructions (but for q's second part at 16 rows)."""
    one = hopper_sass[f"hopper_small_sparse{rows}[fp8_rope_bf16]"]
    four = hopper_sass[f"hopper_small_sparse{rows}[fp8_ds_mla]"]
    assert four["QGMMA"] == one["QGMMA"] + 16 and four["HGMMA"] == one["HGMMA"], four
    assert four["wgmma_shapes"] == one["wgmma_shapes"], four


def test_sass_64_row_group_reading(hopper_sass):
    """fp8.py's fp8_ds_mla reading: the latent Q.K^T as four group products, each with q's second part (16 more
    k32 wgmmas a page than one descale a row), the same RoPE and P.V wgmmas; P single-buffered for lo's 32 KB."""
    four, one = hopper_sass["hopper_sparse[fp8_ds_mla]"], hopper_sass["hopper_sparse[fp8_rope_bf16]"]
    assert four["QGMMA"] == one["QGMMA"] + 16 and four["HGMMA"] == one["HGMMA"], (four, one)
    assert four["wgmma_shapes"] == one["wgmma_shapes"] and not four["wgmma_serialized"], four
    assert four["shared"] <= 227 * 1024, four


def test_sass_64_row_group_reading_spills_only_where_unselected(hopper_sass):
    """The 64-row fp8_ds_mla reading is chosen (its Decoder's min_triton) only on the releases that compile it with
    a few spilled values (Triton 3.9: 24 bytes); 3.6's hundreds of bytes made it slower than the 32-row CTAs it would
    replace. Fails either way the compile moves: then the table is to move with it."""
    r = hopper_sass["hopper_sparse[fp8_ds_mla]"]
    chosen = decoder_for("hopper", "fp8_ds_mla", 128, gather=True).name == "hopper_sparse"
    assert (r["stack"] <= 64) == chosen, r


@pytest.mark.parametrize("rows", [16, 32])
def test_sass_sparse_group_reading_takes_q_in_two_parts(hopper_sass, rows):
    """The sparse call's fp8_ds_mla reading multiplies K by q's two e4m3 parts: 16 more k32 wgmmas a page (512
    latent dims) than the fp8_rope_bf16 reading; at 32 rows over a ring of two pages (room for lo's 16 KB)."""
    four = hopper_sass[f"hopper_small_sparse{rows}[fp8_ds_mla]"]
    one = hopper_sass[f"hopper_small_sparse{rows}[fp8_rope_bf16]"]
    assert four["QGMMA"] == one["QGMMA"] + 16, (four, one)


@pytest.mark.parametrize("variant", SMALL_VARIANTS)
def test_sass_small_rows_kernel_has_fp8_wgmma_and_tma(hopper_sass, variant):
    r = hopper_sass[variant]
    # S^T: 16 x k32 (64 tokens x 16 or 32 rows); O^T: 4 M-blocks x 2 k32 per PV warpgroup
    assert r["QGMMA"] >= 16 + 2 * 4 * 2, r
    assert f"QGMMA.64x{variant[len('hopper_small'):][:2]}x32" in r["wgmma_shapes"], r
    assert r["UTMALDG"] > 0


def test_sass_bf16_has_bf16_wgmma_and_tma(hopper_sass):
    r = hopper_sass["hopper[bf16]"]
    assert r["QGMMA"] == 0
    # Q.K^T: 32 x k16 latent + 4 x k16 RoPE (64x64); P.V: 4 x k16 per warpgroup (64x256, V read as it is)
    assert r["HGMMA"] >= 32 + 4 + 2 * 4, r
    assert r["UTMALDG"] > 0


@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_sass_has_fp8_wgmma_and_tma(hopper_sass, variant):
    r = hopper_sass[variant]
    assert r["QGMMA"] >= 18      # latent Q.K^T (16 x k32) and P.V (2 x n256 per warpgroup)
    assert r["UTMALDG"] > 0      # pages arrive by TMA
    if "fp8_rope_bf16" in variant:
        assert r["HGMMA"] >= 4   # the bf16 RoPE keys and q's RoPE part: RoPE Q.K^T is 4 x k16 bf16 wgmma
    else:
        assert r["HGMMA"] == 0   # the fp8 cache's RoPE keys are e4m3: q's RoPE part joins the FP8 product


@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_sass_output_stores_are_16_byte_vectors(hopper_sass, variant):
    """O leaves each PV warpgroup as 16-byte stores (8 bf16 to out or to a bf16 partial slot, per thread and
    32-column group); scalar stores are only the softmax warpgroup's lse (out and partial)."""
    r = hopper_sass[variant]
    assert r["STG.E.128"] >= 2 * 8 * 2, r
    assert r["STG"] - r["STG.E.128"] <= 8, r


# (hopper_sparse keeps 8 bytes outside its loops under Triton 3.6's ptxas: its four warpgroups; its fp8_ds_mla
# reading spills, test_sass_64_row_group_reading_spills_only_where_unselected; docs/design.md)
@pytest.mark.parametrize("variant", VARIANTS + SMALL_VARIANTS + SPARSE_VARIANTS[2:])
def test_sass_has_no_local_memory(hopper_sass, variant):
    r = hopper_sass[variant]
    assert (r["stack"], r["LDL"], r["STL"]) == (0, 0, 0), r


@pytest.mark.parametrize("variant", VARIANTS + SMALL_VARIANTS + SPARSE_VARIANTS)
def test_sass_wgmma_not_serialized(hopper_sass, variant):
    """ptxas keeps the wgmmas asynchronous (no C7512 note): short of registers it makes each wait for the one
    before, with no spill to show for it (V^T as a register operand cost 12-19% that way, BENCHMARKS)."""
    assert not hopper_sass[variant]["wgmma_serialized"]


CASES = [  # b, s_q, h_q, seqlens, causal (s_q * h_q <= 32: the small-rows kernel for the FP8 formats)
    (3, 1, 16, [200, 0, 77], False),
    (2, 2, 16, [300, 1000], True),
    (3, 3, 8, [65, 129, 0], True),
    (2, 2, 64, [1000, 64], True),
    (2, 2, 32, [1, 257], True),
    (2, 1, 128, [4097, 3000], False),
    (4, 4, 128, [129, 700, 5, 2100], True),
]


@pytest.mark.hopper
@pytest.mark.parametrize("kv_format,q_fp8", [("bf16", False), ("fp8_rope_bf16", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("b,s_q,h_q,seqlens,causal", CASES)
@pytest.mark.parametrize("num_parts", [None, 1, 7])
def test_hopper_matches_reference(kv_format, q_fp8, b, s_q, h_q, seqlens, causal, num_parts):
    problem = make_problem(b, s_q, h_q, seqlens, device="cuda")
    meta, num_splits = get_mla_metadata(problem.cache_seqlens, s_q * h_q, 1, num_parts=num_parts)
    args = problem.quantized(kv_format, q_fp8=q_fp8)
    out, lse = flash_mla_with_kvcache(args["q"], args["k_cache"], problem.block_table, problem.cache_seqlens, 512,
                                      meta, num_splits, causal=causal, descale_q=args["descale_q"],
                                      descale_k=args["descale_k"], backend="hopper")
    ref_out, ref_lse = reference_mla_decode(problem.q, problem.kv, problem.block_table, problem.cache_seqlens,
                                            causal=causal)
    assert not out.isnan().any() and not lse.isnan().any()
    diff = cal_diff(out.float(), ref_out)
    assert diff["cos_diff"] <= (2e-5 if kv_format == "bf16" else 2.5e-3), diff
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=0.2, rtol=0)
    # the portable kernel computes the same function
    port, port_lse = flash_mla_with_kvcache(args["q"], args["k_cache"], problem.block_table, problem.cache_seqlens,
                                            512, meta, num_splits, causal=causal, descale_q=args["descale_q"],
                                            descale_k=args["descale_k"], backend="portable")
    assert cal_diff(out.float(), port.float())["cos_diff"] <= 1e-3


@pytest.mark.hopper
def test_a_bf16_q_is_quantized_per_row_by_amax_over_448():
    """The 64-row kernel quantizes a bf16 q's rows (the fp8 cache: whole rows) to e4m3 with descale amax / 448. Rows
    of e4m3 numbers times one power of two, each with 448 times it as its amax, quantize losslessly back to those
    numbers with that power as descale: the call gives, bit for bit, what it gives for the same numbers passed as
    an e4m3 q with that descale. Split requests of 128 rows (two CTAs of rows, each PV warpgroup's half)."""
    b, s_q, h_q = 3, 2, 64
    problem = make_problem(b, s_q, h_q, [700, 64, 1500], device="cuda")
    meta, num_splits = get_mla_metadata(problem.cache_seqlens, s_q * h_q, 1, num_parts=5)
    args = problem.quantized("fp8")
    descale = 2.0 ** -6
    q8 = (problem.q.float() / descale).clamp(-448, 448).to(torch.float8_e4m3fn)
    q8[..., 3] = -448.0   # every row's amax
    q = (q8.float() * descale).to(torch.bfloat16)   # exact: e4m3 numbers times a power of two
    common = (args["k_cache"], problem.block_table, problem.cache_seqlens, 512, meta, num_splits)
    out, lse = flash_mla_with_kvcache(q, *common, causal=True, descale_k=args["descale_k"], backend="hopper")
    want, want_lse = flash_mla_with_kvcache(q8, *common, causal=True, backend="hopper", descale_k=args["descale_k"],
                                            descale_q=torch.tensor([descale], device="cuda"))
    assert not out.isnan().any() and torch.equal(out, want) and torch.equal(lse, want_lse)
    ref_out, _ = reference_mla_decode(q, problem.kv, problem.block_table, problem.cache_seqlens, causal=True)
    assert cal_diff(out.float(), ref_out)["cos_diff"] <= 2.5e-3   # (not a q both calls read wrong)
