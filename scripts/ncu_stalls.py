"""Where a kernel's warps wait, from an Nsight Compute report's source counters (SASS).

    ncu --import prof.ncu-rep --page source --csv --print-source sass > source.csv
    python3 scripts/ncu_stalls.py source.csv [--top 25]

Prints the stall reasons over all warp samples, the samples inside each page loop of a Hopper kernel (an
innermost backward branch around a wgmma: the softmax warpgroup's Q.K^T, each PV warpgroup's P.V; named by the
wgmma shapes inside) with their stall reasons, and the instructions with the most samples.
"""
import argparse
import collections
import csv
import re


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str):
    """[(address, source, samples, {stall reason: samples})] from ncu's source-page CSV."""
    rows = list(csv.reader(open(path, errors="replace")))
    head = next(i for i, r in enumerate(rows) if "Address" in r and any(c.startswith("Warp Stall Sampling") for c in r))
    names = rows[head]
    col = {n: i for i, n in enumerate(names)}
    total = next(n for n in names if n.startswith("Warp Stall Sampling (All"))
    reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    return [(int(r[col["Address"]], 16), r[col["Source"]].strip(), number(r[col[total]]),
             {n[len("stall_"):]: number(r[col[n]]) for n in reasons}) for r in rows[head + 1:] if len(r) == len(names)]


def loops(code, marker: str):
    """(first, last) addresses of the innermost loops (conditional backward branches; the out-of-line mbarrier
    retry blocks jump back unconditionally) whose body contains ``marker``."""
    found = []
    for address, source, _, _ in code:
        target = re.search(r"^@!?U?P\w+\s+BRA\s.*0x([0-9a-f]+)\s*$", source)  # a loop's back edge is conditional
        if target and int(target.group(1), 16) < address:
            first = int(target.group(1), 16)
            body = [s for a, s, _, _ in code if first <= a <= address]
            if any(marker in s for s in body):
                found.append((first, address))
    return [(lo, hi) for lo, hi in found if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in found)]


def reasons_line(counter: collections.Counter, total: float) -> str:
    return " ".join(f"{k}={v / total * 100:.0f}%" for k, v in counter.most_common(8) if total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    code = read(args.csv)
    total = sum(s for _, _, s, _ in code)
    overall = collections.Counter()
    for _, _, _, r in code:
        overall.update(r)
    print(f"{total:.0f} warp samples; stall reasons: {reasons_line(overall, sum(overall.values()))}")
    for lo, hi in loops(code, "GMMA."):   # every page loop: the softmax's Q.K^T, each PV warpgroup's P.V
        inside = [(src, s, r) for a, src, s, r in code if lo <= a <= hi]
        shapes = sorted({m.group(0) for src, _, _ in inside for m in [re.search(r"[QH]GMMA\.\w+", src)] if m})
        why = collections.Counter()
        for _, _, r in inside:
            why.update(r)
        print(f"page loop [{lo - code[0][0]:#x}, {hi - code[0][0]:#x}] ({', '.join(shapes)}): {len(inside)} "
              f"instructions, {sum(s for _, s, _ in inside) / total * 100:.1f}% of samples; "
              f"{reasons_line(why, sum(why.values()))}")
    print(f"\ntop {args.top} instructions (offset, share of samples, two main reasons):")
    for address, source, samples, r in sorted(code, key=lambda x: -x[2])[:args.top]:
        main_reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.items(), key=lambda x: -x[1])[:2] if v)
        print(f"{address - code[0][0]:#8x} {samples / total * 100:5.2f}% {source[:70]:70} {main_reasons}")


if __name__ == "__main__":
    main()
