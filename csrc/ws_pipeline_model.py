"""Host model of the synchronization protocols of csrc/dualkv_fwd_ws_sm90.cu,
csrc/dualkv_bwd_ws_sm90.cu and csrc/dualkv_dq_ws_sm90.cu (no GPU needed).

    python csrc/ws_pipeline_model.py        (about 15 s; prints the caught mutations, then "ok")

For each kernel the producer and the two consumer warpgroups are replayed step for step (the same waits,
arrivals and MMA issue/wait order as the kernel, a warpgroup modelled as one agent) under random
interleavings, with TMA completions and wgmma-group completions at random later times. mbarriers
follow PTX semantics (arrival count + transaction bytes, phases, try_wait.parity); named barriers
count the other warpgroup's arrivals. Checked: no deadlock, every MMA reads the stage holding
the tile it wants, no TMA write lands in a stage an MMA still reads, one phase never mixes two
tiles' arrivals, and no named-barrier arrival is left over. The forward is also replayed as a
persistent CTA taking several query tiles (the ring and the turns running on, Q reloaded after
q_empty), with mutations it must catch (FWD_MUTATIONS). The backward model splits each
consumer into thread 0 and the other 127 threads and covers both dQ modes (atomics; TMA
reduce-add through a staging tile, MEGATRON_DUALKV_WS_DQ=tma) and both step widths (64 rows;
80, the default at head dim 128), with mutations of the staging protocol that it must catch
(BWD_MUTATIONS). It models the protocol, not the kernel: change both together.
"""
import itertools, random, sys

S = 3

class MBar:
    def __init__(s, count): s.count, s.pend, s.tx, s.phase = count, count, 0, 0
    def arrive(s, tx=0):
        s.tx += tx; s.pend -= 1; assert s.pend >= 0, "too many arrivals in one phase"; s._chk()
    def complete_tx(s, b): s.tx -= b; assert s.tx >= 0; s._chk()
    def _chk(s):
        if s.pend == 0 and s.tx == 0: s.phase += 1; s.pend = s.count
    def done(s, parity): return (s.phase & 1) != parity

class NamedBar:
    """Named barrier with one-sided use (turns, dQ staging): some agents bar.sync, the others
    bar.arrive; completes when all `parties` have arrived. An agent arriving twice in one
    generation (which the hardware would silently count) is a protocol error."""
    def __init__(s, parties): s.parties, s.arrived, s.gen = parties, set(), 0
    def _arrive(s, who):
        assert who not in s.arrived, f"{who} arrives twice in one named-barrier generation"
        s.arrived.add(who)
        if len(s.arrived) == s.parties: s.arrived = set(); s.gen += 1
    def arrive(s, who): s._arrive(who)
    def sync(s, who):
        g = s.gen; s._arrive(who)
        while s.gen == g: yield


BWD_MUTATIONS = {   # mutation -> what the kernel would do wrong (each must make run_bwd fail)
    "no_ds_empty_wait": "dS^T: a consumer overwrites its half without waiting for the dQ MMAs of step i-2",
    "no_ds_full_wait": "dS^T: the dQ MMA of step i-1 is issued without waiting for the halves it reads",
    "td_ring_3": "the tile-descriptor ring has 3 slots (one per stage) although dQ lags one step",
    "no_read_wait": "dQ staging: thread 0 never waits for the previous reduce's smem read",
    "no_pre_staging_barrier": "dQ staging: the stores do not wait at barrier 6 + cw for thread 0's read wait",
    "no_staging_barrier": "dQ staging: the reduce is issued without barrier 4 + cw after the stores",
    "no_final_wait": "dQ staging: the CTA exits with a reduce still in flight",
    "pre_staging_r_arrives": "dQ staging: warps 1-3 only arrive at barrier 6 + cw (do not wait for warp 0's read wait)",
    "staging_e_arrives": "dQ staging: warp 0 only arrives at barrier 4 + cw and issues the reduce before warps 1-3 stored",
    "last_turn_passes": "turns: consumer 1's last section passes the turn on (an arrival nobody consumes)",
    "wide_release_before_b": "wide steps: the stage is released before dV / dK have completed",
    "no_kv_tma_wait": "prompt tail: the producer writes the tail rows without waiting for the K/V box to land",
    "tail_box_on_kv_full": "prompt tail: the K/V box completes kv_full itself, so the consumers may start before the tail rows are written",
}
WIDE_ONLY = {"wide_release_before_b"}  # mutations of the wide walk (checked with wide=True)
TAIL_ONLY = {"no_kv_tma_wait", "tail_box_on_kv_full"}  # mutations of a prompt tail's tile (tail=True)


def run_bwd(n, seed, d128=True, tma_dq=False, turns=True, mutation=None, wide=False, tail=False):
    """The ws backward (csrc/dualkv_bwd_ws_sm90.cu): a Q/dO/lse/delta ring of S stages, K/V once,
    tile descriptors in a ring of 8, dS^T in two buffers of two key halves (consumer h writes half
    h) with full / empty mbarriers, and dQ one step behind: step i's second MMA group holds dV, dK
    of step i and dQ of step i-1 (D = 128: both halves of buffer (i-1)&1; D = 64: its own half);
    the dQ of the last step is a group of its own. wide (80-row steps, the default at head dim 128;
    needs d128 and tma_dq): a ring of 2 stages; dV, dK are a group of their own inside the turn, and
    dQ of step i-1 is issued outside the turns once they have completed, the stage released
    between the two. turns: the consumers take turns issuing their MMA groups (named barriers
    8 + cw). tail (a response's first key tile holding its prompt's tail keys): the K/V box lands
    on kv_tma, the producer waits for it, writes the tail rows over the box's first rows, then
    arrives on kv_full; the consumers must find both. Each consumer warpgroup is two agents: "e" (warp 0, whose
    lane 0 issues the dQ reduces) and "r" (warps 1-3); wgmma is
    warp-synchronous only, so each agent issues and waits for its own part of every MMA. tma_dq:
    dQ goes through the consumer's staging tile and a TMA reduce whose smem read and global write
    complete at random later times; the stores of step j's dQ end step j + 1, its reduce is issued
    after the consumer's next MMA group (step j + 2's S/dP, or the last dQ). Checked: every MMA reads the stage and dS^T halves of its step,
    no TMA lands in a stage still read, no dS^T half is rewritten under a dQ MMA, descriptors are
    read before the producer reuses their slot, no store into the staging tile while a reduce
    reads it, each reduce reads one step's tile from both agents, turn barriers balanced, nothing
    in flight when the CTA exits, no deadlock."""
    assert mutation is None or mutation in BWD_MUTATIONS
    assert not wide or (d128 and tma_dq), "wide steps: head dim 128, dQ by TMA"
    S = 2 if wide else 3
    rnd = random.Random(seed)
    ring = 3 if mutation == "td_ring_3" else 8
    halves_of = lambda w: (0, 1) if d128 else (w,)
    kv_full = MBar(1)
    kv_tma = MBar(1)   # a prompt tail's tile: the box alone
    kv = {"box": False, "tail": False}
    qf = [MBar(2) for _ in range(S)]   # producer lane 0 (expect_tx) + the lanes' lse/delta arrival
    em = [MBar(4) for _ in range(S)]   # both consumers' agents
    ds_full = [[MBar(2), MBar(2)] for _ in range(2)]                       # [buffer][half]: writer's agents
    ds_empty = [[MBar(4 if d128 else 2), MBar(4 if d128 else 2)] for _ in range(2)]  # readers' agents
    stage = [None] * S
    td = [None] * ring
    readers = [set() for _ in range(S)]
    ds = [[{}, {}], [{}, {}]]                   # ds[buffer][half][agent] = step written
    ds_readers = [[set(), set()], [set(), set()]]
    stg = [{}, {}]
    stg_reads, stg_writes = [[], []], [[], []]
    tma, mma = [], {}
    turn = [NamedBar(4), NamedBar(4)]             # turn[w]: w's agents sync, the other's arrive
    # ids 6 + cw ("e" arrives after its read wait, "r" waits) and 4 + cw ("r" arrives after its
    # stores, "e" waits, then issues the reduce): one-sided, so an agent arriving twice in one
    # generation (which the hardware would count) fails like on the turn barriers
    pre_bar = [NamedBar(2), NamedBar(2)]
    stg_bar = [NamedBar(2), NamedBar(2)]
    exited = set()

    def producer():
        box_bar = kv_tma if tail and mutation != "tail_box_on_kv_full" else kv_full
        box_bar.arrive(tx=1); tma.append(("KV", None, box_bar))
        if tail:
            if mutation != "no_kv_tma_wait":
                while not kv_tma.done(0): yield
            kv["tail"] = True   # the tail rows over the box's first rows, then fence.proxy.async
            yield
            if mutation != "tail_box_on_kv_full": kv_full.arrive()
        for i in range(n):
            st = i % S
            if i >= S:
                while not em[st].done(((i // S) & 1) ^ 1): yield
            td[i % ring] = i
            qf[st].arrive(tx=1); tma.append((st, i, qf[st]))
            yield
            qf[st].arrive()

    def mma_wait(me):
        while mma.get(me): yield

    def take(w, me):
        if turns: yield from turn[w].sync(me)

    def give(w, me, last):
        if turns and not (last and w == 1 and mutation != "last_turn_passes"):
            turn[w ^ 1].arrive(me)

    def store_dq(w, ag, j):
        assert td[j % ring] == j, f"WG{w}{ag} dQ of step {j} reads descriptor slot holding step {td[j % ring]}"
        if not tma_dq: return
        if ag == "e" and mutation != "no_read_wait":
            while stg_reads[w]: yield   # cp.async.bulk.wait_group.read 0
        if mutation != "no_pre_staging_barrier":
            if ag == "e" or mutation == "pre_staging_r_arrives": pre_bar[w].arrive(ag)
            else: yield from pre_bar[w].sync(ag)
        assert not stg_reads[w], f"WG{w}{ag} stores dQ of step {j} into the staging tile still read by the reduce of step {stg_reads[w]}"
        stg[w][ag] = j
        yield

    def reduce_dq(w, ag, j):
        """The staged dQ of step j goes out (fence, barrier 4 + cw, thread 0's reduce); the kernel
        defers this until the consumer has issued its next MMA group."""
        if not tma_dq: return
        assert td[j % ring] == j, f"WG{w}{ag} reduce of step {j} reads descriptor slot holding step {td[j % ring]}"
        if mutation != "no_staging_barrier":
            if ag == "r" or mutation == "staging_e_arrives": stg_bar[w].arrive(ag)
            else: yield from stg_bar[w].sync(ag)
        if ag == "e":
            assert all(stg[w].get(a) == j for a in "er"), f"WG{w} reduce of step {j} reads a staging tile holding {stg[w]}"
            stg_reads[w].append(j); stg_writes[w].append(j)

    def wait_ds_full(w, j):
        if mutation == "no_ds_full_wait": return
        for h in halves_of(w):
            while not ds_full[j & 1][h].done((j >> 1) & 1): yield

    def issue_dq(w, me, j):
        for h in halves_of(w):
            assert all(ds[j & 1][h].get(a) == j for a in "er"), f"WG{w}{me[1]} dQ of step {j} reads dS half {h} holding {ds[j & 1][h]}"
            ds_readers[j & 1][h].add((me, j))

    def consumer(w, ag):
        me = (w, ag)
        while not kv_full.done(0): yield
        assert kv["box"] and (kv["tail"] or not tail), f"WG{w}{ag} starts on K/V {kv} (box landed, tail rows written)"
        if n > 0:
            if turns and w == 1: turn[0].arrive(me)
            for i in range(n):
                st, b = i % S, i & 1
                while not qf[st].done((i // S) & 1): yield
                assert stage[st] == i, f"WG{w}{ag} step {i} reads stage {st} holding {stage[st]}"
                assert td[i % ring] == i, f"WG{w}{ag} step {i} reads descriptor slot holding step {td[i % ring]}"
                yield from take(w, me)
                readers[st].add((me, i)); mma.setdefault(me, []).append(("st", st, i, None))
                give(w, me, False)
                if i >= 2: yield from reduce_dq(w, ag, i - 2)   # staged at the end of step i - 1
                yield from mma_wait(me)
                # group B: dV, dK first, then dS^T stores while they run, then dQ of step i - 1
                yield from take(w, me)
                readers[st].add((me, i)); mma[me].append(("st", st, i, None))
                if wide: give(w, me, False)   # the turn covers dV, dK only
                if i >= 2 and mutation != "no_ds_empty_wait":
                    while not ds_empty[b][w].done(((i - 2) >> 1) & 1): yield
                assert not ds_readers[b][w], f"WG{w}{ag} step {i} overwrites dS half {w} of buffer {b} under {ds_readers[b][w]}"
                ds[b][w][ag] = i
                yield
                ds_full[b][w].arrive()
                if wide and i >= 1:   # dQ outside the turns, once dV, dK have completed
                    yield from wait_ds_full(w, i - 1)
                    if mutation != "wide_release_before_b": yield from mma_wait(me)
                    em[st].arrive()   # the dQ MMA reads K and dS^T only
                    issue_dq(w, me, i - 1)
                    mma[me].append(("ds", None, None, i - 1))
                if i >= 1 and not wide:
                    yield from wait_ds_full(w, i - 1)
                    issue_dq(w, me, i - 1)
                    mma[me].append(("ds", None, None, i - 1))
                if not wide: give(w, me, False)
                yield from mma_wait(me)
                if not (wide and i >= 1): em[st].arrive()
                if i >= 1:
                    for h in halves_of(w): ds_empty[(i - 1) & 1][h].arrive()
                    yield from store_dq(w, ag, i - 1)
            j = n - 1
            yield from wait_ds_full(w, j)
            yield from take(w, me)
            issue_dq(w, me, j)
            mma[me].append(("ds", None, None, j))
            give(w, me, True)
            if j >= 1: yield from reduce_dq(w, ag, j - 1)
            yield from mma_wait(me)
            yield from store_dq(w, ag, j)
            yield from reduce_dq(w, ag, j)
        if tma_dq and ag == "e" and mutation != "no_final_wait":
            while stg_reads[w] or stg_writes[w]: yield   # cp.async.bulk.wait_group 0
        exited.add(me)
        if len(exited) == 4:   # the CTA's shared memory is released
            assert not any(stg_reads) and not any(stg_writes), f"CTA exits with reduces in flight: reads {stg_reads}, writes {stg_writes}"

    agents = {"P": producer()}
    for w in (0, 1):
        for ag in "er":
            agents[f"C{w}{ag}"] = consumer(w, ag)
    live, steps = set(agents), 0
    while live or tma or any(mma.values()) or any(stg_reads) or any(stg_writes):
        steps += 1
        assert steps < 400000, "deadlock"
        choice = rnd.random()
        if tma and choice < 0.2:
            st, i, mb = tma.pop(rnd.randrange(len(tma)))
            if st == "KV":   # the whole box, its first rows included
                kv["box"], kv["tail"] = True, False
            elif st is not None:
                assert not readers[st], f"TMA step {i} overwrites stage {st} while read by {readers[st]}"
                stage[st] = i
            mb.complete_tx(1); continue
        w = rnd.randrange(2)
        if choice < 0.3 and (stg_reads[w] or stg_writes[w]):
            # bulk groups complete in order; a reduce writes dq_acc only after reading its tile
            write_ok = stg_writes[w] and (not stg_reads[w] or stg_writes[w][0] < stg_reads[w][0])
            if write_ok and (not stg_reads[w] or rnd.random() < 0.5):
                stg_writes[w].pop(0)
            else:
                stg_reads[w].pop(0)
            continue
        me = (w, rnd.choice("er"))
        if mma.get(me) and choice < 0.45:
            kind, st, i, j = mma[me].pop(0)
            if st is not None: readers[st].discard((me, i))
            if j is not None:
                for h in (0, 1): ds_readers[j & 1][h].discard((me, j))
            continue
        if not live: continue
        a_ = rnd.choice(sorted(live))
        try: next(agents[a_])
        except StopIteration: live.discard(a_)
    for t in turn + pre_bar + stg_bar:
        assert not t.arrived, f"named barrier left with arrivals {t.arrived}"
    return steps


def check_bwd_mutations(seeds=300):
    """Each mutation of BWD_MUTATIONS must fail run_bwd on some seed (else the model checks nothing)."""
    for m, what in BWD_MUTATIONS.items():
        caught = None
        for seed in range(seeds):
            for n, d128, turns in itertools.product((1, 2, 3, 7, 12), (True, False), (True, False)):
                wide = m in WIDE_ONLY
                if wide and not d128: continue
                try:
                    run_bwd(n, seed, d128, tma_dq=True, turns=turns, mutation=m, wide=wide, tail=m in TAIL_ONLY)
                except AssertionError as e:
                    caught = f"{e} (n={n}, d128={d128}, turns={turns}, wide={wide})"
                    break
                if caught: break
            if caught: break
        assert caught, f"mutation {m} ({what}) not caught"
        print(f"mutation caught: {m} ({what}): {caught}")


def _groups_run(agents, tma, mma, readers, land, rnd, limit=200000):
    """Drive the agents under random interleavings: TMA completions (land(kind, stage, tile)) and
    completions of each warpgroup's oldest wgmma group (mma[w]: groups of (kind, stage, tile)
    reads, retired in order) at random later times. readers[kind][stage]: reads in flight."""
    live, steps = set(agents), 0
    while live or tma or any(mma.values()):
        steps += 1
        assert steps < limit, "deadlock"
        choice = rnd.random()
        if tma and choice < 0.2:
            land(*tma.pop(rnd.randrange(len(tma))))
            continue
        w = rnd.choice(sorted(mma))
        if mma[w] and choice < 0.4:
            for kind, st, t in mma[w].pop(0):
                readers[kind][st].remove((w, t))
            continue
        if not live:
            continue
        a = rnd.choice(sorted(live))
        try:
            next(agents[a])
        except StopIteration:
            live.discard(a)
    return steps


class KvRing:
    """The K/V ring of the ws forward and dQ kernels (one agent per consumer warpgroup): a
    producer loading Q and K then V of every key tile into stage t % stages after both consumers
    released the stage's previous tile, wgmma groups retired in order, the consumers' turns.
    tiles: the key tiles of each query tile a CTA takes in turn (the persistent forward; default one
    query tile of n). The ring runs on across query tiles (key tile t of query tile j is the ring's
    sum of the earlier counts + t); Q of query tile j loads once both consumers arrived on q_empty
    for query tile j - 1. Checked on every read, landing and release: an MMA reads the stage holding
    its tile (and the Q of its query tile), no TMA lands in a stage (or Q) still read, one mbarrier
    phase never mixes two tiles' releases."""
    def __init__(s, n, stages, tiles=None, mutation=None, diag=(), idle=()):
        s.tiles = list(tiles) if tiles else [n]
        s.diag, s.idle = set(diag), set(idle)  # the forward's query tiles with those steps (_fwd_consumer)
        s.n, s.stages, s.mutation = s.tiles[0], stages, mutation
        s.q_full, s.q_empty = MBar(1), MBar(2)
        s.kf, s.vf = [MBar(1) for _ in range(stages)], [MBar(1) for _ in range(stages)]
        s.ke, s.ve = [MBar(2) for _ in range(stages)], [MBar(2) for _ in range(stages)]  # 2 WGs (8 warps as 2)
        s.held = {"K": [None] * stages, "V": [None] * stages, "Q": [None]}
        s.readers = {"K": [[] for _ in range(stages)], "V": [[] for _ in range(stages)], "Q": [[]]}
        s.released = {"K": [set() for _ in range(stages)], "V": [set() for _ in range(stages)]}
        s.tma, s.mma, s.named = [], {0: [], 1: []}, [0, 0]

    def producer(s):
        g = 0
        for j, n in enumerate(s.tiles):
            if j > 0 and s.mutation != "q_before_q_empty":
                while not s.q_empty.done((j - 1) & 1): yield
            s.q_full.arrive(tx=1); s.tma.append(("Q", 0, j, s.q_full))
            for t in range(g, g + n):
                st, par = t % s.stages, (t // s.stages) & 1
                if t >= s.stages:
                    while not s.ke[st].done(par ^ 1): yield
                s.kf[st].arrive(tx=1); s.tma.append(("K", st, t, s.kf[st]))
                if t >= s.stages:
                    while not s.ve[st].done(par ^ 1): yield
                s.vf[st].arrive(tx=1); s.tma.append(("V", st, t, s.vf[st]))
            g += n

    def land(s, kind, st, t, bar):
        assert not s.readers[kind][st], f"TMA {kind}{t} lands in stage {st} read by {s.readers[kind][st]}"
        s.held[kind][st] = t
        bar.complete_tx(1)

    def group(s, w, reads):  # one wgmma group of WG w reading tiles [(kind, t)] (Q: t = query tile)
        for kind, t in reads:
            st = 0 if kind == "Q" else t % s.stages
            assert s.held[kind][st] == t, f"WG{w} reads {kind}{t} from stage {st} holding {s.held[kind][st]}"
            s.readers[kind][st].append((w, t))
        s.mma[w].append([(kind, 0 if kind == "Q" else t % s.stages, t) for kind, t in reads])

    def release(s, kind, t):
        st = t % s.stages
        bar = (s.ke if kind == "K" else s.ve)[st]
        s.released[kind][st].add((bar.phase, t))
        assert len({tt for ph, tt in s.released[kind][st] if ph == bar.phase}) == 1, f"one {kind} phase mixes tiles"
        bar.arrive()

    def wait_groups(s, w, keep):
        while len(s.mma[w]) > keep: yield

    def full(s, bars, t):
        while not bars[t % s.stages].done((t // s.stages) & 1): yield

    def nsync(s, w):  # turn: bar.sync on w's barrier, consuming one arrival of the other WG
        while s.named[w] == 0: yield
        s.named[w] -= 1

    def narrive(s, w): s.named[w ^ 1] += 1

    def run(s, consumer, seed):
        agents = {"P": s.producer(), "C0": consumer(s, 0), "C1": consumer(s, 1)}
        steps = _groups_run(agents, s.tma, s.mma, s.readers, s.land, random.Random(seed))
        assert s.named == [0, 0], f"unconsumed named-barrier arrivals {s.named}"
        return steps


FWD_MUTATIONS = {  # mutation -> what the persistent forward would do wrong (each must make run fail)
    "q_before_q_empty": "the next query tile's Q loaded without waiting for q_empty",
    "q_empty_at_start": "a consumer arrives on q_empty as its query tile starts, before its S MMAs read Q",
    "no_final_take": "consumer 0 does not take consumer 1's last turn pass before it exits",
    "turn_up_front_per_tile": "consumer 1 arrives up front at every query tile, not once",
    "diag_without_turn": "consumer 0 leaves its diagonal tile out of the loop without taking that step's turn",
    "idle_without_turns": "consumer 1 without rows walks its key tiles without taking their turns",
}


def _fwd_consumer(r, w):
    """The ws forward (csrc/dualkv_fwd_ws_sm90.cu): S_t (Q, K_t) and O += P_{t-1} V_{t-1} as two
    groups of one turn; K_t released once S_t completed, V_{t-1} once its P V group did, q_empty
    once the query tile's last S completed. Every section passes the turn (consumer 1's last pass
    of a query tile is consumer 0's first turn of the next); consumer 0 takes the last pass before
    it exits. The query tile's parent tail (narrowed, no turns) is not modelled.
    Query tiles j in r.diag (n >= 2): consumer 0 leaves the last key tile (its causal diagonal) out
    of its loop, takes that step's turn empty and runs the tile after the loop without turns (S,
    K released, q_empty, then P V). Query tiles j in r.idle: consumer 1 has no rows; it arrives on
    q_empty at once and per key tile takes its turn empty, waits for K and V to load and releases
    them."""
    g = 0
    if w == 1: r.narrive(1)  # consumer 0 takes the first turn
    for j, n in enumerate(r.tiles):
        while not r.q_full.done(j & 1): yield
        if w == 1 and j > 0 and r.mutation == "turn_up_front_per_tile": r.narrive(1)
        if w == 1 and j in r.idle:
            r.q_empty.arrive()  # it never reads this Q
            for t in range(g, g + n):
                if r.mutation != "idle_without_turns":
                    yield from r.nsync(w)
                    r.narrive(w)
                yield from r.full(r.kf, t); yield from r.full(r.vf, t)
                r.release("K", t); r.release("V", t)
            g += n
            continue
        diag = w == 0 and j in r.diag and n >= 2
        nl = n - 1 if diag else n  # key tiles of the loop and its epilogue
        if r.mutation == "q_empty_at_start": r.q_empty.arrive()
        yield from r.full(r.kf, g)
        yield from r.nsync(w)
        r.group(w, [("Q", j), ("K", g)])
        r.narrive(w)
        yield from r.wait_groups(w, 0)
        r.release("K", g)
        for t in range(g + 1, g + nl):
            yield from r.wait_groups(w, 0)
            if t >= g + 2: r.release("V", t - 2)
            yield from r.full(r.kf, t)
            yield from r.full(r.vf, t - 1)
            yield from r.nsync(w)
            r.group(w, [("Q", j), ("K", t)]); r.group(w, [("V", t - 1)])
            r.narrive(w)
            yield from r.wait_groups(w, 1)
            r.release("K", t)
        if r.mutation != "q_empty_at_start" and not diag: r.q_empty.arrive()  # the tile's last S completed
        if diag and r.mutation != "diag_without_turn":  # the diagonal's loop step, its turn empty
            yield from r.nsync(w)
            r.narrive(w)
        yield from r.wait_groups(w, 0)
        if nl >= 2: r.release("V", g + nl - 2)
        yield from r.full(r.vf, g + nl - 1)
        r.group(w, [("V", g + nl - 1)])
        yield from r.wait_groups(w, 0)
        r.release("V", g + nl - 1)
        if diag:  # the diagonal tile at 64 keys, no turns
            t = g + n - 1
            yield from r.full(r.kf, t)
            r.group(w, [("Q", j), ("K", t)])
            yield from r.wait_groups(w, 0)
            r.release("K", t)
            if r.mutation != "q_empty_at_start": r.q_empty.arrive()
            yield from r.full(r.vf, t)
            r.group(w, [("V", t)])
            yield from r.wait_groups(w, 0)
            r.release("V", t)
        g += n
    if w == 0 and r.mutation != "no_final_take": yield from r.nsync(0)


def run(n, seed, tiles=None, mutation=None, diag=(), idle=()):
    """The ws forward's protocol (S = 3 stages), see KvRing and _fwd_consumer; tiles: the key tile
    counts of the query tiles one persistent CTA takes in turn (default: one query tile of n);
    diag, idle: the query tiles whose consumer 0 runs its diagonal after the loop, whose consumer
    1 has no rows."""
    assert mutation is None or mutation in FWD_MUTATIONS
    return KvRing(n, S, tiles, mutation, diag, idle).run(_fwd_consumer, seed)


def run_persistent(n, seed, mutation=None, diag=(), idle=()):
    """The persistent forward: a CTA taking four query tiles of n, 1, n + 2 and 2 key tiles, on
    the 3-stage (128-key) and 2-stage (176-key) rings (diag, idle as in run). The diag and idle
    mutations run with diagonals on tiles 0, 2, 3 and consumer 1 idle on tiles 1, 2."""
    if mutation == "diag_without_turn": diag = (0, 2, 3)
    if mutation == "idle_without_turns": idle = (1, 2)
    for stages in (3, 2):
        KvRing(n, stages, [n, 1, n + 2, 2], mutation, diag, idle).run(_fwd_consumer, seed)


DQ_MUTATIONS = {  # mutation -> what the kernel would do wrong (each must make run_dq fail)
    "k_release_after_s": "K_t released after S_t (as the forward does) although dQ reads it one step later",
    "k_release_at_issue": "K_{t-1} released as its dQ group is issued, not when it completed",
    "idle_release_unloaded": "consumer 1 without rows releases a stage without waiting for its load",
    "skip_without_turn": "consumer 0 skips its masked last tile without taking that step's turn",
}


def run_dq(n, seed, stages=4, mutation=None, skip0=False, idle1=False):
    """The ws dQ kernel (csrc/dualkv_dq_ws_sm90.cu): the forward's ring and turns (KvRing), with
    S_t and dP_t (K_t and V_t) in a consumer's first group of step t and dQ += dS_{t-1} K_{t-1} in
    its second; V_t is released when the first group completed, K_t when its dQ group did (top of
    step t + 2, or after the loop). skip0 (n >= 2): consumer 0 walks n - 1 tiles (its rows end
    before the last tile's keys at a causal diagonal) and takes the last step's turn as an empty
    issue section. idle1: consumer 1 has no rows (a query tile of 64 rows or fewer); per key tile
    it waits for K and V to load, takes its turn empty and releases both. No deadlock, and
    KvRing's checks."""
    assert mutation is None or mutation in DQ_MUTATIONS
    skip0 = (skip0 or mutation == "skip_without_turn") and n >= 2
    idle1 = idle1 or mutation == "idle_release_unloaded"

    def consumer(r, w):
        skip = skip0 and w == 0
        nc = n - 1 if skip else n
        while not r.q_full.done(0): yield
        if w == 1: r.narrive(1)
        if w == 1 and idle1:
            for t in range(n):
                if mutation != "idle_release_unloaded":
                    yield from r.full(r.kf, t); yield from r.full(r.vf, t)
                yield from r.nsync(w)
                if t + 1 < n: r.narrive(w)
                r.release("V", t); r.release("K", t)
            return
        yield from r.full(r.kf, 0); yield from r.full(r.vf, 0)
        yield from r.nsync(w)
        r.group(w, [("K", 0), ("V", 0)])
        if w == 0 or n > 1: r.narrive(w)
        yield from r.wait_groups(w, 0)
        r.release("V", 0)
        if mutation == "k_release_after_s": r.release("K", 0)
        late_k = mutation is None  # K released when its dQ group completed (the kernel)
        for t in range(1, nc):
            yield from r.wait_groups(w, 0)
            if t >= 2 and late_k: r.release("K", t - 2)
            yield from r.full(r.kf, t); yield from r.full(r.vf, t)
            yield from r.nsync(w)
            r.group(w, [("K", t), ("V", t)]); r.group(w, [("K", t - 1)])
            if mutation == "k_release_at_issue": r.release("K", t - 1)
            if w == 0 or t + 1 < n: r.narrive(w)
            yield from r.wait_groups(w, 1)
            r.release("V", t)
            if mutation == "k_release_after_s": r.release("K", t)
        if skip and mutation != "skip_without_turn":
            yield from r.nsync(w)
            r.narrive(w)
        yield from r.wait_groups(w, 0)
        if nc >= 2 and late_k: r.release("K", nc - 2)
        r.group(w, [("K", nc - 1)])
        if mutation == "k_release_at_issue": r.release("K", nc - 1)
        yield from r.wait_groups(w, 0)
        if late_k: r.release("K", nc - 1)

    return KvRing(n, stages).run(consumer, seed)


DET_MUTATIONS = {  # mutation -> what the kernel would do wrong (each must make run_det_overlap fail)
    "release_before_b": "stage i - 1 released before dV, dK of step i - 1 completed",
    "release_current": "stage i released (instead of i - 1) after B_{i-1}",
    "no_dp_take": "dP^T_i issued without taking the turn, the turn still passed on",
    "skip_one_turn": "consumer 1 takes one empty turn per skipped step instead of two",
}


def run_det_overlap(n, seed, mutation=None, skip1=0):
    """The deterministic dK/dV kernel's overlapped walk (csrc/dualkv_bwd_ws_sm90.cu, kOverlap,
    kDQ = false): a Q/dO ring of S stages with tile descriptors in a ring of 8; per consumer the
    sections A_0 = (S^T_0, dP^T_0); then per step i: (S^T_i) and (dV, dK of i - 1) as two groups
    in one section, P^T_i after the first completes, stage i - 1 released when the second did,
    then a section with dP^T_i; finally (dV, dK of n - 1). skip1: consumer 1 walks only the first
    n - skip1 steps (the diagonal steps it masks entirely, ordered last), then per skipped step
    waits for its stage to load, releases it and takes its two turns empty. Checked: every MMA and
    descriptor read sees step i's data, no TMA lands in a stage still read, one mbarrier phase never
    mixes two steps' releases, turns balanced, no deadlock."""
    assert mutation is None or mutation in DET_MUTATIONS
    if mutation == "skip_one_turn":
        skip1 = max(skip1, min(n, 4))
    rnd = random.Random(seed)
    ring = 8
    kv_full = MBar(1)
    qf = [MBar(2) for _ in range(S)]
    em = [MBar(2) for _ in range(S)]  # one agent per consumer
    held, td = [None] * S, [None] * ring
    readers = {"Q": [[] for _ in range(S)]}
    tma, mma = [], {0: [], 1: []}
    turn = [NamedBar(2), NamedBar(2)]  # turn[w]: w syncs, the other arrives

    def producer():
        kv_full.arrive(tx=1); tma.append(("KV", None, None, kv_full))
        for i in range(n):
            st = i % S
            if i >= S:
                while not em[st].done(((i // S) & 1) ^ 1): yield
            td[i % ring] = i
            qf[st].arrive(tx=1); tma.append(("Q", st, i, qf[st]))
            yield
            qf[st].arrive()

    def land(kind, st, i, bar):
        if kind == "Q":
            assert not readers["Q"][st], f"TMA Q/dO{i} lands in stage {st} read by {readers['Q'][st]}"
            held[st] = i
        bar.complete_tx(1)

    def group(w, steps_read):
        for i in steps_read:
            assert held[i % S] == i, f"WG{w} reads step {i} from stage {i % S} holding {held[i % S]}"
            readers["Q"][i % S].append((w, i))
        mma[w].append([("Q", i % S, i) for i in steps_read])

    def take(w):
        yield from turn[w].sync(w)

    def give(w, last=False):
        if not (last and w == 1): turn[w ^ 1].arrive(w)

    def wait_groups(w, keep):
        while len(mma[w]) > keep: yield

    def probs(w, i):
        assert td[i % ring] == i, f"WG{w} reads the descriptor of step {i}, slot holds {td[i % ring]}"

    def full(i):
        while not qf[i % S].done((i // S) & 1): yield

    released = [set() for _ in range(S)]

    def release(i):
        st = i % S
        released[st].add((em[st].phase, i))
        assert len({j for ph, j in released[st] if ph == em[st].phase}) == 1, "one empty phase mixes steps"
        em[st].arrive()

    def consumer(w):
        while not kv_full.done(0): yield
        if w == 1: turn[0].arrive(1)
        m = n - skip1 if w == 1 else n  # steps this consumer walks
        if m > 0:
            yield from walk(w, m)
        for i in range(m, n):  # skipped: the stage released once loaded, both turns taken empty
            yield from full(i)  # (the turns alone keep it behind; without them it is needed)
            release(i)
            yield from take(w); give(w)
            if mutation != "skip_one_turn":
                yield from take(w); give(w, last=i == n - 1)

    def walk(w, m):  # steps 0 .. m - 1
        yield from full(0)
        yield from take(w); group(w, [0]); give(w)
        yield from wait_groups(w, 0)
        probs(w, 0)
        for i in range(1, m):
            yield from full(i)
            yield from take(w)
            group(w, [i]); group(w, [i - 1])
            give(w)
            yield from wait_groups(w, 1)
            probs(w, i)
            if mutation == "release_before_b": release(i - 1)
            yield from wait_groups(w, 0)
            if mutation in (None, "no_dp_take", "skip_one_turn"): release(i - 1)
            if mutation == "release_current": release(i)
            if mutation != "no_dp_take": yield from take(w)
            group(w, [i])
            give(w)
            yield from wait_groups(w, 0)
        yield from take(w); group(w, [m - 1]); give(w, last=m == n)
        yield from wait_groups(w, 0)
        release(m - 1)

    steps = _groups_run({"P": producer(), "C0": consumer(0), "C1": consumer(1)}, tma, mma, readers, land, rnd)
    for t in turn:
        assert not t.arrived, f"named barrier left with arrivals {t.arrived}"
    return steps


def check_mutations(run_fn, mutations, ns=(1, 2, 3, 5, 9), seeds=200):
    """Each mutation must fail run_fn(n, seed, mutation=...) on some n and seed."""
    for m, what in mutations.items():
        caught = None
        for seed in range(seeds):
            for n in ns:
                try:
                    run_fn(n, seed, mutation=m)
                except AssertionError as e:
                    caught = f"{e} (n={n}, seed={seed})"
                    break
            if caught: break
        assert caught, f"mutation {m} ({what}) not caught"
        print(f"mutation caught: {m} ({what}): {caught}")


if __name__ == "__main__":
    for n in list(range(1, 12)) + [40]:
        for seed in range(300):
            run(n, seed)
            for tma_dq in (False, True):
                for turns in (False, True):
                    run_bwd(n, seed, d128=True, tma_dq=tma_dq, turns=turns)
                    run_bwd(n, seed, d128=False, tma_dq=tma_dq, turns=turns)
                    if tma_dq:
                        run_bwd(n, seed, tma_dq=True, turns=turns, wide=True)
                        run_bwd(n, seed, tma_dq=True, turns=turns, wide=True, tail=True)
            run_persistent(n, seed)
            run_persistent(n, seed, diag=[0, 2, 3], idle=[1, 2])
            run_dq(n, seed)
            run_dq(n, seed, skip0=True)
            run_dq(n, seed, skip0=True, idle1=True)
            run_det_overlap(n, seed)
            for skip1 in range(1, min(n, 8) + 1):
                run_det_overlap(n, seed, skip1=skip1)
    check_bwd_mutations()
    check_mutations(run_persistent, FWD_MUTATIONS)
    check_mutations(run_dq, DQ_MUTATIONS)
    check_mutations(run_det_overlap, DET_MUTATIONS)
    print("ok")
