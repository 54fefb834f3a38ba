"""A model of the Hopper kernel's barrier protocol, run on real schedules: deadlocks and page order.

    PYTHONPATH=src python3 scripts/protocol_sim.py [--producer softmax|pv] [--trials 300]

Each CTA of a schedule (random batches with empty and 1-token requests, random part counts) runs as three Python
generators that mirror the partitions' control flow in kernels/hopper.py: the page cursors, every mbarrier wait
(with its phase) and arrive, the TMA producer's ring positions. They are interleaved in random order; a CTA
fails if all its partitions block (a deadlock), or if one of them sees other pages, or in another order, than
the part's. The TMA producer is the softmax warpgroup (``--producer softmax``, main) or the left PV warpgroup
(``--producer pv``, branch pv-producer); ``--p-in-registers`` models branch pv-rf (the PV warpgroups release a P
buffer as soon as they have loaded it, instead of after the P.V wgmma that read it). This checks the protocol, not the kernel's code: keep it in step with
hopper.py. Exits 1 on any failure.
"""
import argparse
import random

import torch

import fp8mla
from fp8mla.scheduler import BEGIN_PAGE, BEGIN_REQ, END_PAGE, END_REQ

STAGES = 2  # KV ring slots, as hopper.STAGES (--stages 3: hopper_small.STAGES)


class Barrier:
    """An mbarrier: the phase flips when `count` arrivals are in; wait(parity) passes once that phase completed."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, 0, 0

    def arrive(self, log: list):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase ^ 1
        log.append(1)

    def done(self, parity: int) -> bool:
        return self.phase != parity


class Part:
    """One CTA's part (begin_req, begin_page, end_req, end_page) of a schedule, as hopper.py's cursors see it."""

    def __init__(self, meta, seqlens, max_pages, producer, p_in_registers=False):
        self.begin_req, self.begin_page, self.end_req, self.end_page = meta
        self.pages = [(int(n) + 63) // 64 for n in seqlens]
        self.max_pages, self.producer, self.p_in_registers = max_pages, producer, p_in_registers
        self.bar = dict(kv_ready=[Barrier(1) for _ in range(STAGES)], kv_empty=[Barrier(3) for _ in range(STAGES)],
                        p_ready=[Barrier(1), Barrier(1)], p_free=[Barrier(2), Barrier(2)],
                        epi_ready=Barrier(1), epi_free=Barrier(2))
        self.events, self.slots, self.loaded = [], [None] * STAGES, []
        self.seen = {"softmax": [], "left": [], "right": []}

    # ---- hopper_common.request_range, _seek, advance ----
    def range_of(self, req):
        if req > self.end_req:  # an empty part: no pages (the kernel does not read seqlens)
            return 0, 0
        lo = self.begin_page if req == self.begin_req else 0
        hi = self.end_page if req == self.end_req else self.pages[req]
        return lo, min(hi, self.max_pages)

    def seek(self, req, blk):
        lo, hi = self.range_of(req)
        while blk >= hi and req < self.end_req:
            req += 1
            lo, hi = self.range_of(req)
            blk = lo
        return req, blk, blk < hi, hi

    def advance(self, cursor):
        req, blk, _, hi = cursor
        return self.seek(req, blk + 1) if blk + 1 >= hi else (req, blk + 1, True, hi)

    # ---- the handshakes ----
    def wait(self, barrier, parity):
        while not barrier.done(parity):
            yield
        self.events.append(0)  # passing a wait is progress too

    def load_page(self, cursor, position):
        s = position % STAGES
        yield from self.wait(self.bar["kv_empty"][s], ((position // STAGES) & 1) ^ 1)
        self.slots[s] = cursor[:2]
        self.loaded.append(cursor[:2])
        self.bar["kv_ready"][s].arrive(self.events)  # the TMA's bytes, landed at once in this model

    def load_prologue(self):
        cursor = self.seek(self.begin_req, self.begin_page)
        for position in range(STAGES):
            if cursor[2]:
                yield from self.load_page(cursor, position)
                cursor = self.advance(cursor)
        return cursor

    def hand_over_p(self, page):  # _softmax_page's handshake
        b = page % 2
        yield from self.wait(self.bar["p_free"][b], ((page // 2) & 1) ^ 1)
        self.bar["p_ready"][b].arrive(self.events)

    def softmax(self):
        if self.producer == "softmax":
            cursor = yield from self.load_prologue()
        it = n_req = 0
        for req in range(self.begin_req, self.end_req + 1):
            lo, hi = self.range_of(req)
            if lo < hi:
                for blk in range(lo, hi):
                    s = it % STAGES
                    yield from self.wait(self.bar["kv_ready"][s], (it // STAGES) & 1)
                    self.seen["softmax"].append(self.slots[s])
                    if blk > lo:
                        yield from self.hand_over_p(it - 1)
                    self.bar["kv_empty"][s].arrive(self.events)
                    it += 1
                    if self.producer == "softmax" and cursor[2]:  # refill this page's slot
                        yield from self.load_page(cursor, it - 1 + STAGES)
                        cursor = self.advance(cursor)
                yield from self.hand_over_p(it - 1)
                yield from self.wait(self.bar["epi_free"], (n_req & 1) ^ 1)
                self.bar["epi_ready"].arrive(self.events)
                n_req += 1

    def pv(self, wg):
        producer = self.producer == "pv" and wg == "left"
        if producer:
            cursor = yield from self.load_prologue()

        def transpose(position):
            s = position % STAGES
            yield from self.wait(self.bar["kv_ready"][s], (position // STAGES) & 1)
            self.seen[wg].append(self.slots[s])
            self.bar["kv_empty"][s].arrive(self.events)

        t = self.seek(self.begin_req, self.begin_page)
        if t[2]:
            yield from transpose(0)
            t = self.advance(t)
        it = n_req = 0
        for req in range(self.begin_req, self.end_req + 1):
            lo, hi = self.range_of(req)
            if lo < hi:
                for blk in range(lo, hi):
                    if blk > lo and not self.p_in_registers:  # the previous page's P.V is done
                        self.bar["p_free"][1 - it % 2].arrive(self.events)
                    if t[2]:
                        yield from transpose(it + 1)
                        t = self.advance(t)
                    if producer and cursor[2]:
                        yield from self.load_page(cursor, it + STAGES)
                        cursor = self.advance(cursor)
                    yield from self.wait(self.bar["p_ready"][it % 2], (it // 2) & 1)
                    if self.p_in_registers:  # P loaded into registers: its buffer is free before the P.V wgmma
                        self.bar["p_free"][it % 2].arrive(self.events)
                    it += 1
                if not self.p_in_registers:
                    self.bar["p_free"][(it - 1) % 2].arrive(self.events)
                yield from self.wait(self.bar["epi_ready"], n_req & 1)
                self.bar["epi_free"].arrive(self.events)
                n_req += 1

    def run(self) -> str:
        running = {"softmax": self.softmax(), "left": self.pv("left"), "right": self.pv("right")}
        while running:
            before = len(self.events)
            finished = False
            for name in random.sample(list(running), len(running)):
                try:
                    next(running[name])
                except StopIteration:
                    del running[name]
                    finished = True
            if running and not finished and len(self.events) == before:
                return f"deadlock, blocked: {sorted(running)}"
        want = [(req, k) for req in range(self.begin_req, self.end_req + 1) for k in range(*self.range_of(req))]
        for name, pages in [("TMA", self.loaded)] + list(self.seen.items()):
            if pages != want:
                return f"{name} saw {pages[:4]}... instead of {want[:4]}..."
        return "ok"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producer", choices=["softmax", "pv"], default="softmax")
    parser.add_argument("--stages", type=int, default=2, help="KV ring slots of the FP8 kernel modelled")
    parser.add_argument("--p-in-registers", action="store_true")
    parser.add_argument("--trials", type=int, default=300)
    args = parser.parse_args()
    global STAGES
    STAGES = args.stages
    random.seed(0)
    g = torch.Generator().manual_seed(0)
    failed = total = 0
    for trial in range(args.trials):
        b = int(torch.randint(1, 12, (1,), generator=g))
        seqlens = torch.randint(0, 900, (b,), generator=g, dtype=torch.int32)
        seqlens[torch.rand(b, generator=g) < 0.25] = 0
        seqlens[torch.rand(b, generator=g) < 0.15] = 1
        meta, _ = fp8mla.get_mla_metadata(seqlens, 64, 1, num_parts=int(torch.randint(1, 12, (1,), generator=g)))
        max_pages = max((int(n) + 63) // 64 for n in seqlens)
        for row in meta.tolist():
            result = Part((row[BEGIN_REQ], row[BEGIN_PAGE], row[END_REQ], row[END_PAGE]), seqlens.tolist(),
                          max_pages, args.producer, args.p_in_registers).run()
            total += 1
            if result != "ok":
                failed += 1
                if failed <= 5:
                    print(f"trial {trial}, part {row[:4]}, seqlens {seqlens.tolist()}: {result}")
    print(f"{total} parts simulated ({args.producer} warpgroup as TMA producer"
          f"{', P in registers' if args.p_in_registers else ''}): {failed} failed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
