"""Makespan model of the ws backward's block order (no GPU needed): list scheduling of its CTAs.

    python csrc/ws_block_order_model.py            (the published shapes, a few seconds)

The work lists are cuda_backend.ws_kv_work's. One CTA per (kv item, kv head) lasts its query
tiles x the GQA group (steps) plus a fixed overhead; 132 are resident (one per SM) and a new one
starts, in block order, on the first SM to finish. Printed per shape: the makespan of each order
over the ideal (total work / 132):
  head-major  all items of kv head 0, then of kv head 1, ... (the order before the bands)
  banded      the kernel's: items 0 .. n_long - 1 of every kv head, then the rest, head-major in
              each band (n_long: item field 5, LONG_BAND)
  item-major  all kv heads of item 0, then of item 1, ... (longest-processing-time first; worse
              for L2, csrc/ws_l2_model.py)

What it predicted: head-major +12.6 % / +10.8 % over the ideal on (28, 4096, 2048 / 1024), where
the last kv head's 32 long prompt tiles start after most short response tiles, and the bands
within 0.3 % everywhere; measured on the H100 (docs/PERF.md, sixth session): backward +12 % on
those two shapes, +5 % on (28, 16384, 2048), the rest within noise.
"""
import heapq

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops.cuda_backend import WS_CTA_OVERHEAD, modelled_makespan, ws_kv_work

SMS, HKV, GROUP, OVERHEAD = 132, 8, 4, WS_CTA_OVERHEAD  # H100 SMs, Qwen3-8B heads (32 / 8), steps per CTA start
SHAPES = [(n, p, r) for r in (2048, 1024) for n, p in ((28, 4096), (28, 16384), (16, 32768), (28, 32768), (16, 65536))]


def makespan(order, steps):
    """Finish time of the last CTA when `order` (item indices) starts in sequence on SMS SMs."""
    free = [0.0] * SMS
    for item in order:
        heapq.heappush(free, heapq.heappop(free) + steps[item])
    return max(free)


def orders(items):
    """The two orders the kernel does not take (its own, banded, is cuda_backend.modelled_makespan's)."""
    n = len(items)
    head_major = [i for _ in range(HKV) for i in range(n)]
    item_major = [i for i in range(n) for _ in range(HKV)]
    return {"head-major": head_major, "item-major": item_major}


def main():
    for n, p, r in SHAPES:
        items, _ = ws_kv_work(SegmentTable.from_group_lengths([(p, [r] * n)], device="cpu"))
        steps = [it[4] * GROUP + OVERHEAD for it in items]
        ideal = sum(steps) * HKV / SMS
        other = orders(items)
        spans = {"head-major": makespan(other["head-major"], steps),
                 "banded": modelled_makespan(items, HKV, GROUP, SMS),
                 "item-major": makespan(other["item-major"], steps)}
        cells = [f"{name} +{100 * (span / ideal - 1):.1f} %" for name, span in spans.items()]
        print(f"({n}, {p}, {r}): {len(items)} items, {items[0][5]} long;", ", ".join(cells))


if __name__ == "__main__":
    main()
