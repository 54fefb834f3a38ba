"""Quick device check of the hopper kernel: correctness against the fp32 reference on small cases (every FP8
path, with and without splits), then timings of the two key configs (skip them with --no-time).

    PYTHONPATH=src python3 scripts/hopper_check.py [--no-time]
"""
import os, sys, torch, triton
import fp8mla
from fp8mla import cal_diff, reference_mla_decode
from fp8mla.inputs import make_problem

def run(p, fmt, q8, causal, parts=None, backend="hopper"):
    b, s_q, h_q = p.shape
    meta, ns = fp8mla.get_mla_metadata(p.cache_seqlens, s_q * h_q, 1, num_parts=parts)
    x = p.quantized(fmt, q_fp8=q8)
    f = lambda: fp8mla.flash_mla_with_kvcache(x["q"], x["k_cache"], p.block_table, p.cache_seqlens, 512, meta, ns, causal=causal,
                                              descale_q=x["descale_q"], descale_k=x["descale_k"], backend=backend, validate=False)
    return f
ok = True
if "--skip-check" not in sys.argv:
    for (b, s_q, h_q, lens, causal) in [(3, 1, 16, [200, 0, 77], False), (2, 2, 64, [1000, 64], True), (4, 4, 128, [129, 700, 5, 2100], True)]:
        p = make_problem(b, s_q, h_q, lens, device="cuda")
        ro, rl = reference_mla_decode(p.q, p.kv, p.block_table, p.cache_seqlens, causal=causal)
        for fmt, q8 in [("fp8_rope_bf16", False), ("fp8", True)]:
            for parts in [None, 7]:
                o, l = run(p, fmt, q8, causal, parts)()
                d = cal_diff(o.float(), ro)
                e = torch.isinf(rl)
                good = d["cos_diff"] < 2.5e-3 and not o.isnan().any() and torch.equal(torch.isinf(l), e) and torch.allclose(l[~e], rl[~e], atol=0.2)
                ok &= good
                print(f"check b={b} s_q={s_q} h_q={h_q} {fmt} q8={q8} parts={parts}: cos {d['cos_diff']:.2e} {'ok' if good else 'FAIL'}", flush=True)
print("ALL OK" if ok else "FAILURES", flush=True)
if not ok or "--no-time" in sys.argv:
    sys.exit(0 if ok else 1)
for (b, s_q, h_q) in [(64, 2, 64), (128, 1, 16)]:
    p = make_problem(b, s_q, h_q, [8192] * b, device="cuda", seed=0)
    for fmt, q8 in [("fp8_rope_bf16", False), ("fp8", True)]:
        f = run(p, fmt, q8, True)
        f(); torch.cuda.synchronize()
        ms = triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
        print(f"time b={b} s_q={s_q} h_q={h_q} {fmt:14} q8={int(q8)} {ms*1000:8.1f} us", flush=True)
