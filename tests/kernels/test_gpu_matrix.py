"""FlashMLA's test matrix on the GPU, every format and backend, against the fp32 reference."""
import pytest
import torch

from fp8mla.kernels import HOPPER_FORMATS
from fp8mla import BACKENDS, KV_FORMATS, flash_mla_with_kvcache, get_mla_metadata, hopper_available
from fp8mla.inputs import make_problem, make_seqlens
from fp8mla.bench.metrics import output_error
from fp8mla.reference import reference_mla_decode

pytestmark = pytest.mark.gpu
COS_BOUND = {"bf16": 1e-5, "fp8": 8e-4, "fp8_rope_bf16": 8e-4, "fp8_ds_mla": 8e-4}
# varlen draws clip ~2% of lengths to 1: a one-key row's lse is that key's FP8 score (0.107 seen at sk=4096, h_q=16)
LSE_ATOL = {"bf16": 2e-3, "fp8": 0.2, "fp8_rope_bf16": 0.2, "fp8_ds_mla": 0.2}


@pytest.fixture(scope="module", params=[(sk, varlen) for sk in (4096, 8192) for varlen in (False, True)],
                ids=lambda p: f"sk{p[0]}{'-varlen' if p[1] else ''}")
def seqlens(request):
    sk, varlen = request.param
    return make_seqlens(128, sk, varlen=varlen, generator=torch.Generator().manual_seed(sk + varlen))


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("h_q", [16, 32, 64, 128])
def test_flashmla_matrix(seqlens, h_q, s_q):
    """b=128, causal: every format on every backend that takes it, one problem and one reference per case."""
    problem = make_problem(128, s_q, h_q, seqlens, device="cuda")
    meta, num_splits = get_mla_metadata(problem.cache_seqlens, s_q * h_q, 1)
    ref_out, ref_lse = reference_mla_decode(problem.q, problem.kv, problem.block_table, problem.cache_seqlens,
                                            causal=True)
    seen = torch.isfinite(ref_lse)  # rows that see no key: lse +inf in both
    failures = []
    for kv_format in KV_FORMATS:
        args = problem.quantized(kv_format)
        for backend in BACKENDS:
            if backend == "hopper" and not (hopper_available(problem.q.device) and kv_format in HOPPER_FORMATS):
                continue
            out, lse = flash_mla_with_kvcache(args["q"], args["k_cache"], problem.block_table, problem.cache_seqlens,
                                              512, meta, num_splits, causal=True, descale_k=args["descale_k"],
                                              kv_format=kv_format, backend=backend)   # (a 656-byte cache's reading)
            err = output_error(out, lse, ref_out, ref_lse)
            if (err["cos_diff"] > COS_BOUND[kv_format] or out.isnan().any() or lse.isnan().any()
                    or not torch.equal(torch.isfinite(lse), seen)
                    or err["lse_err"] > LSE_ATOL[kv_format]):
                failures.append((kv_format, backend, err))
    assert not failures, failures
