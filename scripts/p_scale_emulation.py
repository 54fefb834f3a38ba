"""Why fp8_rope_bf16's per-token scales are powers of two: a torch emulation of the kernels' P.V arithmetic.

The kernels fold each token's V scale, relative to the largest in its page, into P before P's e4m3 cast. With
RoPE ×8 a few keys dominate each row, and with arbitrary (amax / 448) scales the fold rounds those keys'
weights; with power-of-two scales it is exact. Runs on the CPU in seconds:

    PYTHONPATH=src python3 scripts/p_scale_emulation.py [--rope-scale 8]
"""
import argparse

import torch

from fp8mla import cal_diff, reference_mla_decode
from fp8mla.formats import D_LATENT, D_QK, FP8_MAX, PAGE_SIZE, token_descale
from fp8mla.inputs import make_problem


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def decode(problem, pow2: bool, fold: bool) -> torch.Tensor:
    """One request at a time, in fp32 except where the kernels round to e4m3."""
    b, s_q, h_q = problem.shape
    outs = []
    for i in range(b):
        n = int(problem.cache_seqlens[i])
        pages = problem.block_table[i, :(n + PAGE_SIZE - 1) // PAGE_SIZE].long()
        k = problem.kv[pages].reshape(-1, D_QK)[:n].float()
        q = problem.q[i].float()
        amax = k[:, :D_LATENT].abs().amax(-1, keepdim=True)
        k_scale = token_descale(amax) if pow2 else amax / FP8_MAX
        q_scale = q[..., :D_LATENT].abs().amax(-1, keepdim=True) / FP8_MAX
        k_lat = e4m3(k[:, :D_LATENT] / k_scale)           # raw e4m3 latent (also V)
        q_lat = e4m3(q[..., :D_LATENT] / q_scale) * q_scale
        s = (torch.einsum("shd,nd->shn", q_lat, k_lat * k_scale)
             + torch.einsum("shd,nd->shn", q[..., D_LATENT:], k[:, D_LATENT:])) * D_QK ** -0.5
        causal = torch.arange(n)[None, :] > (n - s_q + torch.arange(s_q))[:, None]
        s = s.masked_fill(causal[:, None, :], float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        o = torch.zeros(s_q, h_q, D_LATENT)
        for j in range(0, n, PAGE_SIZE):
            ks = k_scale[j:j + PAGE_SIZE, 0]
            unit = ks.max()
            if fold:  # the kernels: P * (scale / page's largest) * 448 -> e4m3, V stays raw e4m3
                p8 = e4m3(p[..., j:j + PAGE_SIZE] * (ks / unit) * FP8_MAX)
                o += torch.einsum("shn,nd->shd", p8, k_lat[j:j + PAGE_SIZE]) * unit / FP8_MAX
            else:  # the alternative: V rescaled per token in fp32, P cast alone
                p8 = e4m3(p[..., j:j + PAGE_SIZE] * FP8_MAX)
                o += torch.einsum("shn,nd->shd", p8, k_lat[j:j + PAGE_SIZE] * ks[:, None]) / FP8_MAX
        outs.append(o / p.sum(-1, keepdim=True))
    return torch.stack(outs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rope-scale", type=float, nargs="+", default=[1.0, 8.0])
    args = parser.parse_args()
    print("| RoPE scale | scales | scale ratio folded into P | out cos_diff |\n|---|---|---|---|")
    for rope_scale in args.rope_scale:
        problem = make_problem(4, 2, 16, [2048] * 4, rope_scale=rope_scale, seed=1)
        ref = reference_mla_decode(problem.q, problem.kv, problem.block_table, problem.cache_seqlens,
                                   causal=True)[0]
        for pow2 in (False, True):
            for fold in (True, False):
                d = cal_diff(decode(problem, pow2, fold), ref)["cos_diff"]
                print(f"| ×{rope_scale:g} | {'power of two' if pow2 else 'amax / 448'} | {'yes' if fold else 'no'} "
                      f"| {d:.2e} |")


if __name__ == "__main__":
    main()
