"""Local-memory instructions (LDL/STL) inside the FP8 64-row kernels' innermost wgmma loops (the page loops), from
their sm_90a SASS compiled on this machine (no GPU needed):

    PYTHONPATH=src python3 scripts/loop_spills.py

A loop is a backward branch whose body holds a QGMMA; test_hopper's strict xfail counts local memory anywhere, this
says whether any of it is per page."""
from fp8mla.kernels import sass
import re
for r in sass.hopper_reports():
    if r.name not in ("hopper[fp8]", "hopper[fp8_rope_bf16]"): continue
    lines = r.sass.splitlines()
    addr = {}
    for i, l in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]+)\*/", l)
        if m: addr[int(m.group(1), 16)] = i
    # innermost loops: back edges; report spills inside any back-edge span containing a QGMMA
    spans = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA.*?(0x[0-9a-f]+)", l)
        if m and addr.get(int(m.group(1), 16), 10**9) < i:
            a = addr[int(m.group(1), 16)]
            if any("QGMMA" in x for x in lines[a:i]) and i - a < 2500:
                spans.append((a, i))
    inner = [s for s in spans if not any(t != s and s[0] <= t[0] and t[1] <= s[1] for t in spans)]
    for a, b in inner:
        sp = [lines[k].strip()[:40] for k in range(a, b) if re.search(r"\b(LDL|STL)", lines[k])]
        print(r.name, "loop", a, b, "len", b - a, "spill ops in loop:", sp)
