"""L2 reuse model of the ws backward's schedule (no GPU needed): which (query head, 64-row query
tile) each resident CTA touches per step, replayed through an LRU cache.

    python csrc/ws_l2_model.py 16 32768 2048        (about 3 minutes: 11 schedules x 3 caches)
    python csrc/ws_l2_model.py 4 512 32768 --hkv 4 --head-parts 1,2,4 --only-committed
        (Hq / Hkv = 32 / 4; the committed lists with the long band in 1, 2 and 4 head parts)

The work lists are cuda_backend.ws_kv_work's; 132 CTAs are resident (one per SM), a new one
starts, in block order, where one ends; every step touches one 64 KB object (the Q and dO tiles,
32 KB, and the fp32 dQ rows the step reduce-adds into, 32 KB). Each CTA steps at its own speed
(1 +- jitter), since CTAs do not stay in lockstep on the GPU. Printed: the miss rate for each
schedule, for a 25 MB cache (jitter 0.05), a 35 MB one and a 25 MB one with jitter 0.15:
- one CTA per (key tile, kv head) walking the group's query heads (the kernel): block order
  item-major (all kv heads of a key tile together, before 2026-11-22) or kv-head-major (the
  default since) x range order (own causal rows first / children first) x walk (heads outer /
  heads inner);
- one CTA per (key tile, query head) (flash-attn-4's backward grid): key tiles heaviest first
  or in row order, query-head-major;
- the committed lists (cuda_backend.ws_kv_work with the split: key tiles that would outlast the
  grid split by query rows and the list grouped by response, each walk taking a head's query
  tiles last first; else the phase-aligned walks: each head's walk over a prompt's children starts
  where the last CTA of its kv head was) in the kernel's two-band order; for a split list also in
  list order (before the reversed walks).

What it is good for: ranking schedules, not absolute numbers. It predicted the kv-head-major
order's gain (25 MB, jitter 0.05: 90 % -> 24 % misses); measured with ncu on the H100, (16, 32768,
2048): DRAM traffic 388 -> 113 GB, L2 hit rate of the loads 56 -> 77 %, of the reduces 81 -> 90 %
(docs/PERF.md "Third GPU session of 2026-11-22"). The H100's L2 behaves like a cache of 25-30 MB
for this stream (it is two partitions), which is where the item-major order fell off its cliff.
One query head per CTA: 33 % -> 4 % misses on (28, 16384, 2048) in the model; an ablation of the
kernel with that grid measured DRAM 43 -> 27 GB and L2 hit 89.6 -> 93.5 % (docs/PERF.md,
"Eleventh session"). The phase-aligned walks: 37 -> 14 % (jitter 0.05) in the model; measured
DRAM 32.8 -> 20.0 GB, L2 hit 91.5 -> 95.0 % (docs/PERF.md, "Fourteenth session").
"""
import argparse
import collections
import heapq
import itertools
import random

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops.cuda_backend import split_slots, ws_kv_work

TILE = 64


def range_tiles(rs):
    """The 64-row query tiles (their local first rows) of ranges [a, b, loc, causal], in order."""
    return [loc + TILE * i for a, b, loc, _ in rs for i in range((b - a + TILE - 1) // TILE)]


def query_tiles(item, ranges, kids_first):
    rs = [ranges[r] for r in range(item[2], item[3])]
    if kids_first:
        rs = [g for g in rs if not g[3]] + [g for g in rs if g[3]]
    return range_tiles(rs)


def cta_walk(tiles, heads, heads_inner):
    if heads_inner:
        return ((h, x) for x in tiles for h in heads)
    return ((h, x) for h in heads for x in tiles)


def phase_walk(item, ranges, heads, pos):
    """A phase-aligned walk (kv item field 7 < 0; dkdv_ws_kernel): per head the children's tiles
    (listed first) from the one last published in pos[(slot, kv head)], round, then the own."""
    rs = [ranges[r] for r in range(item[2], item[3])]
    kids, own = range_tiles([g for g in rs if not g[3]]), range_tiles([g for g in rs if g[3]])
    key = (item[7], heads[0] // len(heads))
    for h in heads:
        o = pos.get(key, 0)
        for j in range(len(kids)):
            pos[key] = (o + j) % len(kids)
            yield h, kids[pos[key]]
        for x in own:
            yield h, x


def kernel_blocks(n_items, hkv, group, order):
    """(item, query heads) per block of the kernel's grid: one CTA per key tile and kv head."""
    pairs = ([(b // hkv, b % hkv) for b in range(n_items * hkv)] if order == "item"
             else [(b % n_items, b // n_items) for b in range(n_items * hkv)])
    return [(it, tuple(range(hk * group, (hk + 1) * group))) for it, hk in pairs]


def banded_blocks(items, hkv, group, head_parts=1):
    """The kernel's grid as dkdv_ws_kernel maps it (map_block): the first n_long items (field 5)
    of every kv head, then the rest, kv-head-major within each band; every CTA walks its kv head's
    group, or with head_parts > 1 a long item's CTA part j of it (kv-head-major, then part-major;
    a prompt tail's part, field 7 > 0, walked whole by part 0)."""
    n_long = items[0][5]
    blocks = []
    for b in range(len(items) * hkv + n_long * hkv * (head_parts - 1)):
        in_long = b < n_long * hkv * head_parts
        bb = b - (0 if in_long else n_long * hkv * head_parts)
        band = n_long if in_long else len(items) - n_long
        parts = head_parts if in_long else 1
        it = (0 if in_long else n_long) + bb % band
        hk, part = divmod(bb // band, parts)
        if parts > 1 and items[it][7] > 0:
            if part:
                continue
            parts = 1
        heads = group // parts
        blocks.append((it, tuple(range(hk * group + part * heads, hk * group + (part + 1) * heads))))
    return blocks


def head_blocks(items, hq, row_order):
    """One CTA per key tile and query head, query-head-major; key tiles heaviest first or by row."""
    idx = sorted(range(len(items)), key=lambda i: items[i][0]) if row_order else range(len(items))
    return [(it, (h,)) for h in range(hq) for it in idx]


def miss_rate(items, ranges, blocks, kids_first, heads_inner, cache_mb, jitter, sms=132, seed=0, reverse=False):
    """reverse: each head's query tiles last first (the kernel's walks of a split list)."""
    rnd = random.Random(seed)
    cap = int(cache_mb * 1024 / 64)
    lru, misses, touches = collections.OrderedDict(), 0, 0
    heap, nxt, tie, pos = [], 0, itertools.count(), {}

    def start(b, t):
        it, heads = blocks[b]
        tiles = query_tiles(items[it], ranges, kids_first)
        walk = (phase_walk(items[it], ranges, heads, pos) if items[it][7] < 0 else
                cta_walk(tiles[::-1] if reverse else tiles, heads, heads_inner))
        heapq.heappush(heap, (t, next(tie), walk, 1.0 + rnd.uniform(-jitter, jitter)))

    while nxt < min(sms, len(blocks)):
        start(nxt, 0.0)
        nxt += 1
    while heap:
        t, _, walk, speed = heapq.heappop(heap)
        key = next(walk, None)
        if key is None:
            if nxt < len(blocks):
                start(nxt, t)
                nxt += 1
            continue
        touches += 1
        if key in lru:
            lru.move_to_end(key)
        else:
            misses += 1
            lru[key] = None
            if len(lru) > cap:
                lru.popitem(last=False)
        heapq.heappush(heap, (t + speed, next(tie), walk, speed))
    return misses / touches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("n", type=int)
    ap.add_argument("p", type=int)
    ap.add_argument("r", type=int)
    ap.add_argument("--hkv", type=int, default=8, help="kv heads (Hq = 32)")
    ap.add_argument("--head-parts", default="1", help="comma-separated head parts of the committed lists' long band")
    ap.add_argument("--only-committed", action="store_true", help="skip the historical schedules")
    args = ap.parse_args()
    n, p, r = args.n, args.p, args.r
    hq, hkv = 32, args.hkv
    group = hq // hkv
    items, ranges = ws_kv_work(SegmentTable.from_group_lengths([(p, [r] * n)]))
    schedules = [] if args.only_committed else (
        [(f"{order}-major", kernel_blocks(len(items), hkv, group, order), kids_first, heads_inner)
         for order, kids_first, heads_inner in itertools.product(("item", "kv-head"), (False, True), (False, True))]
        + [(f"1 query head per CTA, {'row order' if row else 'heaviest first'}",
            head_blocks(items, hq, row), False, False) for row in (False, True)])
    # the committed lists: key tiles that outlast the grid split by query rows, grouped by response
    # (cuda_backend.split_by_rows), else phase-aligned walks (_phase_walks); their own item and
    # range lists, in the kernel's band order
    s_items, s_ranges = ws_kv_work(SegmentTable.from_group_lengths([(p, [r] * n)]), split=(hkv, group, 132),
                                   phase=True)
    print(f"(N, P, R) = ({n}, {p}, {r}), Hq = {hq}, Hkv = {hkv}: miss rate of the (Q/dO + dQ) tiles")
    print("| grid / block order | ranges | heads | 25 MB | 35 MB | 25 MB, jitter 0.15 |")
    print("|---|---|---|---|---|---|")
    # a split list's walks take each head's query tiles last first (dkdv_ws_kernel, reverse_rows)
    split = split_slots(s_items) > 0
    for parts in (int(x) for x in args.head_parts.split(",")):
        if group % parts or (parts > 1 and split_slots(s_items)):
            raise SystemExit(f"{parts} head parts: they must divide the group of {group} and the list must be unsplit")
        schedules.append(("committed (bands, split by rows when a tile outlasts the grid, else phase-aligned walks)"
                          + (f", long band in {parts} head parts" if parts > 1 else ""),
                          banded_blocks(s_items, hkv, group, parts), False, False))
    if split:
        schedules.append(("committed, the split list's walks in list order (MEGATRON_DUALKV_WS_REVERSE_ROWS=0)",
                          banded_blocks(s_items, hkv, group), False, False))
    for name, blocks, kids_first, heads_inner in schedules:
        its, rgs = (s_items, s_ranges) if name.startswith("committed") else (items, ranges)
        reverse = split and name.startswith("committed (")
        rates = [miss_rate(its, rgs, blocks, kids_first, heads_inner, mb, jit, reverse=reverse)
                 for mb, jit in ((25, 0.05), (35, 0.05), (25, 0.15))]
        walk = "-" if len(blocks[0][1]) == 1 else ("inner" if heads_inner else "outer")
        print(f"| {name} | {'children first' if kids_first else 'own first'} | {walk} | "
              + " | ".join(f"{100 * x:.1f} %" for x in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
