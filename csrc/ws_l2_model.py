"""L2 reuse model of the ws backward's schedule (no GPU needed): which (query head, 64-row query
tile) each resident CTA touches per step, replayed through an LRU cache.

    python csrc/ws_l2_model.py 16 32768 2048        (about 2 minutes: 8 schedules x 3 caches)

The work lists are cuda_backend.ws_kv_work's; 132 CTAs are resident (one per SM), a new one
starts, in block order, where one ends; every step touches one 64 KB object (the Q and dO tiles,
32 KB, and the fp32 dQ rows the step reduce-adds into, 32 KB). Each CTA steps at its own speed
(1 +- jitter), since CTAs do not stay in lockstep on the GPU. Printed: the miss rate for each
block order (item-major: all kv heads of a key tile together, the order before 2026-11-22;
kv-head-major: the default since) x range order (own causal rows first / children first) x walk
(heads outer / heads inner), for a 50 MB and a 25 MB cache.

What it is good for: ranking schedules, not absolute numbers. It predicted the kv-head-major
order's gain (25 MB, jitter 0.05: 90 % -> 24 % misses); measured with ncu on the H100, (16, 32768,
2048): DRAM traffic 388 -> 113 GB, L2 hit rate of the loads 56 -> 77 %, of the reduces 81 -> 90 %
(docs/PERF.md "Third GPU session of 2026-11-22"). The H100's L2 behaves like a cache of 25-30 MB
for this stream (it is two partitions), which is where the item-major order fell off its cliff.
"""
import collections
import heapq
import itertools
import random
import sys

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops.cuda_backend import ws_kv_work

TILE = 64


def query_tiles(item, ranges, kids_first):
    rs = [ranges[r] for r in range(item[2], item[3])]
    if kids_first:
        rs = [g for g in rs if not g[3]] + [g for g in rs if g[3]]
    return [loc + TILE * i for a, b, loc, _ in rs for i in range((b - a + TILE - 1) // TILE)]


def cta_walk(tiles, hk, group, heads_inner):
    if heads_inner:
        return ((hk * group + hh, x) for x in tiles for hh in range(group))
    return ((hk * group + hh, x) for hh in range(group) for x in tiles)


def miss_rate(items, ranges, hkv, group, order, kids_first, heads_inner, cache_mb, jitter, sms=132, seed=0):
    rnd = random.Random(seed)
    ni = len(items)
    blocks = [(b // hkv, b % hkv) if order == "item" else (b % ni, b // ni) for b in range(ni * hkv)]
    cap = int(cache_mb * 1024 / 64)
    lru, misses, touches = collections.OrderedDict(), 0, 0
    heap, nxt, tie = [], 0, itertools.count()

    def start(b, t):
        it, hk = blocks[b]
        walk = cta_walk(query_tiles(items[it], ranges, kids_first), hk, group, heads_inner)
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
    n, p, r = (int(x) for x in sys.argv[1:4])
    hq, hkv = 32, 8
    items, ranges = ws_kv_work(SegmentTable.from_group_lengths([(p, [r] * n)]))
    print(f"(N, P, R) = ({n}, {p}, {r}), Hq = {hq}, Hkv = {hkv}: miss rate of the (Q/dO + dQ) tiles")
    print("| block order | ranges | heads | 50 MB | 25 MB | 25 MB, jitter 0.05 |")
    print("|---|---|---|---|---|---|")
    for order, kids_first, heads_inner in itertools.product(("item", "kv-head"), (False, True), (False, True)):
        rates = [miss_rate(items, ranges, hkv, hq // hkv, order, kids_first, heads_inner, mb, jit)
                 for mb, jit in ((50, 0.0), (25, 0.0), (25, 0.05))]
        print(f"| {order} | {'children first' if kids_first else 'own first'} | {'inner' if heads_inner else 'outer'} | "
              + " | ".join(f"{100 * x:.1f} %" for x in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
