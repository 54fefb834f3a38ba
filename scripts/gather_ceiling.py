"""Speed of light of the sparse call's gathers: how fast this GPU reads a sparse call's cache rows (656 bytes each,
``topk`` of each batch entry's context per query token, drawn as the bench draws them) when reading them is all a
kernel does, against the GPU's copy rate in the same process. A sparse decode whose rows are few per query row (16
or 32 heads) can be no faster than this; the table gives each config's floor in µs and the issue's targets' rates.

    PYTHONPATH=src python3 scripts/gather_ceiling.py [--configs 64,1 64,2 128,2] [--rows 16 32] [--rounds 5]

Each program of the Triton kernel loads ``--rows`` rows (their indices, then 41 16-byte pieces each, by plain
loads) and writes one checksum; ``--rows`` sets the bytes a program has in flight. The copy rate is a device copy
of 1 GiB (read + write).
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

from fp8mla.formats import ROW_BYTES
from fp8mla.inputs import sparse_indices

ROW_WORDS = ROW_BYTES // 4   # a 656-byte row as int32 words
CONTEXT, TOPK = 8192, 2048   # the bench's sparse configs


@triton.jit
def _gather_rows(cache_ptr, idx_ptr, sums_ptr, n, ROWS: tl.constexpr, WORDS: tl.constexpr, ROW_WORDS: tl.constexpr):
    """sums[p] = the sum of the ROWS rows program p's indices name (-1: none), as int32 words (each below 2^16:
    no overflow up to 128 rows)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    idx = tl.load(idx_ptr + r, mask=r < n, other=-1)
    w = tl.arange(0, WORDS)
    x = tl.load(cache_ptr + idx.to(tl.int64)[:, None] * ROW_WORDS + w[None, :],
                mask=(idx >= 0)[:, None] & (w < ROW_WORDS)[None, :], other=0)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(tl.sum(x, axis=1), axis=0))


def gather_sums(cache: torch.Tensor, indices: torch.Tensor, rows: int, sums: torch.Tensor | None = None):
    """The kernel over cache [rows, 164] int32 and the flat indices: each program's sum."""
    n = indices.numel()
    programs = -(-n // rows)
    sums = torch.empty(programs, dtype=torch.int32, device=cache.device) if sums is None else sums
    _gather_rows[(programs,)](cache, indices, sums, n, ROWS=rows, WORDS=triton.next_power_of_2(ROW_WORDS),
                              ROW_WORDS=ROW_WORDS)
    return sums


def reference_sums(cache: torch.Tensor, indices: torch.Tensor, rows: int) -> torch.Tensor:
    """gather_sums in torch."""
    flat = indices.reshape(-1).long()
    per_row = torch.where(flat[:, None] >= 0, cache[flat.clamp(min=0)].long(), 0).sum(1)
    per_row = torch.nn.functional.pad(per_row, (0, -len(flat) % rows)).view(-1, rows).sum(1)
    return per_row.int()


def problem(b: int, s_q: int, device, seed: int = 0):
    """(cache [rows, 164] int32 words below 2^16, indices [b, s_q, TOPK]): the bench's draw, no -1 entries."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    indices, num_pages = sparse_indices(b, s_q, TOPK, CONTEXT, g, skipped=0)
    cache = torch.randint(0, 2**16, (num_pages * 64, ROW_WORDS), generator=g, device=device, dtype=torch.int32)
    return cache, indices


def time_us(fn, rounds: int) -> float:
    """Median over rounds of a CUDA graph's replay of fn, µs."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["64,1", "64,2", "128,2"],
                        help="b,s_q of each config (topk 2048 of 8192 tokens)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32], help="rows a program loads (powers of 2, at most 128)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (medians)")
    args = parser.parse_args(argv)
    if any(r < 1 or r > 128 or r & (r - 1) for r in args.rows):
        parser.error(f"--rows takes powers of 2 up to 128, got {args.rows}")
    device = torch.device("cuda")
    src = torch.empty(2**28, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() * 4 / time_us(lambda: dst.copy_(src), args.rounds) / 1e6
    print(f"{torch.cuda.get_device_name()}: device copy (1 GiB, read + write) {copy_tbs:.2f} TB/s\n")
    print("| b | s_q | rows read | distinct rows | rows a program | µs | TB/s of rows read | of the copy rate |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        b, s_q = (int(x) for x in config.split(","))
        cache, indices = problem(b, s_q, device)
        flat = indices.reshape(-1)
        distinct = len(torch.unique(flat))
        for rows in args.rows:
            sums = gather_sums(cache, flat, rows)
            assert torch.equal(sums, reference_sums(cache, flat, rows)), "the gather's sums differ from torch's"
            us = time_us(lambda: gather_sums(cache, flat, rows, sums), args.rounds)
            tbs = flat.numel() * ROW_BYTES / us / 1e6
            print(f"| {b} | {s_q} | {flat.numel()} | {distinct} | {rows} | {us:.1f} | {tbs:.2f} | "
                  f"{tbs / copy_tbs:.0%} |", flush=True)


if __name__ == "__main__":
    main()
