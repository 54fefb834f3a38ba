"""The kernels compile for sm_90a on a machine with no GPU, to the instructions they are written for."""
import pytest

from fp8mla.kernels.sass import SassReport, instructions


@pytest.fixture(scope="module")
def portable_sass(sass_reports):
    return sass_reports("portable")   # (compiled in the background: conftest.py)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_rope_bf16"])
def test_portable_fp8_uses_fp8_and_bf16_wgmma(portable_sass, fmt):
    r = portable_sass[f"portable[{fmt}]"]   # (a bf16 q)
    assert r["QGMMA"] > 0   # latent Q.K^T and P.V on FP8 tensor cores
    if fmt == "fp8_rope_bf16":
        assert r["HGMMA"] > 0    # RoPE part in BF16
    else:
        assert r["HGMMA"] == 0   # the cache's RoPE keys are e4m3: q's RoPE part joins the FP8 product


def test_portable_bf16_uses_bf16_wgmma(portable_sass):
    r = portable_sass["portable[bf16]"]
    assert r["HGMMA"] > 0 and r["QGMMA"] == 0


@pytest.mark.parametrize("name", ["combine", "combine[8 slices]", "combine[bf16 partials]",
                                  "combine[bf16 partials][8 slices]"])
def test_combine_has_no_local_memory(portable_sass, name):
    r = portable_sass[name]
    assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0


@pytest.mark.parametrize("name", ["portable[bf16]", "portable[fp8]", "portable[fp8_rope_bf16]"])
def test_portable_wgmma_not_serialized(portable_sass, name):
    assert not portable_sass[name]["wgmma_serialized"]


def test_wgmma_serialized_reads_ptxas_note():
    """The report flags ptxas's C7512 note (as the ptxas triton 3.6 ships, 12.8, words it for a kernel short of
    registers) and nothing else of ptxas -v's messages."""
    note = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "insufficient register resources for the function 'k'\n")
    usual = "ptxas info    : Used 168 registers, used 4 barriers\n"
    assert SassReport("k", "", 168, 0, 0, note + usual).wgmma_serialized
    assert not SassReport("k", "", 168, 0, 0, usual).wgmma_serialized


def test_instructions_compare_programs_up_to_register_numbers():
    """The refactor check (``--dump``): the same instructions with other registers and addresses compare equal,
    another opcode or operand does not."""
    a = ("        /*0010*/                   IMAD.U32 R134, RZ, RZ, UR10 ;   /* 0x0000000aff867e24 */\n"
         "                                                                   /* 0x000fe2000f8e00ff */\n"
         "        /*0020*/                   FMNMX R85, R70, R85, !PT ;      /* 0x0000005546557209 */\n")
    b = a.replace("R134", "R136").replace("R85", "R12").replace("/*0020*/", "/*0030*/").replace("867e24", "887e24")
    assert instructions(a) == instructions(b) == "IMAD.U32 R, RZ, RZ, UR ;\nFMNMX R, R, R, !PT ;\n"
    assert instructions(a) != instructions(a.replace("FMNMX", "FADD"))
    assert instructions(a) == instructions(a.replace("UR10", "UR11"))   # uniform registers are registers too
    assert instructions(a) != instructions(a.replace("UR10", "URZ"))
    assert instructions(a) != instructions(a.replace("!PT", "PT"))
