"""FlashMLA's test matrix on the GPU, every format and backend, against the fp32 reference."""
import pytest
import torch

from fp8mla import BACKENDS, KV_FORMATS, cal_diff, flash_mla_with_kvcache, get_mla_metadata, hopper_available
from fp8mla.inputs import make_problem, make_seqlens
from fp8mla.kernels.hopper import SUPPORTED_FORMATS
from fp8mla.reference import reference_mla_decode

pytestmark = pytest.mark.gpu
COS_BOUND = {"bf16": 1e-5, "fp8": 8e-4, "fp8_rope_bf16": 8e-4}


def backends():
    return [b for b in BACKENDS if b != "hopper" or hopper_available(torch.device("cuda"))]


@pytest.fixture(scope="module", params=[(sk, varlen) for sk in (4096, 8192) for varlen in (False, True)],
                ids=lambda p: f"sk{p[0]}{'-varlen' if p[1] else ''}")
def seqlens(request):
    sk, varlen = request.param
    return make_seqlens(128, sk, varlen=varlen, generator=torch.Generator().manual_seed(sk + varlen))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("h_q", [16, 32, 64, 128])
def test_flashmla_matrix(seqlens, h_q, s_q, kv_format, backend):
    if backend == "hopper" and kv_format not in SUPPORTED_FORMATS:
        pytest.skip(f"the hopper kernel does not take {kv_format}")
    problem = make_problem(128, s_q, h_q, seqlens, device="cuda")
    meta, num_splits = get_mla_metadata(problem.cache_seqlens, s_q * h_q, 1)
    args = problem.quantized(kv_format)
    out, lse = flash_mla_with_kvcache(args["q"], args["k_cache"], problem.block_table, problem.cache_seqlens, 512,
                                      meta, num_splits, causal=True, descale_k=args["descale_k"], backend=backend)
    ref_out, ref_lse = reference_mla_decode(problem.q, problem.kv, problem.block_table, problem.cache_seqlens,
                                            causal=True)
    diff = cal_diff(out.float(), ref_out)
    assert diff["cos_diff"] <= COS_BOUND[kv_format], diff
    assert not out.isnan().any()
    assert torch.allclose(lse, ref_lse, atol=2e-3 if kv_format == "bf16" else 0.05, rtol=0)
