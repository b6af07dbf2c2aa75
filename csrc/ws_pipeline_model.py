"""Host model of the synchronization protocols of csrc/dualkv_fwd_ws_sm90.cu and
csrc/dualkv_bwd_ws_sm90.cu (no GPU needed).

    python csrc/ws_pipeline_model.py        (about a minute; prints "ok")

For each kernel the producer and the two consumer warpgroups are replayed step for step (the same waits,
arrivals and MMA issue/wait order as the kernel, a warpgroup modelled as one agent) under random
interleavings, with TMA completions and wgmma-group completions at random later times. mbarriers
follow PTX semantics (arrival count + transaction bytes, phases, try_wait.parity); named barriers
count the other warpgroup's arrivals. Checked: no deadlock, every MMA reads the stage holding
the tile it wants, no TMA write lands in a stage an MMA still reads, one phase never mixes two
tiles' arrivals, and no named-barrier arrival is left over. It models the protocol, not the
kernel: change both together.
"""
import random, sys

S = 3

class MBar:
    def __init__(s, count): s.count, s.pend, s.tx, s.phase = count, count, 0, 0
    def arrive(s, tx=0):
        s.tx += tx; s.pend -= 1; assert s.pend >= 0, "too many arrivals in one phase"; s._chk()
    def complete_tx(s, b): s.tx -= b; assert s.tx >= 0; s._chk()
    def _chk(s):
        if s.pend == 0 and s.tx == 0: s.phase += 1; s.pend = s.count
    def done(s, parity): return (s.phase & 1) != parity

class Named:
    def __init__(s): s.arr = 0; s.gen = 0   # arrivals of the other WG (128 each, modelled as 1)
    
def run(n, seed):
    rnd = random.Random(seed)
    q_full = MBar(1); kf = [MBar(1) for _ in range(S)]; vf = [MBar(1) for _ in range(S)]
    ke = [MBar(2) for _ in range(S)]; ve = [MBar(2) for _ in range(S)]   # 2 WGs (8 warps modelled as 2)
    stageK = [None]*S; stageV = [None]*S  # tile held (after TMA lands)
    readersK = [set() for _ in range(S)]; readersV = [set() for _ in range(S)]
    tma = []  # pending (kind, stage, tile, bar)
    named = [0, 0]  # pending arrivals on barrier w (from the other WG)
    mma = {0: [], 1: []}  # pending groups per WG: list of (kind, stage, tile)
    kv_start = lambda t: t
    def producer():
        q_full.arrive(tx=1); tma.append(("Q", 0, 0, q_full))
        for t in range(n):
            st = t % S; par = (t // S) & 1
            if t >= S:
                while not ke[st].done(par ^ 1): yield
            kf[st].arrive(tx=1); tma.append(("K", st, t, kf[st]))
            if t >= S:
                while not ve[st].done(par ^ 1): yield
            vf[st].arrive(tx=1); tma.append(("V", st, t, vf[st]))
    def issue(w, kind, t):
        st = t % S
        if kind == "K": assert stageK[st] == t, f"WG{w} S({t}) reads stage holding {stageK[st]}"; readersK[st].add((w, t))
        else: assert stageV[st] == t, f"WG{w} PV({t}) reads stage holding {stageV[st]}"; readersV[st].add((w, t))
        mma[w].append((kind, st, t))
    def wait_groups(w, keep):
        while len(mma[w]) > keep: yield
    def nsync(w):
        while named[w] == 0: yield
        named[w] -= 1
    def narrive(w): named[w ^ 1] += 1
    def consumer(w):
        while not q_full.done(0): yield
        if w == 1: narrive(1)
        while not kf[0].done(0): yield
        yield from nsync(w)
        issue(w, "K", 0)
        if w == 0 or n > 1: narrive(w)
        yield from wait_groups(w, 0)
        ke[0].arrive()
        for t in range(1, n):
            st, sp = t % S, (t - 1) % S
            yield from wait_groups(w, 0)
            if t >= 2: ve[(t - 2) % S].arrive()
            while not kf[st].done((t // S) & 1): yield
            while not vf[sp].done(((t - 1) // S) & 1): yield
            yield from nsync(w)
            issue(w, "K", t); issue(w, "V", t - 1)
            if w == 0 or t + 1 < n: narrive(w)
            yield from wait_groups(w, 1)
            ke[st].arrive()
        yield from wait_groups(w, 0)
        if n >= 2: ve[(n - 2) % S].arrive()
        sl = (n - 1) % S
        while not vf[sl].done(((n - 1) // S) & 1): yield
        issue(w, "V", n - 1)
        yield from wait_groups(w, 0)
        ve[sl].arrive()
    agents = {"P": producer(), "C0": consumer(0), "C1": consumer(1)}
    live = set(agents)
    steps = 0
    while live or tma or mma[0] or mma[1]:
        steps += 1
        assert steps < 200000, "deadlock"
        choice = rnd.random()
        if tma and choice < 0.2:
            kind, st, t, bar = tma.pop(rnd.randrange(len(tma)))
            if kind == "K": assert not readersK[st], f"TMA K{t} overwrites stage {st} while read by {readersK[st]}"; stageK[st] = t
            if kind == "V": assert not readersV[st], f"TMA V{t} overwrites stage {st} while read by {readersV[st]}"; stageV[st] = t
            bar.complete_tx(1); continue
        w = rnd.randrange(2)
        if mma[w] and choice < 0.4:   # the oldest group of WG w completes (groups complete in order)
            kind, st, t = mma[w].pop(0)
            (readersK if kind == "K" else readersV)[st].discard((w, t)); continue
        if not live: continue
        a = rnd.choice(sorted(live))
        try: next(agents[a])
        except StopIteration: live.discard(a)
    assert named == [0, 0], f"unconsumed named-barrier arrivals {named}"
    return steps

def run_bwd(n, seed, d128=True):
    """The ws backward (csrc/dualkv_bwd_ws_sm90.cu): a Q/dO/lse/delta ring of S stages, K/V once,
    dS^T exchanged through a double buffer (D = 128: 256-thread barrier; D = 64: own half only)."""
    rnd = random.Random(seed)
    kv_full = MBar(1)
    qf = [MBar(2) for _ in range(S)]   # producer lane 0 (expect_tx) + the lanes' lse/delta arrival
    em = [MBar(2) for _ in range(S)]
    stage = [None] * S
    readers = [set() for _ in range(S)]
    ds = [[None, None], [None, None]]           # ds[buffer][half] = step written
    ds_readers = [[set(), set()], [set(), set()]]   # ds_readers[buffer][half]: (wg, step) MMAs reading it
    tma, mma = [], {0: [], 1: []}
    bar = {"n": 0, "gen": 0}                    # 256-thread named barrier as a generation counter
    def producer():
        kv_full.arrive(tx=1); tma.append((None, None, kv_full))
        for i in range(n):
            st = i % S
            if i >= S:
                while not em[st].done(((i // S) & 1) ^ 1): yield
            qf[st].arrive(tx=1); tma.append((st, i, qf[st]))
            yield
            qf[st].arrive()   # the lanes' lse/delta stores, released by their arrival
    def barrier():
        g = bar["gen"]; bar["n"] += 1
        if bar["n"] == 2: bar["n"] = 0; bar["gen"] += 1
        while bar["gen"] == g: yield
    def consumer(w):
        while not kv_full.done(0): yield
        for i in range(n):
            st, b = i % S, i & 1
            while not qf[st].done((i // S) & 1): yield
            assert stage[st] == i, f"WG{w} step {i} reads stage {st} holding {stage[st]}"
            readers[st].add((w, i)); mma[w].append(("st", st, i))
            while mma[w]: yield
            assert not ds_readers[b][w], f"WG{w} step {i} overwrites dS half {w} of buffer {b} under {ds_readers[b][w]}"
            ds[b][w] = i
            if d128:
                yield from barrier()
            halves = (0, 1) if d128 else (w,)
            for hlf in halves:
                assert ds[b][hlf] == i, f"WG{w} step {i} reads dS half {hlf} of step {ds[b][hlf]}"
            readers[st].add((w, i)); mma[w].append(("st+ds", st, i))
            for hlf in halves:
                ds_readers[b][hlf].add((w, i))
            while mma[w]: yield
            em[st].arrive()
    agents = {"P": producer(), "C0": consumer(0), "C1": consumer(1)}
    live, steps = set(agents), 0
    while live or tma or mma[0] or mma[1]:
        steps += 1
        assert steps < 200000, "deadlock"
        choice = rnd.random()
        if tma and choice < 0.2:
            st, i, mb = tma.pop(rnd.randrange(len(tma)))
            if st is not None:
                assert not readers[st], f"TMA step {i} overwrites stage {st} while read by {readers[st]}"
                stage[st] = i
            mb.complete_tx(1); continue
        w = rnd.randrange(2)
        if mma[w] and choice < 0.4:
            kind, st, i = mma[w].pop(0)
            readers[st].discard((w, i))
            if kind == "st+ds":
                for hlf in (0, 1):
                    ds_readers[i & 1][hlf].discard((w, i))
            continue
        if not live: continue
        a_ = rnd.choice(sorted(live))
        try: next(agents[a_])
        except StopIteration: live.discard(a_)
    return steps


if __name__ == "__main__":
    for n in list(range(1, 12)) + [40]:
        for seed in range(300):
            run(n, seed)
            run_bwd(n, seed, d128=True)
            run_bwd(n, seed, d128=False)
    print("ok")
