"""Local-memory instructions (LDL/STL) inside the FP8 64-row kernels' wgmma loops, from their sm_90a SASS compiled on
this machine (no GPU needed):

    PYTHONPATH=src python3 scripts/loop_spills.py

A loop here is a backward branch whose body holds a QGMMA and no other such loop whole: the PV warpgroups' and the
softmax warpgroup's page loops (a request loop that the page loop's branches interleave with shows up too).
test_hopper asserts no local memory anywhere; this says whether any that appears runs once a page."""
import re

from fp8mla.kernels import sass

KERNELS = ("hopper[fp8_rope_bf16]", "hopper[fp8]")


def wgmma_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of each loop, as above."""
    line_of = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]+)\*/", line)
        if m:
            line_of[int(m.group(1), 16)] = i
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", line)
        start = line_of.get(int(m.group(1), 16)) if m else None
        if start is not None and start < i and any("QGMMA" in x for x in lines[start:i]):
            spans.append((start, i))
    return [s for s in spans if not any(t != s and s[0] <= t[0] and t[1] <= s[1] for t in spans)]


def main():
    for report in sass.hopper_reports():
        if report.name not in KERNELS:
            continue
        lines = report.sass.splitlines()
        for first, last in wgmma_loops(lines):
            spills = [lines[k].split(";")[0].split("*/")[-1].strip() for k in range(first, last)
                      if re.search(r"\b(LDL|STL)", lines[k])]
            size = sum(1 for k in range(first, last) if re.match(r"\s*/\*[0-9a-f]+\*/", lines[k]))
            print(f"{report.name}: loop of {size} instructions, local memory in it: {spills or 'none'}")


if __name__ == "__main__":
    main()
