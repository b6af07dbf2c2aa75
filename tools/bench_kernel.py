#!/usr/bin/env python
"""Kernel benchmark: DualKV attention backends side by side on the published shapes.

One group per micro-batch: a prompt of P tokens and N responses of R tokens, Hq=32, Hkv=8, d=128,
bf16. For each shape and backend: forward, backward and forward+backward time (CUDA events,
warm-up, median of repeated runs, fresh random inputs), useful TFLOP/s (attention FLOPs of the
deduplicated problem from megatron_dualkv.flops; backward 2.5x and forward+backward 3.5x the
forward) and peak GPU memory (inputs, outputs, gradients and workspace).

Backends:
  cuda         the fused DualKV kernel (megatron_dualkv.ops.cuda_backend), when available
  flex-triton  FlexAttention with the DualKV block mask, Triton kernels, as the flex backend
               runs it (one compilation for all lengths)
  flex-flash   the same with the FLASH kernels (needs flash-attn-4)
  flex-static  FlexAttention, Triton, compiled with static shapes for each length (how
               FlexAttention is usually benchmarked; recompiles per shape) - not run by default
  flex-flash-static  the same with the FLASH kernels - not run by default
  sdpa-flash   the REPLICATED batch (N sequences of P+R, causal) through SDPA's flash kernel
  sdpa-cudnn   the same through SDPA's cuDNN kernel
Replicated rows also give raw TFLOP/s (all replicated work). A replicated batch that does not
fit is run in equal chunks of sequences; one chunk is timed and multiplied (noted "chunks=c").

  python tools/bench_kernel.py                       # all shapes, default backends
  python tools/bench_kernel.py --quick --out perf.md # ~2 minutes on an H100
  python tools/bench_kernel.py --shapes 28x32768x2048,16x65536x1024 --backends flex-triton,sdpa-cudnn
  python tools/bench_kernel.py --backends cuda --ws-dq-ab   # ws backward: dQ by atomics vs TMA reduce-add
  python tools/bench_kernel.py --backends cuda --fwd-only   # forward only (packed backends), ~10 s
  python tools/bench_kernel.py --fwd-only --interleave \
      --backends "cuda[MEGATRON_DUALKV_WS_FWD_TILE=128],cuda[MEGATRON_DUALKV_WS_FWD_TILE=176]"
      # two settings of the cuda backend timed run by run in turn, in one process
  python tools/bench_kernel.py --interleave --backends "cuda,cuda[deterministic=1]"   # fast vs deterministic backward
  python tools/bench_kernel.py --interleave --hkv 4 \
      --backends "cuda,cuda[MEGATRON_DUALKV_WS_HEAD_PARTS=2],cuda[MEGATRON_DUALKV_WS_HEAD_PARTS=auto]"
      # the last is cuda again under another name: a control, whose ratio to cuda is the run's
      # own noise (the same kernels spread 2-4 % per run at the power cap, docs/PERF.md)
  python tools/bench_kernel.py --hq 4 --hkv 1 --interleave --backends cuda,flex-flash
      # one tensor-parallel rank's heads (Qwen3-8B at TP = 8: 32 / 8 heads over 8 ranks)
  python tools/bench_kernel.py --shapes 16x1024x8192 --spread 0.9 --backends cuda,flex-flash
      # responses of unequal lengths, R (1 - 0.9) to R (1 + 0.9) in a fixed shuffled order (mean R)
  python tools/bench_kernel.py --shapes 16x512x1024 --groups 8 --spread 0.9 --backends cuda,flex-flash
      # a micro-batch of 8 such groups (8 prompts, each with its own 16 responses)
  python tools/bench_kernel.py --shapes 64x256x1024 --cp 2 --interleave \
      --backends "cuda,cuda[deterministic=1],flex-triton"
      # one context-parallel rank: its local queries against all keys (no collectives)
  MEGATRON_DUALKV_CUDA_LIB_EXTRA=old=/tmp/old/_C.so python tools/bench_kernel.py --interleave \
      --backends "cuda,cuda[MEGATRON_DUALKV_OPS=old]"
      # two builds run by run in one process, on the same clocks and memory: the other one built
      # with csrc/build_ext.py /tmp/old --ops-namespace old (alternating processes could not
      # resolve 3.6 % on a short forward, docs/PERF.md, thirty-ninth session)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
import types
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dualkv.flops import FWD_BWD_FACTOR, attention_flops, group_pairs  # noqa: E402
from megatron_dualkv.layout import SegmentTable  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEFAULT_HQ, DEFAULT_HKV, DEFAULT_D = HQ, HKV, D  # --hq, --hkv and --head-dim change them
DTYPE = torch.bfloat16
PUBLISHED_NP = [(28, 4096), (28, 16384), (16, 32768), (28, 32768), (16, 65536)]
ALL_SHAPES = [(n, p, r) for r in (2048, 1024) for n, p in PUBLISHED_NP]
QUICK_SHAPES = [(28, 4096, 2048), (28, 32768, 2048), (16, 65536, 2048)]
DEFAULT_BACKENDS = ["cuda", "flex-triton", "flex-flash", "sdpa-flash", "sdpa-cudnn"]
ALL_BACKENDS = DEFAULT_BACKENDS + ["flex-static", "flex-flash-static"]
GIB = 2 ** 30
SHOW_RUNS = False  # --show-runs: print every timed run's forward / backward ms
SPREAD = 0.0  # --spread: response lengths from R (1 - SPREAD) to R (1 + SPREAD), mean R
GROUPS = 1  # --groups: groups (prompts with their responses) per micro-batch
PROMPT_SPREAD = 0.0  # --prompt-spread: the groups' prompt lengths from P (1 - s) to P (1 + s), mean P
CP = 1  # --cp: time rank 0 of this many context-parallel ranks (local queries)


class Skip(Exception):
    """A backend that cannot run here; the message says why."""


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def _one_run(fwd, inputs, dout, fwd_only):
    """Events before the forward, between it and its backward, and after (no backward: fwd_only)."""
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    e[0].record()
    out = fwd()
    e[1].record()
    grads = None if fwd_only else torch.autograd.grad(out, inputs, dout)
    e[2].record()
    del out, grads
    return e


def _medians(marks, fwd_only, label=""):
    """Median forward, backward and forward+backward ms of synchronized runs (None: not timed)."""
    if SHOW_RUNS:
        print(f"    runs fwd ms{label}:", " ".join(f"{a.elapsed_time(b):.2f}" for a, b, _ in marks), flush=True)
        if not fwd_only:
            print(f"    runs bwd ms{label}:", " ".join(f"{b.elapsed_time(c):.2f}" for _, b, c in marks), flush=True)
    f = statistics.median(a.elapsed_time(b) for a, b, _ in marks)
    if fwd_only:
        return f, None, None
    return (f, statistics.median(b.elapsed_time(c) for _, b, c in marks),
            statistics.median(a.elapsed_time(c) for a, _, c in marks))


def time_fwd_bwd(fwd, inputs, dout, warmup, reps, fwd_only=False):
    """Median forward, backward and forward+backward ms over `reps` runs, and peak GiB.

    Each run: event, forward (autograd on, as in training), event, backward via autograd.grad
    (no gradient accumulation), event. Events are read after the loop. fwd_only: no backward
    (its times are None).
    """
    for _ in range(warmup):
        _one_run(fwd, inputs, dout, fwd_only)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    marks = [_one_run(fwd, inputs, dout, fwd_only) for _ in range(reps)]
    torch.cuda.synchronize()
    return (*_medians(marks, fwd_only), torch.cuda.max_memory_allocated() / GIB)


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


# ---------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------


def response_lengths(n, r, spread=None, group=0) -> list:
    """The N response lengths of a shape: all R, or with a spread s > 0 evenly spaced over
    [R (1 - s), R (1 + s)] (bin centres, at least 1 token; mean R) in a fixed shuffled order, as
    rollouts end at different lengths. The same for every backend and run, so that tables of one
    spread compare; each group of a micro-batch (`group`) has its own order."""
    spread = SPREAD if spread is None else spread
    if not spread:
        return [r] * n
    if not 0 < spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    lo, hi = r * (1 - spread), r * (1 + spread)
    lengths = [max(1, round(lo + (hi - lo) * (i + 0.5) / n)) for i in range(n)]
    random.Random(n * 1_000_003 + r + 7919 * group).shuffle(lengths)
    return lengths


def micro_batch(n, p, r) -> list:
    """[(P, [R_1, ..., R_N])] for each of the GROUPS groups of a micro-batch; with PROMPT_SPREAD
    the prompts' lengths spread like the responses' (`response_lengths`), so that most are not
    multiples of the key tile."""
    prompts = response_lengths(GROUPS, p, PROMPT_SPREAD)
    return [(prompts[g], response_lengths(n, r, group=g)) for g in range(GROUPS)]


def group_segments(n, p, r) -> SegmentTable:
    return SegmentTable.from_group_lengths(micro_batch(n, p, r), device="cuda")


def cp_rank_layout(shape, cp, rank=0, device="cuda"):
    """(layout, rows, pairs) of one of `cp` context-parallel ranks on this shape: the layout
    padded by megatron_dualkv.cp.partition.cp_partition (8 chunks per rank of 128-multiple rows,
    dealt to balance attention work, as training splits it), the rank's packed rows and the
    (query, key) pairs they attend."""
    from megatron_dualkv.cp.partition import cp_partition, key_counts
    from megatron_dualkv.layout import Group, build_layout

    groups = [Group.of([1] * p, [[1] * r for r in lengths]) for p, lengths in micro_batch(*shape)]
    part = cp_partition(build_layout(groups), cp)
    seg = part.layout.segments.to(device)
    rows = part.rows_of(rank).to(device)
    return seg, rows, int(key_counts(seg)[rows].sum())


def _flex_static_entry(q, k, v, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _flex_flash_static_entry(q, k, v, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options={"BACKEND": "FLASH"})


class Packed:
    """One packed backend set up on one shape: its inputs, its forward, and the environment its
    launches need (cuda[VAR=VALUE;...]: set around every call, so that settings read at each
    launch can be timed side by side in one process)."""

    def __init__(self, fwd, inputs, dout, notes, env=None):
        self.fwd, self.inputs, self.dout, self.notes, self._env = fwd, inputs, dout, notes, env or {}
        self.peak = None

    def env(self):
        return mock.patch.dict(os.environ, self._env)

    def run(self, fwd_only):
        with self.env():
            return _one_run(self.fwd, self.inputs, self.dout, fwd_only)


def backend_env(name):
    """("cuda", {VAR: VALUE}) for cuda[VAR=VALUE;...] ("dq" stands for MEGATRON_DUALKV_WS_DQ, the ws
    backward's dQ path; "deterministic=1" is not a variable but the call's deterministic=True),
    (name, {}) for a plain name."""
    if "[" not in name:
        return name, {}
    base, _, rest = name.partition("[")
    if base != "cuda" or not rest.endswith("]"):
        raise ValueError(f"{name!r}: settings in brackets are for cuda only, as cuda[VAR=VALUE;...]")
    env = {}
    for item in rest[:-1].split(";"):
        var, eq, value = item.partition("=")
        if not eq or not var.strip():
            raise ValueError(f"{name!r}: {item!r} is not VAR=VALUE")
        env["MEGATRON_DUALKV_WS_DQ" if var.strip() == "dq" else var.strip()] = value.strip()
    return base, env


def packed_inputs(shape):
    """(layout, q, k, v, dout, q_rows) of the packed micro-batch [P | R_1 | ... | R_N], fresh
    random; with --cp, q and dout hold rank 0's rows (q_rows, else None) and k, v all rows."""
    seg, rows = group_segments(*shape), None
    if CP > 1:
        seg, rows, _ = cp_rank_layout(shape, CP)
    t = seg.num_tokens
    tq = t if rows is None else rows.numel()
    q, k, v = randn(tq, HQ, D), randn(t, HKV, D), randn(t, HKV, D)
    for x in (q, k, v):
        x.requires_grad_()
    return seg, q, k, v, randn(tq, HQ, D), rows


def prepare_packed(name, shape, state, fwd_only=False, data=None) -> Packed:
    """cuda / flex-* on the packed micro-batch: fresh inputs (or `data`, packed_inputs' tuple) and
    the first call (compilation for flex, noted with its new graphs)."""
    seg, q, k, v, dout, rows = data or packed_inputs(shape)
    t = seg.num_tokens
    scale = 1.0 / math.sqrt(D)
    notes = []

    base, env = backend_env(name)
    if rows is not None and base not in ("cuda", "flex-triton", "flex-flash"):
        raise Skip("--cp: the cuda and the dynamic flex backends take local queries")
    if base == "cuda":
        try:
            from megatron_dualkv.ops import cuda_backend
        except ImportError as exc:
            raise Skip(f"cuda_backend not importable ({exc})")
        try:
            ok, why = cuda_backend.is_available(q)
        except TypeError:
            ok, why = cuda_backend.is_available()
        if not ok:
            raise Skip(why)
        deterministic = env.pop("deterministic", "0") not in ("0", "")
        fwd = lambda: cuda_backend.attention(q, k, v, seg, scale, deterministic=deterministic, q_rows=rows)  # noqa: E731
    elif name in ("flex-triton", "flex-flash"):
        from megatron_dualkv.ops import flex_backend

        ok, why = flex_backend.is_available(q)
        if not ok:
            raise Skip(why)
        kernel = "FLASH" if name == "flex-flash" else "TRITON"
        if kernel == "FLASH" and not flex_backend.flash_installed():
            raise Skip("flash-attn-4 (flash_attn.cute) not installed")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flex_backend.cached_block_mask(seg)
        torch.cuda.synchronize()
        notes.append(f"mask {1e3 * (time.perf_counter() - t0):.0f} ms")
        fwd = lambda: flex_backend.attention(q, k, v, seg, scale, kernel=kernel, q_rows=rows)  # noqa: E731
    elif name in ("flex-static", "flex-flash-static"):
        from megatron_dualkv.ops import flex_backend

        if name == "flex-flash-static" and not flex_backend.flash_installed():
            raise Skip("flash-attn-4 (flash_attn.cute) not installed")
        # a static compile for this length, as per-shape benchmarks do; its own code object, so
        # it neither shares the 8-entry recompile limit nor disturbs the dynamic backend's cache
        entry = _flex_flash_static_entry if name == "flex-flash-static" else _flex_static_entry
        code = entry.__code__.replace(co_name=f"_{name.replace('-', '_')}_{t}")
        static = torch.compile(types.FunctionType(code, globals()), dynamic=False)
        padded, mask = flex_backend.cached_block_mask(seg)
        if padded.num_tokens != t:
            raise Skip("static variant only for block-multiple lengths")
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        fwd = lambda: static(qh, kh, vh, mask, scale)[0].transpose(0, 1)  # noqa: E731
    else:
        raise ValueError(name)

    packed = Packed(fwd, (q, k, v), dout, notes, env)
    # first call: compilation (flex) / first launch; recompiles show in the graph counter
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    packed.run(fwd_only)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    new_graphs = counters["stats"]["unique_graphs"] - graphs
    if name.startswith("flex"):
        notes.append(f"1st call {first:.1f} s, {new_graphs} new graph(s)")
        state.setdefault("compiles", []).append((name, shape, first, new_graphs))
    return packed


def run_packed(name, shape, warmup, reps, state, fwd_only=False):
    """One packed backend timed on its own: warm-up runs, then `reps` timed runs."""
    p = prepare_packed(name, shape, state, fwd_only)
    with p.env():
        f, b, fb, peak = time_fwd_bwd(p.fwd, p.inputs, p.dout, warmup, reps, fwd_only)
    return dict(fwd=f, bwd=b, fb=fb, peak=peak, notes=p.notes)


def run_interleaved(names, shape, warmup, reps, state, fwd_only=False):
    """Packed backends timed run by run in turn on the same inputs, so that each sees the same
    clocks and the same data at the same addresses (a card at its power cap changes clock within
    one measurement; inputs placed elsewhere moved one setting's time by up to 3 %: docs/PERF.md,
    twentieth session). Each round runs every backend once, in orders that `round_orders` draws
    balanced: a fixed rotation aliased with a card's clock swinging every 9 runs, and the backend
    first in the list ran 4 % faster than the same setting third. Peak GiB:
    each backend's own over one run after its first call, with the inputs counted once, as when
    it runs alone. {name: result or status}."""
    ready, results = {}, {}
    data = packed_inputs(shape)
    input_bytes = sum(x.numel() * x.element_size() for x in data[1:5])

    def prepared(name):
        base = torch.cuda.memory_allocated()
        p = prepare_packed(name, shape, state, fwd_only, data)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        p.run(fwd_only)
        torch.cuda.synchronize()
        p.peak = (torch.cuda.max_memory_allocated() - base + input_bytes) / GIB
        return p

    for name in names:
        res = guarded(lambda: prepared(name))
        if isinstance(res, dict):
            results[name] = res
        else:
            ready[name] = res
    marks = guarded(lambda: _rounds(ready, warmup, reps, fwd_only))
    for name, p in ready.items():
        if "status" in marks:  # a failure while the rounds ran is every timed backend's result
            results[name] = marks
            continue
        f, b, fb = _medians(marks[name], fwd_only, f" {name}")
        results[name] = dict(fwd=f, bwd=b, fb=fb, peak=p.peak, notes=p.notes + ["interleaved"])
    return {name: results[name] for name in names}


def round_orders(names, warmup, reps, seed=0):
    """The order of each round: `warmup` untimed rounds in random orders, then `reps` timed ones in
    blocks of len(names) rounds, each block the rotations of one random order, so that every
    backend runs in every position equally often (up to the last, partial block). Orders drawn
    independently per round left the position to chance, and on the H100 the second of two runs
    measured up to ~1 % faster: with 25 rounds the first-listed backend ran first in 10, and the
    same kernel under two names then differed by 1 % (docs/PERF.md, twenty-fourth session)."""
    rng = random.Random(seed)
    orders = [rng.sample(names, len(names)) for _ in range(warmup)]
    while len(orders) < warmup + reps:
        block = rng.sample(names, len(names))
        orders += [block[j:] + block[:j] for j in range(len(names))]
    return orders[:warmup + reps]


def _rounds(ready, warmup, reps, fwd_only):
    """{name: events of its timed runs}: `warmup` untimed rounds, then `reps` timed ones."""
    marks = {name: [] for name in ready}
    for i, order in enumerate(round_orders(list(ready), warmup, reps)):
        for name in order:
            e = ready[name].run(fwd_only)
            if i >= warmup:
                marks[name].append(e)
    torch.cuda.synchronize()
    return marks


def _release():
    gc.collect()  # tracebacks and cycles must not carry tensors into the next row
    torch.cuda.empty_cache()


def guarded(fn):
    """fn()'s result, or a status row's dict when it cannot run here, runs out of memory or fails
    (one backend's failure is a result too: reported, and the run goes on)."""
    try:
        return fn()
    except Skip as exc:
        return {"status": "n/a", "why": str(exc)}
    except torch.OutOfMemoryError:
        return {"status": "OOM", "why": "out of GPU memory"}
    except Exception as exc:
        traceback.print_exc()
        return {"status": "error", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def _sdpa_kernel(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION])


def _run_replicated_chunk(name, seqs, length, warmup, reps, gqa):
    q = randn(seqs, HQ, length, D).requires_grad_()
    if gqa:
        k, v = randn(seqs, HKV, length, D).requires_grad_(), randn(seqs, HKV, length, D).requires_grad_()
    else:  # expanded K/V for kernels without grouped-query support
        k, v = randn(seqs, HQ, length, D).requires_grad_(), randn(seqs, HQ, length, D).requires_grad_()
    dout = randn(seqs, HQ, length, D)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    with _sdpa_kernel(name):  # the backward runs the kernel family the forward chose
        return time_fwd_bwd(fwd, (q, k, v), dout, warmup, reps)


def run_replicated(name, shape, warmup, reps, state):
    """sdpa-* on the replicated batch: N causal sequences of P+R tokens."""
    n, p, r = shape
    if SPREAD or GROUPS > 1:
        raise Skip("replicated SDPA runs one group of equal response lengths only (no --spread, --groups)")
    notes = []
    gqa = state.get(("gqa", name), True)
    chunks_options = [c for c in range(1, n + 1) if n % c == 0]
    for chunks in chunks_options:
        try:
            try:
                f, b, fb, peak = _run_replicated_chunk(name, n // chunks, p + r, warmup, reps, gqa)
            except RuntimeError as exc:
                if gqa and "OutOfMemory" not in type(exc).__name__ and "out of memory" not in str(exc):
                    # no grouped-query support in this kernel: expand K/V instead
                    state[("gqa", name)] = gqa = False
                    notes.append("K/V expanded (kernel lacks GQA)")
                    torch.cuda.empty_cache()
                    f, b, fb, peak = _run_replicated_chunk(name, n // chunks, p + r, warmup, reps, gqa)
                else:
                    raise
        except torch.OutOfMemoryError:
            # keep no reference to the exception: its traceback holds the attempt's tensors
            gc.collect()
            torch.cuda.empty_cache()
            continue
        if chunks > 1:
            notes.append(f"chunks={chunks} (one timed, x{chunks}; peak of one)")
        return dict(fwd=f * chunks, bwd=b * chunks, fb=fb * chunks, peak=peak, notes=notes)
    raise torch.OutOfMemoryError(f"{name}: out of memory even one sequence at a time")


# ---------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------


COLUMNS = ["N", "P", "R", "T packed", "backend", "fwd ms", "bwd ms", "fwd+bwd ms",
           "fwd TF/s", "bwd TF/s", "fwd+bwd TF/s", "raw fwd+bwd TF/s", "peak GiB", "notes"]


def row_for(shape, backend, res):
    n, p, r = shape
    groups = micro_batch(n, p, r)
    dedup, repl = (sum(x) for x in zip(*(group_pairs(gp, lengths) for gp, lengths in groups)))
    tokens = sum(gp + sum(lengths) for gp, lengths in groups)
    if CP > 1:  # rank 0's local queries: their pairs, "rows of the rank / packed rows"
        seg, rows, dedup = cp_rank_layout(shape, CP)
        tokens = f"{rows.numel()} / {seg.num_tokens}"
    fwd_flops = attention_flops(dedup, HQ, D)
    base = [n, p, r, tokens, backend]
    if "status" in res:
        return base + [res["status"]] + [""] * (len(COLUMNS) - len(base) - 2) + [res.get("why", "")]
    raw = ""
    if backend.startswith("sdpa"):
        raw = f"{attention_flops(repl, HQ, D) * FWD_BWD_FACTOR / (res['fb'] * 1e-3) / 1e12:.0f}"
    if res["bwd"] is None:  # --fwd-only
        return base + [f"{res['fwd']:.2f}", "", "", f"{fwd_flops / (res['fwd'] * 1e-3) / 1e12:.0f}", "", "",
                       "", f"{res['peak']:.1f}", "; ".join(res["notes"] + ["forward only"])]
    return base + [
        f"{res['fwd']:.2f}", f"{res['bwd']:.2f}", f"{res['fb']:.2f}",
        f"{fwd_flops / (res['fwd'] * 1e-3) / 1e12:.0f}",
        f"{fwd_flops * (FWD_BWD_FACTOR - 1) / (res['bwd'] * 1e-3) / 1e12:.0f}",
        f"{fwd_flops * FWD_BWD_FACTOR / (res['fb'] * 1e-3) / 1e12:.0f}",
        raw, f"{res['peak']:.1f}", "; ".join(res["notes"]),
    ]


def result_line(seconds, shape, backend, res):
    """The progress line of one measurement (tools/paired_runs.py reads its shape)."""
    fb = "" if res.get("fb") is None else f", fwd+bwd {res['fb']:.2f} ms"
    return f"  [{seconds:6.1f}s] {shape} {backend}: " + (res.get("status", "") or f"fwd {res['fwd']:.2f} ms{fb}")


def markdown(rows, columns=None):
    columns = columns or COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(path, header, rows, columns=None):
    """The header lines as a list, then the table (rewritten after every measurement: a run cut
    short keeps what it measured)."""
    with open(path, "w") as fh:
        fh.write("\n".join(f"- {h}" for h in header) + "\n\n" + markdown(rows, columns) + "\n")


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        parts = item.lower().replace(":", "x").split("x")
        if len(parts) != 3:
            raise SystemExit(f"--shapes: {item!r} is not NxPxR")
        shapes.append(tuple(int(x) for x in parts))
    return shapes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="comma-separated NxPxR (default: the 10 published shapes)")
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                    help=f"comma-separated, from {ALL_BACKENDS}; cuda[VAR=VALUE;...] runs cuda with those "
                         "environment settings around every call (e.g. cuda[MEGATRON_DUALKV_WS_FWD_TILE=176]; "
                         "cuda[dq=MODE] for MEGATRON_DUALKV_WS_DQ; cuda[deterministic=1] for deterministic=True), "
                         "so that with --interleave two settings "
                         "are timed side by side in one process")
    ap.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, fewer repetitions (~2 min on an H100)")
    ap.add_argument("--reps", type=int, help="timed runs per measurement (default 10, quick 5; replicated SDPA: half)")
    ap.add_argument("--warmup", type=int, help="untimed runs before timing (default 3, quick 2; replicated SDPA: 1)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new measurement after this many seconds")
    ap.add_argument("--out", help="also write the markdown table (with device, versions, command) here")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only (packed backends)")
    ap.add_argument("--show-runs", action="store_true", help="print every timed run's forward and backward ms")
    ap.add_argument("--interleave", action="store_true",
                    help="time the packed backends of a shape run by run in turn instead of one after "
                         "the other (same clocks for each: a fair side by side on a card at its power cap)")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="unequal response lengths: R (1 - S) to R (1 + S), mean R, in a fixed shuffled "
                         "order (0 <= S < 1; the R column gives the mean; replicated SDPA is skipped)")
    ap.add_argument("--groups", type=int, default=1,
                    help="groups per micro-batch: each shape's group G times in one packed batch (each with "
                         "its own order of lengths under --spread; N, P, R are per group, T packed and "
                         "TF/s of the whole batch; replicated SDPA is skipped)")
    ap.add_argument("--prompt-spread", type=float, default=0.0,
                    help="with --groups: the groups' prompt lengths P (1 - S) to P (1 + S), mean P, in a "
                         "fixed shuffled order (0 <= S < 1; the P column gives the mean)")
    ap.add_argument("--hq", type=int, default=DEFAULT_HQ,
                    help=f"query heads (default {DEFAULT_HQ}, Qwen3-8B's and Qwen3-30B-A3B's; one tensor-parallel "
                         f"rank holds Hq / TP of them, e.g. --hq 4 --hkv 1 for Qwen3-8B at TP = 8)")
    ap.add_argument("--hkv", type=int, default=DEFAULT_HKV,
                    help=f"kv heads (default {DEFAULT_HKV}, Qwen3-8B's; 4 is Qwen3-30B-A3B's)")
    ap.add_argument("--head-dim", type=int, default=DEFAULT_D, choices=(64, 128), help=f"head dim (default {DEFAULT_D})")
    ap.add_argument("--cp", type=int, default=1,
                    help="time rank 0 of this many context-parallel ranks: its local queries (the cost-balanced "
                         "partition of megatron_dualkv.cp) against all keys, no collectives; cuda and dynamic flex only")
    ap.add_argument("--ws-dq-ab", action="store_true",
                    help="run the cuda backend twice per shape, as cuda[dq=atomic] and cuda[dq=tma] "
                         "(MEGATRON_DUALKV_WS_DQ: the ws backward's dQ by float2 atomics / TMA reduce-add)")
    args = ap.parse_args(argv)
    global SHOW_RUNS, SPREAD, GROUPS, PROMPT_SPREAD, HQ, HKV, D, CP
    SHOW_RUNS = args.show_runs
    if args.cp < 1:
        raise SystemExit(f"--cp must be at least 1, got {args.cp}")
    CP = args.cp
    if not 0 <= args.spread < 1:
        raise SystemExit(f"--spread must be in [0, 1), got {args.spread}")
    SPREAD = args.spread
    if args.groups < 1:
        raise SystemExit(f"--groups must be at least 1, got {args.groups}")
    GROUPS = args.groups
    if not 0 <= args.prompt_spread < 1:
        raise SystemExit(f"--prompt-spread must be in [0, 1), got {args.prompt_spread}")
    PROMPT_SPREAD = args.prompt_spread
    if args.hq < 1:
        raise SystemExit(f"--hq must be at least 1, got {args.hq}")
    if args.hkv < 1 or args.hq % args.hkv:
        raise SystemExit(f"--hkv must divide the {args.hq} query heads, got {args.hkv}")
    HQ, HKV = args.hq, args.hkv
    D = args.head_dim

    shapes = parse_shapes(args.shapes) if args.shapes else (QUICK_SHAPES if args.quick else ALL_SHAPES)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        try:
            base, _ = backend_env(b)
        except ValueError as exc:
            raise SystemExit(f"--backends: {exc}")
        if base not in ALL_BACKENDS:
            raise SystemExit(f"--backends: unknown {b!r}; choose from {ALL_BACKENDS}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernel.py needs a CUDA GPU")
    if args.ws_dq_ab:
        backends = [x for b in backends for x in (["cuda[dq=atomic]", "cuda[dq=tma]"] if b == "cuda" else [b])]
    reps = args.reps or (5 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)

    props = torch.cuda.get_device_properties(0)
    header = [
        f"device: {props.name} ({props.total_memory / GIB:.0f} GiB, {props.multi_processor_count} SMs); "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}",
        f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        "command: python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        f"Hq={HQ} Hkv={HKV} d={D} {str(DTYPE).replace('torch.', '')}; warm-up {warmup}, median of {reps} "
        f"(replicated SDPA: warm-up 1, median of {max(2, reps // 2)}); useful TF/s = dedup attention FLOPs / time",
    ] + ([f"responses of unequal lengths: R (1 - {SPREAD:g}) to R (1 + {SPREAD:g}) tokens, shuffled; "
          "R is their mean"] if SPREAD else []) \
      + ([f"{GROUPS} groups per micro-batch (N, P, R per group)"] if GROUPS > 1 else []) \
      + ([f"prompts of unequal lengths: P (1 - {PROMPT_SPREAD:g}) to P (1 + {PROMPT_SPREAD:g}), shuffled; "
          "P is their mean"] if PROMPT_SPREAD else []) \
      + ([f"context parallelism: rank 0 of {CP} (its local queries against all keys; T packed is its rows / "
          "the padded micro-batch's; TF/s count its pairs)"] if CP > 1 else []) \
      + (["interleaved: the packed backends of a shape alternate run by run on the same inputs (timed "
          "rounds in random orders that put each backend in each position equally often); peak GiB of "
          "each from one run of its own"] if args.interleave else [])
    print("\n".join(header), flush=True)
    torch.manual_seed(0)
    state: dict = {}
    rows = []
    started = time.perf_counter()
    over_budget = lambda: args.budget_s and time.perf_counter() - started > args.budget_s  # noqa: E731
    for shape in shapes:
        together, t0 = {}, time.perf_counter()
        if args.interleave and not over_budget():
            together = run_interleaved([b for b in backends if not b.startswith("sdpa")], shape, warmup, reps,
                                       state, args.fwd_only)
            _release()
        for backend in backends:
            if backend in together:
                res = together[backend]
            elif over_budget():
                res = {"status": "skipped", "why": "time budget"}
            elif backend.startswith("sdpa") and CP > 1:
                res = {"status": "skipped", "why": "--cp: the replicated batch has no local queries"}
            else:
                t0 = time.perf_counter()
                if backend.startswith("sdpa"):
                    res = guarded(lambda: run_replicated(backend, shape, 1, max(2, reps // 2), state))
                else:
                    res = guarded(lambda: run_packed(backend, shape, warmup, reps, state, args.fwd_only))
                _release()
            print(result_line(time.perf_counter() - t0, shape, backend, res), flush=True)
            rows.append(row_for(shape, backend, res))
            if args.out:
                write_markdown(args.out, header, rows)
    print()
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
