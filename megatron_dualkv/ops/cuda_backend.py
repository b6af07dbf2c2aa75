"""Fused DualKV CUDA attention backend (kernels in csrc/, torch ops `megatron_dualkv::*`).

Inputs: packed THD tensors q [T, Hq, D], k and v [T, Hkv, D], contiguous, bfloat16 or float16,
D in {64, 128}, Hq % Hkv == 0 (query head h uses kv head h // (Hq // Hkv)), a `SegmentTable` of
depth <= 2 (a root segment attends itself causally; a child attends its whole parent plus itself
causally). Outputs: out [T, Hq, D] in the input dtype and lse [Hq, T] (float32, natural log of the
softmax denominator of the scaled scores).

Kernels (sm_90a, Hopper; see docs/PERF.md "CUDA kernel"):
- forward `fwd_sm90`: wgmma, 128 query rows (2 warpgroups) per CTA, 64-row key tiles, two CTAs
  per SM; one launch for the whole micro-batch.
- backward `bwd_sm90`: delta = rowsum(dO * O); dK/dV kernel (wgmma, 128 key rows per CTA, walks
  every query tile that attends them: its own causal rows and the group's responses); then
    deterministic=True:  a dQ kernel (wgmma, 128 query rows per CTA): bitwise reproducible;
    deterministic=False: dQ accumulated in fp32 by the dK/dV kernel with atomics (faster;
                         workspace fp32 [T, Hq, D]); MEGATRON_DUALKV_ATOMIC_DQ=0 turns it off.
- `fwd` / `bwd`: the first, mma.sync (sm_80-style) kernels, kept as fwd_impl/bwd_impl="mma".
- `fwd_ws_sm90` (the default forward since the H100 run of 2026-11-22: 528-624 useful TFLOP/s
  against 370-424 for fwd_sm90): warp-specialized forward, a TMA producer warp and two consumer
  warpgroups in ping-pong (csrc/dualkv_fwd_ws_sm90.cu).
- `bwd_ws_sm90` (the default fast-mode backward): warp-specialized dK/dV kernel adding dQ into
  an fp32 buffer by TMA reduce-add of shared-memory tiles (csrc/dualkv_bwd_ws_sm90.cu; 8-18 %
  faster than per-thread atomics, which $MEGATRON_DUALKV_WS_DQ=atomic selects). deterministic=True:
  the same kernel computes dK/dV only, each key tile walked in list order (no phase-aligned walks;
  a split key tile's parts store their dK/dV in a workspace slot each, summed in part order), then
  the ws dQ kernel (csrc/dualkv_dq_ws_sm90.cu; MEGATRON_DUALKV_DQ_KERNEL=sm90: the sm90 one, bitwise
  the same): where no key tile is split, bitwise equal to the sm90 deterministic backward. A
  prompt's partial last key tile is taken into its responses' first key tiles where that pays
  (`ws_kv_work`, merge_tails; its dK/dV summed over them like a split tile's).
An extension built before the ws ops existed falls back to the sm90 kernels.

Work lists (query tiles per segment; key tiles with the query ranges that attend them) are built
on the host once per layout and cached on the `SegmentTable`; any segment lengths (tails masked).

Local queries (context parallelism, `q_rows`): q holds Tq of the T packed rows (a rank's CP
chunks) while k, v hold all T. The ws kernels take them with no copy: each query tile carries the
local row of its first query, each key tile the held query ranges that attend it with their local
rows; masks use the packed rows, so the result is the whole micro-batch's restricted to q_rows.
out, lse, dq have Tq rows; dk, dv have T rows (the contributions of the held queries). Both
backwards take them; the deterministic one's dQ kernel gives each held row bitwise the dQ of the
whole micro-batch's deterministic backward.
"""

from __future__ import annotations

import bisect
import heapq
import math
import os
from typing import Optional

import torch
from torch import Tensor

from ..layout import SegmentTable

TILE = 64
WS_BWD_WIDE_TILE = 80  # query rows per step of the ws backward at head dim 128 (field 6 of its kv items)
_LIB_ENV = "MEGATRON_DUALKV_CUDA_LIB"
_load_state: dict = {}


def _load() -> tuple[bool, str]:
    """Load the compiled ops once: the installed extension megatron_dualkv._C, else a .so named by
    $MEGATRON_DUALKV_CUDA_LIB, else <repo>/.gpu/build/_C.so (built by csrc/build_ext.py)."""
    if "ok" in _load_state:
        return _load_state["ok"], _load_state["why"]
    ok, why = False, ""
    try:
        from .. import _C  # noqa: F401  (registers the ops)
        ok = True
    except ImportError as exc:
        why = f"extension megatron_dualkv._C is not built ({exc})"
        candidates = []
        if os.environ.get(_LIB_ENV):
            candidates.append(os.environ[_LIB_ENV])
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        candidates.append(os.path.join(repo, ".gpu", "build", "_C.so"))
        for path in candidates:
            if os.path.isfile(path):
                try:
                    torch.ops.load_library(path)
                    ok, why = True, ""
                    break
                except OSError as exc2:
                    why = f"cannot load {path} ({exc2})"
    if ok:
        try:
            torch.ops.megatron_dualkv.fwd
        except (AttributeError, RuntimeError) as exc:
            ok, why = False, f"extension loaded but op megatron_dualkv::fwd is missing ({exc})"
    if ok:
        why = _list_format_problem()
        ok = not why
    if ok:
        why = _load_extra_builds()
        ok = not why
    if ok:
        _register_python_side()
    _load_state.update(ok=ok, why=why)
    return ok, why


# A second build beside the first, in the same process, for timing two builds run by run on the same
# clocks and memory (alternating processes could not resolve 3.6 % on a short forward whose time
# differs by up to 7 % from process to process: docs/PERF.md, thirty-ninth session). The build is
# made with csrc/build_ext.py --ops-namespace NAME (its ops are torch.ops.NAME), loaded from
# MEGATRON_DUALKV_CUDA_LIB_EXTRA=NAME=PATH[,NAME=PATH...], and a call runs on it under
# MEGATRON_DUALKV_OPS=NAME (tools/bench_kernel.py cuda[MEGATRON_DUALKV_OPS=NAME]).
DEFAULT_OPS = "megatron_dualkv"
_EXTRA_ENV = "MEGATRON_DUALKV_CUDA_LIB_EXTRA"
_OPS_ENV = "MEGATRON_DUALKV_OPS"


def extra_builds(value: str) -> list[tuple[str, str]]:
    """[(namespace, path)] of a MEGATRON_DUALKV_CUDA_LIB_EXTRA value, checked for form: NAME=PATH
    items separated by commas, each NAME a C identifier other than the default and named once."""
    pairs = []
    for item in filter(None, (x.strip() for x in value.split(","))):
        name, eq, path = item.partition("=")
        if not eq or not name.isidentifier() or not path:
            raise ValueError(f"{_EXTRA_ENV}: {item!r} is not NAME=PATH (NAME the build's --ops-namespace)")
        if name == DEFAULT_OPS or name in dict(pairs):
            raise ValueError(f"{_EXTRA_ENV}: {name!r} is the default build's namespace or named twice; "
                             "an extra build needs a namespace of its own (csrc/build_ext.py --ops-namespace)")
        pairs.append((name, path))
    return pairs


def _load_extra_builds() -> str:
    """Load the builds of MEGATRON_DUALKV_CUDA_LIB_EXTRA ('' when all loaded and read this package's
    work lists, else why not). A library registering a namespace that is already taken would abort
    the process inside dlopen, so a file without the registration function of its namespace (the
    symbol TORCH_LIBRARY(NAME, m) defines: `_library_marker`) is refused unloaded."""
    try:
        pairs = extra_builds(os.environ.get(_EXTRA_ENV, ""))
    except ValueError as exc:
        return str(exc)
    for name, path in pairs:
        if _loaded_format(name) is not None:
            continue  # loaded before (the op registry is per process)
        try:
            with open(path, "rb") as f:
                holds = _library_marker(name) in f.read()
        except OSError as exc:
            return f"{_EXTRA_ENV}: cannot read {path} ({exc})"
        if not holds:
            return f"{_EXTRA_ENV}: {path} registers no ops under {name!r} (build it with csrc/build_ext.py --ops-namespace {name})"
        try:
            torch.ops.load_library(path)
        except OSError as exc:
            return f"{_EXTRA_ENV}: cannot load {path} ({exc})"
        got = _loaded_format(name)
        if got != WS_LIST_FORMAT:
            return (f"{_EXTRA_ENV}: {path} ({name}) reads work-list format {got}, this package writes "
                    f"{WS_LIST_FORMAT}; only builds of one format can be timed side by side")
    return ""


def _library_marker(name: str) -> bytes:
    """The mangled name of the static function TORCH_LIBRARY(name, m) defines (void (torch::Library&)),
    in the symbol table of an unstripped build that registers namespace `name`."""
    return b"TORCH_LIBRARY_init_" + name.encode() + b"RN5torch7LibraryE"


def _loaded_format(name: str) -> Optional[int]:
    """The work-list format of the ops loaded under namespace `name`, None where there are none."""
    try:
        return int(getattr(torch.ops, name).ws_list_format())
    except (AttributeError, RuntimeError):
        return None


def _ops(name: str):
    """torch.ops.NAME; the default build's written out, as torch.compile traced it before there were
    others (test_torch_compile_traces_the_ops, fullgraph)."""
    return torch.ops.megatron_dualkv if name == DEFAULT_OPS else getattr(torch.ops, name)


def ops_namespace() -> str:
    """The namespace of the ops a call runs on: MEGATRON_DUALKV_OPS, or megatron_dualkv where unset;
    another must be an extra build's that is loaded (MEGATRON_DUALKV_CUDA_LIB_EXTRA)."""
    name = os.environ.get(_OPS_ENV) or DEFAULT_OPS
    if name != DEFAULT_OPS and _loaded_format(name) is None:
        loaded = [n for n, _ in extra_builds(os.environ.get(_EXTRA_ENV, ""))]
        raise ValueError(f"{_OPS_ENV}={name}: no build is loaded under that namespace (extra builds named by "
                         f"{_EXTRA_ENV}: {loaded or 'none'})")
    return name


# The format of the ws work lists and ops this package uses; csrc/dualkv_ws_ops.cpp's kWsListFormat
# is the one a build reads. 2: kv item field 7 < 0 marks a phase-aligned walk (a build before it
# would take such an item for a split part and write outside its workspace); 3: fwd_ws_sm90 takes
# the key tile width (kv_tile); 4: and narrow_tail; 5: a split part's field 7 is
# (slot << 20) | (part << 10) | parts (a format-4 build would read its slot from the wrong bits);
# 6: fwd_ws_sm90 takes persistent; 7: ws kv items of 10 fields (8: a prompt's tail keys at the
# head of a response's first key tile, 9: where a slot's rows are stored) and bwd_ws_sm90 takes
# tail_slots; 8: the ws dQ kernel reads row item field 6 (q0's row in q) and the deterministic
# backward takes local queries (a format-7 build would refuse them); 9: bwd_ws_sm90 takes
# head_parts and long_items (`ws_head_parts`); 10: and dq_beside (`ws_dq_beside`); 11: and rest_parts
# (`ws_rest_parts`).
WS_LIST_FORMAT = 11


def _list_format_problem() -> str:
    """'' when the loaded extension reads the work lists this package writes, else why not."""
    got = _loaded_format(DEFAULT_OPS)
    if got == WS_LIST_FORMAT:
        return ""
    have = "no ws_list_format op (built before format 2)" if got is None else f"work-list format {got}"
    return (f"the CUDA extension is stale: it reads {have}, this package writes format {WS_LIST_FORMAT}; "
            "rebuild it (pip install --no-build-isolation . or python csrc/build_ext.py)")


def is_available(q: Optional[Tensor] = None) -> tuple[bool, str]:
    """(usable, reason when not): CUDA present, extension built, an sm_90 GPU, inputs it takes."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    ok, why = _load()
    if not ok:
        return False, why
    dev = q.device if (q is not None and q.is_cuda) else torch.device("cuda", torch.cuda.current_device())
    if q is not None and not q.is_cuda:
        return False, f"q is on {q.device}, not a CUDA device"
    cap = torch.cuda.get_device_capability(dev)
    if cap != (9, 0):
        return False, f"kernels are built for sm_90a (Hopper); this GPU is sm_{cap[0]}{cap[1]}"
    if q is not None:
        problem = _input_problem(q)
        if problem:
            return False, problem
    return True, ""


def _input_problem(q: Tensor, k: Optional[Tensor] = None, v: Optional[Tensor] = None, local: bool = False) -> str:
    if q.dim() != 3:
        return f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} is not supported (bfloat16 or float16)"
    if q.shape[-1] not in (64, 128):
        return f"head dim {q.shape[-1]} is not supported (64 or 128)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and not t.is_contiguous():
            return f"{name} is not contiguous (strides {t.stride()} for shape {tuple(t.shape)}); pass a contiguous [T, H, D] tensor"
    if k is not None and v is not None:
        if k.dtype != q.dtype or v.dtype != q.dtype:
            return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
        if k.dim() != 3 or k.shape != v.shape or k.shape[-1] != q.shape[-1] or (k.shape[0] != q.shape[0] and not local):
            return f"k, v must be [T, Hkv, D] matching q {tuple(q.shape)}; got {tuple(k.shape)}, {tuple(v.shape)}"
        if q.shape[1] % k.shape[1]:
            return f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})"
        if q.device != k.device or q.device != v.device:
            return "q, k, v must be on one device"
    return ""


# ---------------------------------------------------------------------------------------------
# work lists (host, once per layout)
# ---------------------------------------------------------------------------------------------


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _group_by_segment(items: list, segment, work) -> list:
    """items ordered by segment(item): the segment with the heaviest item (by work) first, the
    heaviest item first inside one (longest-processing-time order over segments). The work lists
    keep a segment's items together so that the CTAs resident at once share its rows in L2."""
    keys = [(segment(it), work(it)) for it in items]
    heaviest: dict[int, int] = {}
    for seg, w in keys:
        heaviest[seg] = max(heaviest.get(seg, 0), w)
    order = sorted(range(len(items)), key=lambda i: (-heaviest[keys[i][0]], keys[i][0], -keys[i][1], items[i][0]))
    return [items[i] for i in order]


# Query chunks: the packed rows q holds, as (packed row a, packed row b, local row of a) for each
# contiguous run; the whole micro-batch is the one chunk (0, T, 0). A context-parallel rank holds
# a few runs (its CP chunks, cp/partition.py).
QueryChunks = tuple


def query_chunks(q_rows: Tensor, num_tokens: int) -> QueryChunks:
    """The runs of consecutive packed rows in q_rows (ascending, unique, inside [0, num_tokens))."""
    rows = q_rows.detach().to("cpu", torch.int64)
    if rows.numel() == 0:
        raise ValueError("q_rows is empty: a rank must hold at least one query row")
    steps = rows[1:] - rows[:-1]
    if bool((steps <= 0).any()) or int(rows[0]) < 0 or int(rows[-1]) >= num_tokens:
        raise ValueError(f"q_rows must be ascending, unique packed rows inside [0, {num_tokens}); got rows "
                         f"{int(rows.min())}..{int(rows.max())}{' not ascending' if bool((steps <= 0).any()) else ''}")
    breaks = (torch.nonzero(steps != 1).flatten() + 1).tolist()
    firsts = [0] + breaks
    lasts = breaks + [rows.numel()]
    r = rows.tolist()
    return tuple((r[i], r[j - 1] + 1, i) for i, j in zip(firsts, lasts))


def _held(a: int, b: int, chunks: Optional[QueryChunks]) -> list:
    """The parts of packed rows [a, b) that q holds: [(lo, hi, local row of lo)]."""
    if chunks is None:
        return [(a, b, a)] if b > a else []
    out = []
    for c0, c1, loc in chunks:
        lo, hi = max(a, c0), min(b, c1)
        if lo < hi:
            out.append((lo, hi, loc + lo - c0))
    return out


def _child_ranges(segments: SegmentTable) -> dict:
    """root segment -> the merged contiguous packed-row ranges of its children."""
    starts, lengths, parents = segments.host_start, segments.host_length, segments.host_parent
    children: dict[int, list[int]] = {}
    for s, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(s)
    merged = {}
    for p, kids in children.items():
        runs: list[tuple[int, int]] = []
        for s in sorted(kids, key=lambda x: starts[x]):
            a, b = starts[s], starts[s] + lengths[s]
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        merged[p] = runs
    return merged


def _check_depth(segments: SegmentTable) -> None:
    if segments.depth > 2:
        raise ValueError(
            f"the CUDA DualKV kernels take segment trees of depth <= 2 (root prompt + child responses); "
            f"this layout has depth {segments.depth}"
        )


def row_items(segments: SegmentTable, row_tile: int = TILE, chunks: Optional[QueryChunks] = None) -> list:
    """Query tiles: [q0, q1, self0, par0, par1, cost, qloc, 0], grouped by segment: the segment with
    the heaviest tile first (longest-processing-time order over segments, so long prompt tiles start
    before short response tiles), heaviest tile first inside one. Rows q0..q1 lie in one segment
    starting at self0 (parent rows par0..par1, or 0, 0 for a root) and in one query chunk; qloc is
    q0's row in q. cost counts 64-row key tiles. A segment's tiles are neighbours so that the CTAs
    resident at once read one response's keys: the ws forward on (16, 512, 1024) 3.5 % and on
    (64, 256, 1024) 2 % faster than with all tiles heaviest first, L2 hit 72 -> 85 % (H100,
    docs/PERF.md, thirteenth session); the long shapes unchanged."""
    _check_depth(segments)
    items = []
    for a, n, p in zip(segments.host_start, segments.host_length, segments.host_parent):
        par0, par1 = (segments.host_start[p], segments.host_start[p] + segments.host_length[p]) if p >= 0 else (0, 0)
        npar = _ceil(par1 - par0, TILE)
        for lo, hi, loc in _held(a, a + n, chunks):
            for q0 in range(lo, hi, row_tile):
                q1 = min(q0 + row_tile, hi)
                items.append([q0, q1, a, par0, par1, npar + _ceil(q1 - a, TILE), loc + q0 - lo, 0])
    return _group_by_segment(items, lambda it: it[2], lambda it: it[5])


def kv_items(segments: SegmentTable, kv_tile: int = TILE) -> tuple[list, list]:
    """Key tiles of the mma / sm90 backward kernels (every query row): kv items [k0, k1, seg_end,
    range_lo, range_hi, tiles_per_head, 0, 0] (the query rows that attend them: their own
    segment's rows from k0 on, causally, and the kv ranges range_lo..range_hi) and kv ranges
    [q0, q1] (merged children of each root; independent of kv_tile). Heaviest first."""
    _check_depth(segments)
    starts, lengths = segments.host_start, segments.host_length
    ranges: list[list[int]] = []
    root_ranges: dict[int, tuple[int, int]] = {}
    for p, runs in _child_ranges(segments).items():
        root_ranges[p] = (len(ranges), len(ranges) + len(runs))
        ranges += [[a, b] for a, b in runs]
    kvs = []
    for s, (a, n) in enumerate(zip(starts, lengths)):
        end = a + n
        rlo, rhi = root_ranges.get(s, (0, 0))
        child_tiles = sum(_ceil(ranges[r][1] - ranges[r][0], TILE) for r in range(rlo, rhi))
        for k0 in range(a, end, kv_tile):
            kvs.append([k0, min(k0 + kv_tile, end), end, rlo, rhi,
                        _ceil(end - k0, TILE) + child_tiles, 0, 0])
    kvs.sort(key=lambda r: -r[5])
    return kvs, ranges or [[0, 0]]


def build_work(segments: SegmentTable, row_tile: int = TILE, kv_tile: int = TILE) -> tuple[list, list, list]:
    """Host work lists of the mma / sm90 kernels: (`row_items`, *`kv_items`)."""
    return (row_items(segments, row_tile), *kv_items(segments, kv_tile))


# The ws backward's first band of kv items: work >= 1/LONG_BAND of the heaviest item's. A list-
# scheduling model of the published shapes (132 SMs) puts every band split from 1/8 to 1/16 within
# 0.3 % of the ideal makespan; 1/4 left some prompt tiles of (16, 65536, 1024) in the second band.
LONG_BAND = 8

# A key tile whose CTA would last more than WS_SPLIT_AT times the ideal makespan (all CTAs' work /
# SMs) is split by query rows into parts, one CTA each: a GRPO group of many responses behind a
# short prompt, e.g. (N, P, R) = (16, 512, 1024), where each prompt key tile walks all N * R rows
# and the backward took 1.8x the ideal (csrc/ws_block_order_model.py). Measured on the H100
# (docs/PERF.md, twelfth session, then split by query head): -17 % backward at 1.26x the ideal,
# -26 to -43 % at 1.8-2.3x, but +14 % at 0.97x (the split's own cost): hence 1.2. Steps per CTA
# start as in that model.
WS_SPLIT_AT = 1.2
WS_CTA_OVERHEAD = 4
# A part walks at least WS_SPLIT_MIN_ROWS query rows (consecutive short responses merge) and at
# most half the split threshold's work; cuts inside a response fall on multiples of 320 rows, so
# 64- and 80-row steps stay whole. Field 7 of a part = (slot << 20) | (part << 10) | parts: at most
# 1023 parts per key tile and 2047 slots (a tile that would need more stays whole; a deterministic
# list's slot per part is hkv x 128 KB at head dim 128).
WS_SPLIT_MIN_ROWS = 256
_SPLIT_CUT = 320
# A split list is ordered by segment for L2 (above), unless that order models SPLIT_ORDER_GAP
# longer than heaviest first (`split_by_rows`, order="auto"; fast mode only, `ws_split`): with one
# kv head a segment's late parts start after the others' and set the end. H100 bwd, heaviest first
# / by segment at a modelled gap of: 1.31-1.32 on (8, 1000, 3000) at 4 / 1 and 8 / 1: 0.792-0.795
# and 0.834; 1.21-1.22 on (16, 1024, 2048): 0.933-0.941 at 4 / 1 but 1.041 at 8 / 1; 1.15 on
# (32, 1024, 1024) at 4 / 1: 1.007; 1.09 on (16, 1024, 2048) at 8 / 2: 0.970; 1.05-1.06 at 32 / 4:
# 0.975 and 1.041; at 32 / 8 the segment order was 2 % faster on (64, 256, 1024) at 1.02
# (thirteenth session). The model leaves out L2, which the segment order is for; hence 25 %
# (docs/PERF.md, thirty-fifth session).
SPLIT_ORDER_GAP = 0.25
_MAX_PARTS, _MAX_SLOTS = 1023, 2047


def split_by_rows(items: list, ranges: list, seg_starts: list, hkv: int, group: int, sms: int,
                  per_part: bool = False, max_slots: int = _MAX_SLOTS, balance: str = "off",
                  order: str = "segment") -> tuple[list, list]:
    """`ws_kv_work`'s (items, ranges) with the key tiles that would outlast the grid split by query
    rows: each becomes parts (items with the same k0) whose ranges, appended to `ranges`, are the
    tile's cut at segment starts, so a part walks whole responses. Field 7 of part i of `parts` =
    (slot << 20) | (i << 10) | parts, for the kernel's fp32 dK/dV workspace: `slot` numbers the
    split tiles from 0 (fast mode: the parts add into their tile's slot), or with per_part
    (deterministic mode) the tile's first slot, its parts taking consecutive slots (each stores its
    own; the last sums them in part order).

    After a split the list is ordered by the segment whose rows an item walks first (its children's
    for a part, its own for a response's key tile), heaviest segment first, heaviest item first
    inside one, in one band (field 5 = 0): the parts of the prompt's tiles run next to the
    response's own key tiles, which walk the same query rows, so Q, dO and dQ are shared in L2
    (modelled L2 misses 83 -> 35 % on (64, 256, 1024), 52 -> 15 % on (16, 512, 1024);
    docs/PERF.md, thirteenth session). The kernel walks a split list's query tiles last first
    (bwd_ws_sm90 with split_slots > 0; MEGATRON_DUALKV_WS_REVERSE_ROWS=0 keeps list order), so the
    neighbours, which start at different rows of a response, all start at its end and walk down
    together: modelled misses 35 -> 16 % on (64, 256, 1024); measured bwd 0.2-2.3 % faster on GRPO
    shapes (docs/PERF.md, twenty-fifth session). With order="auto" (`ws_split`) the list is
    heaviest first instead where the segment order models SPLIT_ORDER_GAP longer (one kv head:
    a segment's late CTAs set the end), "work" always. Without a split, items and ranges come
    back unchanged; with balance="auto" (`ws_split`) also where the whole key tiles in head parts
    (`balance_head_parts`) model (`modelled_makespan`) ROWS_BALANCE_GAIN shorter than the split."""
    cta = lambda it: it[4] * group + WS_CTA_OVERHEAD  # noqa: E731  (64-row steps of one CTA, + start)
    ideal = sum(cta(it) for it in items) * hkv / sms
    if not items or max(cta(it) for it in items) <= WS_SPLIT_AT * ideal:
        return items, ranges
    cap = max(_SPLIT_CUT, int((WS_SPLIT_AT * ideal - WS_CTA_OVERHEAD) / group / 2) * TILE // _SPLIT_CUT * _SPLIT_CUT)
    starts = sorted(seg_starts)
    whole, ranges = ranges, list(ranges)  # the parts' ranges are appended to a copy
    out, slots = [], 0
    for it in items:
        # a prompt tail's items (field 8) are parts of their own already (`ws_kv_work`, merge_tails)
        long_walk = cta(it) > WS_SPLIT_AT * ideal and not it[8]
        parts = _row_parts([ranges[r] for r in range(it[2], it[3])], starts, cap) if long_walk else []
        if len(parts) < 2 or slots + (len(parts) if per_part else 1) > max_slots:
            out.append(it)
            continue
        for i, part in enumerate(parts):
            rlo = len(ranges)
            ranges += part
            out.append([it[0], it[1], rlo, len(ranges), sum(_ceil(b - a, TILE) for a, b, _, _ in part), 0,
                        sum(_ceil(b - a, WS_BWD_WIDE_TILE) for a, b, _, _ in part), (slots << 20) | (i << 10) | len(parts),
                        0, it[0]])
        slots += len(parts) if per_part else 1
    out = _group_by_segment(out, lambda it: _walked_segment(it, ranges, starts), cta)
    for it in out:
        it[5] = 0
    split_span = modelled_makespan(out, hkv, group, sms) if order == "auto" or balance == "auto" else 0.0
    if order != "segment":
        by_work = sorted(out, key=lambda it: -cta(it))  # stable: the segment order among equals
        work_span = modelled_makespan(by_work, hkv, group, sms)
        if order == "work" or split_span > (1 + SPLIT_ORDER_GAP) * work_span:
            out, split_span = by_work, work_span
    if balance == "auto" and (parts := balance_head_parts(items, hkv, group, sms)) > 1:
        if modelled_makespan(items, hkv, group, sms, parts) < (1 - ROWS_BALANCE_GAIN) * split_span:
            return items, whole  # whole key tiles in head parts (`ws_head_parts`) last less
    return out, ranges


def _walked_segment(item: list, ranges: list, starts: list) -> int:
    """The segment whose rows a kv item walks first among its children's (a root's key tile, a
    part), else its own (a response's key tile): its index in the sorted segment starts."""
    row = next((r[0] for r in ranges[item[2]:item[3]] if not r[3]), item[0] + max(item[8], 0))
    return bisect.bisect_right(starts, row) - 1


def _row_parts(rs: list, starts: list, cap: int) -> list:
    """A key tile's query ranges [a, b, loc, causal] cut at segment starts and every `cap` rows,
    then grouped in order into parts of at least WS_SPLIT_MIN_ROWS rows (at most _MAX_PARTS)."""
    pieces = []
    for a, b, loc, causal in rs:
        edges = [a] + starts[bisect.bisect_right(starts, a):bisect.bisect_left(starts, b)] + [b]
        for lo, hi in zip(edges, edges[1:]):
            pieces += [[x, min(x + cap, hi), loc + x - a, causal] for x in range(lo, hi, cap)]
    min_rows = max(WS_SPLIT_MIN_ROWS, _ceil(sum(b - a for a, b, _, _ in pieces), _MAX_PARTS))
    parts, cur, rows = [], [], 0
    for pc in pieces:
        cur.append(pc)
        rows += pc[1] - pc[0]
        if rows >= min_rows:
            parts.append(cur)
            cur, rows = [], 0
    if cur:
        if parts:
            parts[-1] += cur
        else:
            parts.append(cur)
    return parts


def _mark_long_band(items: list, work) -> None:
    """Field 5 of every item (sorted heaviest first by `work`) = n_long, the number of items with
    at least 1/LONG_BAND of the heaviest's work: the kernel's first band."""
    n_long = sum(1 for it in items if work(it) * LONG_BAND >= work(items[0])) if items else 0
    for it in items:
        it[5] = n_long


# Head parts for balance. With one or two kv heads (a tensor-parallel rank's share: Qwen3-8B's
# 32 / 8 heads at TP = 8 are 4 / 1) a kv head's long key tiles are about as many as the SMs, so
# each SM runs about one and the heaviest sets the backward's makespan: (28, 16384, R) at 4 / 1
# and 8 / 1 modelled 1.09-1.22x the ideal, measured bwd 1.04-1.15x Flex-FLASH's (0.96-0.98x at
# 8 / 2; docs/PERF.md, thirty-fifth session). Head parts (`ws_head_parts`) cut those CTAs into
# group / parts query heads each. Modelled only where the heaviest CTA exceeds BALANCE_GATE of an
# SM's ideal share (the model takes ~0.2 ms per thousand CTAs); taken where they shorten the modelled
# makespan by BALANCE_GAIN or more.
BALANCE_GATE = 0.5
BALANCE_GAIN = 0.03
# In fast mode head parts also replace a split by query rows (`split_by_rows`) where they model
# ROWS_BALANCE_GAIN shorter. H100 bwd, head parts / split, modelled -> measured: 0.851 -> 0.857 and
# 0.857 -> 0.868 on (28, 16384, 1024) at 8 / 1 and 4 / 1, 0.953-0.961 -> 0.946-0.978 on four
# layouts at 16 / 4, 8 / 2 and 4 / 1 (the last, (32, 8192, 1024) at 4 / 1, 0.961 -> 0.946, just
# outside the margin), but 0.968 -> 1.023 on (32, 1024, 1024) at 32 / 8: the model leaves out the
# parts' own costs (docs/PERF.md, thirty-fifth session).
ROWS_BALANCE_GAIN = 0.04


def modelled_makespan(items: list, hkv: int, group: int, sms: int, parts: int = 1) -> float:
    """Steps until the ws backward's last CTA ends in a list-scheduling model (which
    csrc/ws_block_order_model.py sets beside other block orders): a CTA lasts its 64-row query tiles x the query heads it walks +
    WS_CTA_OVERHEAD, `sms` run at once, the next in block order starts on the first SM free. Block
    order as bwd_ws_sm90's map_block: the long band (items 0 .. n_long - 1, field 5) of every kv
    head and head part (a prompt tail's part, field 7 > 0, walked whole by part 0), then the other
    items of every kv head."""
    n_long = items[0][5] if items else 0
    free = [0.0] * sms
    for _ in range(hkv):
        for part in range(parts):
            for it in items[:n_long]:
                whole = parts > 1 and it[7] > 0
                if part == 0 or not whole:
                    heapq.heapreplace(free, free[0] + it[4] * group / (1 if whole else parts) + WS_CTA_OVERHEAD)
    for _ in range(hkv):
        for it in items[n_long:]:
            heapq.heapreplace(free, free[0] + it[4] * group + WS_CTA_OVERHEAD)
    return max(free)


def balance_head_parts(items: list, hkv: int, group: int, sms: int) -> int:
    """Head parts (1, 2, 4 or 8, dividing the group) that balance the ws backward's long band: 1
    where its heaviest CTA is BALANCE_GATE of an SM's ideal share or less, or where no count
    shortens the modelled makespan by BALANCE_GAIN; else the fewest parts within 0.5 % of the
    shortest."""
    if not items:
        return 1
    steps = [it[4] * group + WS_CTA_OVERHEAD for it in items]
    if max(steps) <= BALANCE_GATE * sum(steps) * hkv / sms:
        return 1
    spans = {p: modelled_makespan(items, hkv, group, sms, p) for p in (1, 2, 4, 8) if group % p == 0}
    best = min(spans.values())
    if best > spans[1] * (1 - BALANCE_GAIN):
        return 1
    return min(p for p, span in spans.items() if span <= best * 1.005)


def _per_part(split: Optional[tuple]) -> bool:
    """Whether `ws_kv_work`'s split argument asks for the deterministic lists (a slot per part)."""
    return split is not None and len(split) > 3 and bool(split[3])


def _balance(split: Optional[tuple]) -> str:
    """`ws_kv_work`'s split argument's head parts for balance (`ws_split`): "off" (also in splits of
    3 or 4 fields), "unsplit" or "auto"."""
    return str(split[4]) if split is not None and len(split) > 4 else "off"


def _split_order(split: Optional[tuple]) -> str:
    """`ws_kv_work`'s split argument's order of a split list (`ws_split`): "segment" (also in splits
    of 5 fields or fewer), "auto" or "work"."""
    return str(split[5]) if split is not None and len(split) > 5 else "segment"


def split_slots(items: list, per_part: bool = False) -> int:
    """How many fp32 dK/dV slots the parts of `split_by_rows` name: one per split key tile, or with
    per_part one per part; 0 where nothing is split. Field 7 < 0 is a phase-aligned walk, not a
    part; the prompt tails' parts (field 8 != 0, `ws_kv_work`, merge_tails) come after these slots."""
    return max(((it[7] >> 20) + (((it[7] >> 10) & 1023) if per_part else 0) + 1
                for it in items if it[7] > 0 and not it[8]), default=0)


def tail_slots(items: list, per_part: bool = False) -> int:
    """How many fp32 dK/dV slots the prompt tails' parts (`ws_kv_work`, merge_tails) take after
    the split slots (`_tail_slot_count` per tail)."""
    owners = [it for it in items if it[8] < 0 and it[7] > 0]
    return sum(_tail_slot_count(it[7] & 1023, -it[8], per_part) for it in owners)


def _phase_walks(items: list, ranges: list) -> None:
    """In place: every kv item with child ranges (a root's key tile) lists them before its own
    and gets field 7 = -1 - slot, one slot per set of children (a group's responses), so the
    kernel walks the children from the step the other CTAs of its kv head are at (the
    phase-aligned walks of dkdv_ws_kernel)."""
    slots: dict = {}
    for it in items:
        rs = ranges[it[2]:it[3]]
        kids = [r for r in rs if not r[3]]
        if kids:
            ranges[it[2]:it[3]] = kids + [r for r in rs if r[3]]
            it[7] = -1 - slots.setdefault(kids[0][0], len(slots))


def ws_phase() -> bool:
    """Phase-aligned walks in the ws backward (`_phase_walks`); MEGATRON_DUALKV_WS_PHASE=0
    turns them off (own rows first, every walk from its first step; for A/B timings)."""
    return os.environ.get("MEGATRON_DUALKV_WS_PHASE", "1") != "0"


def _env_choice(var: str, choices: tuple) -> str:
    """$var, or choices[0] where unset; any other value than `choices` is an error naming the
    variable and what it takes (csrc/env_choice.h does the same for the extension's switches)."""
    value = os.environ.get(var, choices[0])
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ValueError(f"{var} must be {allowed}, got {value!r}")
    return value


def ws_long_band_by_segment() -> bool:
    """Whether the ws backward's first band is grouped by segment like the second (True) or in
    order of work across segments; MEGATRON_DUALKV_WS_LONG_BAND=work keeps the order of work
    (an A/B switch)."""
    return _env_choice("MEGATRON_DUALKV_WS_LONG_BAND", ("segment", "work")) == "segment"


def ws_tail_merge() -> bool:
    """Whether the ws backward takes a prompt's partial last key tile into its responses' first key
    tiles (`ws_kv_work`, merge_tails); MEGATRON_DUALKV_WS_TAIL=tile keeps the tile (an A/B switch)."""
    return _env_choice("MEGATRON_DUALKV_WS_TAIL", ("merge", "tile")) == "merge"


# Slots the prompt tails may take (the split parts take the rest of _MAX_SLOTS): fast mode one per
# tail; the deterministic mode's parts store their rows apart, so a micro-batch of many short
# groups would ask hundreds (64 x (16, 300, 200): 445 slots, 456 MB at Hkv = 8, head dim 128). Each
# slot is Hkv x 2 x 128 x D fp32 (1 MiB at Hkv = 8, D = 128); past the cap a tail keeps its tile.
_MAX_TAIL_SLOTS = 1024
_MAX_TAIL_SLOTS_PER_PART = 256


def _prompt_tails(segments: SegmentTable, kv_tile: int, split: Optional[tuple]) -> tuple[dict, int]:
    """({root segment -> t}, slots taken): t, the keys of its partial last key tile (length % kv_tile), for the roots
    with children whose tails `ws_kv_work` merges: where `_tail_merge_pays` (with split's query
    heads per kv head; without a split, every tail: the lists of the tests and models), while the
    slots they take (`_tail_slot_count`) stay within _MAX_TAIL_SLOTS (_MAX_TAIL_SLOTS_PER_PART with
    a slot per part) and a tail's parts (its own rows + one per child) within _MAX_PARTS."""
    per_part = _per_part(split)
    cap = _MAX_TAIL_SLOTS_PER_PART if per_part else _MAX_TAIL_SLOTS
    kids: dict[int, list] = {}
    for c, p in enumerate(segments.host_parent):
        if p >= 0:
            kids.setdefault(p, []).append(segments.host_length[c])
    tails, used = {}, 0
    for s, lengths in sorted(kids.items()):
        t = segments.host_length[s] % kv_tile
        if not t or len(lengths) + 1 > _MAX_PARTS:
            continue
        cost = _tail_slot_count(len(lengths) + 1, t, per_part)
        pays = split is None or _tail_merge_pays(t, lengths, split[1], TILE if per_part else WS_BWD_WIDE_TILE)
        if pays and used + cost <= cap:
            tails[s] = t
            used += cost
    return tails, used


def _tail_merge_pays(t: int, lengths: list, group: int, step: int, kv_tile: int = 128) -> bool:
    """Whether a prompt tail of t keys costs its responses (of `lengths`) less merged than as a tile
    of its own, in the split model's units (query steps of `step` rows times the query heads per kv
    head, WS_CTA_OVERHEAD per CTA). As a tile it walks every response once more; merged, each
    response's later key tiles start t keys earlier, so each walk takes up to one more partial step
    (and a tail of nearly kv_tile keys saves nothing: its response tile is nearly all tail)."""
    old = new = 0
    for r in lengths:
        aligned = [r - j for j in range(0, r, kv_tile)]
        shifted = [r - j + t for j in range(kv_tile, r + t, kv_tile)]
        old += (sum(_ceil(x, step) for x in aligned) + _ceil(r, step)) * group + len(aligned) * WS_CTA_OVERHEAD
        new += (_ceil(r, step) + sum(_ceil(x, step) for x in shifted)) * group + (1 + len(shifted)) * WS_CTA_OVERHEAD
    return new < old


def _tail_slot_count(parts: int, t: int, per_part: bool) -> int:
    """Workspace slots of a prompt tail of t keys and `parts` parts: one (fast mode: the parts add
    into it), or with per_part one per 128 // t parts (each part's t rows stored apart, summed in part
    order by the last; dkdv_ws_kernel packs them so)."""
    return -(-parts // (128 // t)) if per_part else 1


def _assign_tail_slots(items: list, base: int, per_part: bool) -> None:
    """In place: field 7 of a prompt tail's parts (its tile over its own rows, field 8 < 0, part 0;
    its responses' first key tiles, field 8 > 0, parts 1.. in list order) = (slot << 20) | (part <<
    10) | parts, slots numbered from `base` (after the split parts'), like `split_by_rows`'s."""
    parts: dict[int, list] = {}
    for it in items:
        if it[8] < 0:
            parts.setdefault(it[0], []).insert(0, it)
        elif it[8] > 0:
            parts.setdefault(it[9], []).append(it)
    slot = base
    for tail in sorted(parts):
        group = parts[tail]
        for i, it in enumerate(group):
            it[7] = (slot << 20) | (i << 10) | len(group)
        slot += _tail_slot_count(len(group), abs(group[0][8]), per_part)


def ws_kv_work(segments: SegmentTable, chunks: Optional[QueryChunks] = None, kv_tile: int = 128,
               split: Optional[tuple] = None, phase: bool = False,
               long_band_by_segment: bool = True, merge_tails: bool = True) -> tuple[list, list]:
    """Work of the ws backward (csrc/dualkv_bwd_ws_sm90.cu): kv items [k0, k1, rlo, rhi,
    tiles_per_head, n_long, wide_tiles_per_head, split, tail, dest] (query tiles of 64 and of
    WS_BWD_WIDE_TILE rows; split: 0, a part of a key tile split by query rows (> 0, `split_by_rows`;
    or a prompt tail's part, below) or a phase-aligned walk (< 0, `_phase_walks`);
    one item per key tile, also when no held query attends it: its dK, dV
    are then written as zero) and query ranges [a, b, loc, causal]: items rlo..rhi list the packed
    rows [a, b) that attend the key tile and that q holds (from local row loc): the tile's own
    segment from k0 on (causal) and the children of a root. The first n_long items (at least
    1/LONG_BAND of the heaviest's work) are the kernel's first band: their CTAs of every kv head
    start before any other item's; the rest follow. Each band is grouped by segment (heaviest
    first inside one; with long_band_by_segment=False the first band is heaviest first across
    segments). split =
    (hkv, group, SMs[, per_part]): key tiles that would outlast the grid are split by query rows
    (`split_by_rows`, which also reorders the list; per_part: a workspace slot per part, for the
    deterministic mode).
    phase: where nothing is split, a root's key tiles walk their children first, phase-aligned
    (`_phase_walks`; the H100 backward's DRAM traffic about halved on the published shapes,
    docs/PERF.md, fourteenth session).
    merge_tails: a prompt of P % kv_tile = t > 0 keys past its last whole key tile (`_prompt_tails`)
    does not walk its responses with a tile of t keys (a walk as long as a whole tile's: every step
    loads its Q, dO and adds its dQ rows whatever the keys). Its tile [P - t, P) walks its own rows
    only (tail = -t); each response's first key tile holds the t tail keys, then the response's
    first kv_tile - t keys (k0 = response start - t, tail = t, dest = P - t: the kernel loads the
    tail keys into its first t rows, never masks them, and adds their dK/dV into the tail's slot,
    whose last part stores them at dest..). The tail's own tile and the responses' tiles are the
    tail's parts (field 7, `_assign_tail_slots`); its responses' later key tiles start kv_tile - t
    keys in. dest: where the rows of a slot go (k0, but for a tail's response tiles)."""
    _check_depth(segments)
    children = _child_ranges(segments)
    per_part = _per_part(split)
    tails, tail_slots_used = _prompt_tails(segments, kv_tile, split) if merge_tails else ({}, 0)
    starts_, lengths, parents = segments.host_start, segments.host_length, segments.host_parent
    items, ranges = [], []

    def add(k0, k1, walk, tail, dest):
        rlo = len(ranges)
        ranges.extend(walk)
        tiles = sum(_ceil(hi - lo, TILE) for lo, hi, _, _ in walk)
        wide = sum(_ceil(hi - lo, WS_BWD_WIDE_TILE) for lo, hi, _, _ in walk)
        items.append([k0, k1, rlo, len(ranges), tiles, 0, wide, 0, tail, dest])

    for s, (a, n) in enumerate(zip(starts_, lengths)):
        end = a + n
        kids = [(lo, hi, loc, 0) for ca, cb in children.get(s, []) for lo, hi, loc in _held(ca, cb, chunks)]
        first = a
        t = tails.get(parents[s], 0) if parents[s] >= 0 else 0
        if t:  # the prompt's tail keys, then this response's first keys: the response's own rows, all of them
            first = min(a + kv_tile - t, end)
            own = [(lo, hi, loc, 1) for lo, hi, loc in _held(a, end, chunks)]
            add(a - t, first, own, t, starts_[parents[s]] + lengths[parents[s]] - t)
        for k0 in range(first, end, kv_tile):
            own = [(lo, hi, loc, 1) for lo, hi, loc in _held(k0, end, chunks)]
            tail_tile = s in tails and k0 + kv_tile > end  # its children's rows are walked by their first tiles
            add(k0, min(k0 + kv_tile, end), own if tail_tile else own + kids, -tails[s] if tail_tile else 0, k0)
    items.sort(key=lambda r: -r[4])
    _mark_long_band(items, lambda it: it[4])
    # each band grouped by segment: each response's key tiles together (heaviest first inside one)
    # instead of key tile 0 of every response, then key tile 1 of every response, ..., so that the
    # CTAs resident at once walk one response's rows. The second band: the H100 backward of
    # (28, 4096, R) 1.6-2 % faster, the other published shapes within +-0.7 % (docs/PERF.md,
    # thirteenth session). The first band holds response tiles where responses are long, and
    # several prompts' tiles in a micro-batch of several groups: grouped, modelled L2 misses
    # 34 -> 14 % on (4, 512, 32768) with the makespan unchanged, H100 backward 0.95 on
    # (8, 1024, 16384) with unequal responses and 0.90-0.98 on micro-batches of 2-16 groups
    # (docs/PERF.md, twenty-sixth session). On the published shapes it holds one prompt's tiles.
    n_long = items[0][5] if items else 0
    starts = sorted(starts_)
    walked = lambda it: _walked_segment(it, ranges, starts)  # noqa: E731
    if long_band_by_segment:
        items[:n_long] = _group_by_segment(items[:n_long], walked, lambda it: it[4])
    items[n_long:] = _group_by_segment(items[n_long:], walked, lambda it: it[4])
    ranges = [list(r) for r in ranges]
    if split is not None:
        items, ranges = split_by_rows(items, ranges, starts_, *split[:3], per_part=per_part,
                                      max_slots=_MAX_SLOTS - tail_slots_used, balance=_balance(split),
                                      order=_split_order(split))
    if phase and not split_slots(items):
        _phase_walks(items, ranges)
    if tails:
        _assign_tail_slots(items, split_slots(items, per_part), per_part)
    return items, ranges or [[0, 0, 0, 0]]


class Work:
    """Device work lists of one layout (and one set of query chunks), built once and cached on
    the SegmentTable: row items of 64-row (mma) and 128-row (sm90, ws) query tiles, kv items and
    ranges of 64-row (mma) and 128-row (sm90) key tiles, and the ws backward's kv items/ranges.
    With query chunks (local queries) only the ws lists are built. split: `ws_kv_work`'s."""

    def __init__(self, segments: SegmentTable, device: torch.device, chunks: Optional[QueryChunks] = None,
                 split: Optional[tuple] = None, phase: bool = False, long_band_by_segment: bool = True,
                 merge_tails: bool = True):
        mk = lambda x: torch.tensor(x, dtype=torch.int32, device=device).reshape(-1, len(x[0]))  # noqa: E731
        self.local = chunks is not None
        rows = whole_query_tiles(segments) if chunks is None else row_items(segments, 128, chunks)
        self.rows128 = mk(rows)
        # keys per query tile of the whole layout (ws_fwd_tile), so that a context-parallel rank's
        # forward takes the tile width the whole micro-batch takes and gives its rows bitwise
        self.fwd_mean_keys = mean_keys_per_query_tile(segments)
        ws_items, ws_ranges = ws_kv_work(segments, chunks, split=split, phase=phase,
                                         long_band_by_segment=long_band_by_segment, merge_tails=merge_tails)
        self.ws_kv, self.ws_ranges = mk(ws_items), mk(ws_ranges)
        per_part = _per_part(split)
        # the op's workspace slots: (split parts', prompt tails'); the long band's items (field 5)
        self.ws_slots = (split_slots(ws_items, per_part), tail_slots(ws_items, per_part))
        self.ws_long_items = ws_items[0][5] if ws_items else 0
        self.ws_long_own_share = long_band_own_share(ws_items, ws_ranges)
        self.ws_balance_parts = (balance_head_parts(ws_items, *split[:3])
                                 if _balance(split) != "off" and not self.ws_slots[0] else 1)
        # head parts under auto (`ws_head_parts`, `ws_rest_parts`) for the split argument's group:
        # the long band's, the more of the L2 rule's and balance's; the second band's, fast mode's
        # unsplit lists only
        self.ws_auto_head_parts = (max(auto_head_parts(split[1], self.ws_long_own_share), self.ws_balance_parts)
                                   if split is not None else 1)
        self.ws_rest_parts = (auto_rest_parts(ws_items, *split[:2], self.ws_auto_head_parts)
                              if split is not None and not per_part and not self.ws_slots[0] else 1)
        if not self.local:
            kw, kr = kv_items(segments)
            self.rows64, self.kv64, self.ranges = mk(row_items(segments)), mk(kw), mk(kr)
            self.kv128 = mk(kv_items(segments, 128)[0])  # the same ranges


def whole_query_tiles(segments: SegmentTable) -> list:
    """row_items of the whole layout's 128-row query tiles, cached on the layout (the forward's
    list, and what `mean_keys_per_query_tile` averages)."""
    return segments.cached("cuda_backend_rows128", lambda: row_items(segments, 128))


def mean_keys_per_query_tile(segments: SegmentTable) -> float:
    """The keys a 128-row query tile of the whole layout attends, on average (its last row's, in
    64-key tiles: the row items' cost). It picks the forward's key tile (`ws_fwd_tile`) and fast
    mode's backward (`fast_bwd_separate_dq`)."""
    rows = whole_query_tiles(segments)
    return sum(it[5] for it in rows) * TILE / len(rows)


def work_tensors(segments: SegmentTable, device: torch.device, chunks: Optional[QueryChunks] = None,
                 split: Optional[tuple] = None, phase: bool = False, long_band_by_segment: bool = True,
                 merge_tails: bool = True) -> Work:
    """The `Work` of a layout on a device (cached on the SegmentTable)."""
    return segments.cached(("cuda_backend_work", str(device), chunks, split, phase, long_band_by_segment, merge_tails),
                           lambda: Work(segments, device, chunks, split, phase, long_band_by_segment, merge_tails))


# Mean keys per query tile from which the ws forward takes 176-key tiles (head dim 128): a wider
# tile spreads each tile's fixed work (barrier waits, turns, fences) over more keys, but holds 2
# K/V stages instead of 3 and fills and drains each CTA more slowly. With the prompt's partial last
# tile narrowed (the kernel's default), H100 forward alone, 176 / 128 keys: 0.961-0.993 from
# (28, 8192, R) (7.7k keys per query tile) to (28, 32768, 2048) (27.5k), 1.003-1.030 on
# (28, 4096, R) (4.4k-5.0k) (docs/PERF.md, twentieth session §2, three cards); 1.001-1.027 on
# eight layouts of 6.0k-7.6k keys, among them long and unequal responses ((28, 6144, 2048) 1.014,
# (16, 1024, 8192) with responses of 0.1-1.9 R 1.027), one exception at 7.1k (0.993) (twenty-sixth
# session). Hence 7680: layouts below it take 128.
WIDE_TILE_KEYS = 7680


def ws_fwd_tile(work: "Work", head_dim: int) -> int:
    """Keys per K/V tile of the ws forward on this layout: 176 at head dim 128 when the query
    tiles attend WIDE_TILE_KEYS keys or more on average, else 128. MEGATRON_DUALKV_WS_FWD_TILE=128
    or 176 forces one (176 only at head dim 128; head dim 64 always takes 128)."""
    forced = _env_choice("MEGATRON_DUALKV_WS_FWD_TILE", ("auto", "128", "176"))
    if head_dim != 128:
        return 128
    if forced != "auto":
        return int(forced)
    return 176 if work.fwd_mean_keys >= WIDE_TILE_KEYS else 128


# Fast mode's backward runs the deterministic kernels (dK/dV without dQ, then the dQ kernel,
# which recomputes S and dP per query tile: 7 MMA units per tile pair against 5, but no fp32 dQ
# reduce-adds): at head dim 64 always, at head dim 128 where the query tiles attend
# SEPARATE_DQ_KEYS keys on average. H100, interleaved, head dim 128,
# separate / fused bwd over 16 GRPO layouts (single groups and micro-batches of 4-32 groups):
# 0.771-0.983 on all ten from 447 to 1,340 keys, 1.033-1.112 on the five from 1,569 keys up,
# 1.118 at 320; with Hq / Hkv = 32 / 4 0.700-0.956 inside, 1.010-1.043 outside (docs/PERF.md,
# twenty-sixth session §4). Short walks make the fused kernel's dQ traffic the cost; long ones
# make the recomputed MMAs the cost; very short query tiles make the dQ kernel's start-up the cost.
# At head dim 64 the separate dQ was faster on all 13 layouts tried, from 320 keys to the
# published (16, 32768, 1024): bwd 0.896-0.946.
SEPARATE_DQ_KEYS = (400, 1408)


def fast_bwd_separate_dq(segments: SegmentTable, head_dim: int) -> bool:
    """Whether a fast-mode ws backward on this layout runs the deterministic kernels (their
    result is bitwise reproducible too): at head dim 64, and at head dim 128 where the mean keys
    per query tile lie in SEPARATE_DQ_KEYS. MEGATRON_DUALKV_FAST_BWD=fused or =separate forces one
    (an A/B switch)."""
    forced = _env_choice("MEGATRON_DUALKV_FAST_BWD", ("auto", "fused", "separate"))
    if forced != "auto":
        return forced == "separate"
    lo, hi = SEPARATE_DQ_KEYS
    return head_dim == 64 or (head_dim == 128 and lo <= mean_keys_per_query_tile(segments) <= hi)


def ws_fwd_narrow_tail() -> bool:
    """Whether the ws forward runs a parent's partial last key tile after the row's own tiles with
    its MMAs narrowed to 64 or 128 keys (True) or in key order at full width. Narrowed on every
    layout: H100 forward alone, interleaved on the same inputs, narrowed / full at 176 keys: 0.955
    on (28, 4096, 2048), 0.986-0.995 on (28, 16384, R), level within the runs' noise (+-1.5 %) on
    P >= 32768 (docs/PERF.md, twentieth session). MEGATRON_DUALKV_WS_FWD_TAIL=full forces key
    order (an A/B switch)."""
    return _env_choice("MEGATRON_DUALKV_WS_FWD_TAIL", ("auto", "narrow", "full")) != "full"


# Mean keys per query tile below which the ws forward runs persistent CTAs (one per SM, taking the
# query tiles in turn, the next tile's Q and first K/V loaded under the current one's end), by head
# dim: short walks, where each CTA's start and end weigh. H100, forward alone, interleaved,
# persistent / one CTA per query tile (docs/PERF.md, twenty-seventh session §4, §8):
# - head dim 128: 0.881-0.970 on the six GRPO layouts from 320 to 1,245 keys ((256, 128, 256),
#   (128, 128, 512), 16 x (8, 250, 512), (64, 512, 512), (64, 256, 1024), 8 x (16, 500, 1024)),
#   0.992-1.000 on (16, 512, 1024) (1,065), 1.000 on (32, 1024, 1024) (1,569), 1.016-1.065 on
#   longer walks, where the persistent loop runs each step a little slower (cause not found); the
#   same with Hq / Hkv = 32 / 4;
# - head dim 64: 0.881-0.995 on ten layouts from 447 to 6,053 keys, 1.002-1.012 on four from 8.7k.
PERSISTENT_FWD_KEYS = {128: 1408, 64: 7680}


def ws_fwd_persistent(work: "Work", head_dim: int) -> bool:
    """Whether the ws forward on this layout runs persistent CTAs: where its query tiles attend
    fewer than PERSISTENT_FWD_KEYS[head_dim] keys on average. Out and lse are bitwise the same
    either way. MEGATRON_DUALKV_WS_FWD_PERSISTENT=1 or =0 forces one (an A/B switch)."""
    forced = _env_choice("MEGATRON_DUALKV_WS_FWD_PERSISTENT", ("auto", "0", "1"))
    if forced != "auto":
        return forced == "1"
    return work.fwd_mean_keys < PERSISTENT_FWD_KEYS.get(head_dim, 0)


def long_band_own_share(items: list, ranges: list) -> float:
    """The share of the ws backward's long band (the first n_long kv items) steps that walk the
    key tiles' own causal rows rather than their children's (64-row query tiles; 0 for an empty
    list)."""
    own = kids = 0
    for it in items[:items[0][5]] if items else []:
        for lo, hi, _, causal in ranges[it[2]:it[3]]:
            n = _ceil(hi - lo, TILE)
            own, kids = (own + n, kids) if causal else (own, kids + n)
    return own / (own + kids) if own + kids else 0.0


# Head parts of the ws backward (`ws_head_parts`): the long band's key tiles as several CTAs per
# kv head, each walking its share of the group's query heads, their dK/dV summed in fp32 slots. A
# CTA walks its heads one after the other; the children's walks are phase-aligned, but its own
# causal rows differ in length from tile to tile, so the resident CTAs drift apart by about an own
# walk per head, and past ~4 of them their rows overflow L2 (at Hq / Hkv = 32 / 4 the backward read
# and wrote 2-3x the DRAM bytes of 32 / 8 and ran at a lower clock). A CTA's own walks: group x the
# long band's own share of steps. Where the group has HEAD_PARTS_GROUP query heads or more and they
# reach OWN_WALKS, the fewest parts (a power of two up to 8, the counts the GPU tests cover) that
# leave a CTA OWN_WALKS_PER_PART or fewer; each part adds a K/V load, a prologue and an fp32 slot
# add per key tile, so more parts than that cost. H100, interleaved, bwd (docs/PERF.md,
# thirty-third and thirty-fourth sessions): 32 / 4, 2 parts / 1: 0.96-0.99 where own walks >= 4,
# 1.00-1.03 below; 4 parts / 2: 0.97-0.99 at 5.3-7.7 walks (level on (2, 1024, 32768)), level at
# 4. 32 / 2, against 1 part: 0.93-0.97 at 8-15 walks with 4-8 parts, 0.97 at 5.3 with 2 or 4
# (8: 0.98). At 32 / 8 (4 heads a CTA), 2 parts were 0.97-0.98 on (4, 512, 32768) and 1.01 on
# (2, 1024, 32768) and (4, 4096, 16384): not taken.
HEAD_PARTS_GROUP = 8
OWN_WALKS = 4.0
OWN_WALKS_PER_PART = 2.5  # 2 with room: P = 2 N R gives 4.004 walks at group 8


def ws_head_parts(work: "Work", group: int, split_on: bool = True) -> tuple[int, int]:
    """(head_parts, long_items) of the ws backward on this list (bwd_ws_sm90): the long band's
    items as head_parts CTAs per kv head, each walking group / head_parts query heads, their dK/dV
    summed in fp32 slots (fast mode: every part but the last to finish stores its own, the last
    adds them; deterministic mode: one slot per part, summed in part order); (1, 0): one CTA per key tile and
    kv head walks the whole group. Not on lists split by query rows (short walks already); a
    prompt tail's part is walked whole.
    auto: Work.ws_auto_head_parts, the more of `auto_head_parts` (from the CTA's own causal walks,
    group x the long band's own share of steps) and the list's parts for balance
    (`balance_head_parts`, Work.ws_balance_parts); 1 also with split_on=False (MEGATRON_DUALKV_WS_SPLIT=0: every key tile one CTA, for A/B
    timings and bitwise checks). MEGATRON_DUALKV_WS_HEAD_PARTS=1, 2, 4 or 8 forces the parts where
    the list allows them (an A/B switch; it must divide the group)."""
    forced = _env_choice("MEGATRON_DUALKV_WS_HEAD_PARTS", ("auto", "1", "2", "4", "8"))
    if forced == "auto":
        parts = work.ws_auto_head_parts if split_on else 1
    else:
        parts = int(forced)
    if group % parts:
        raise ValueError(f"MEGATRON_DUALKV_WS_HEAD_PARTS={parts} does not divide the {group} query heads per kv head")
    if parts == 1 or work.ws_slots[0] or not work.ws_long_items:
        return 1, 0
    return parts, work.ws_long_items


# Head parts of the ws backward's second band (`ws_rest_parts`): a response's key tiles walk their
# causal rows once per query head, one head after the other; over 8 heads the CTAs of a response
# drift apart and their rows overflow L2 (group 8 took 18-20 % more cycles than group 4 for the same
# work on 8 groups of (16, 1024, 2048), ncu L2 hit 72 against 79 %; docs/PERF.md, thirty-sixth
# session §4). Parts of 4 heads each (group 8: 2, group 16: 4; at 32 / 2, 8 groups of
# (16, 1024, 2048), 4 parts 0.83 and 2 parts 0.90 of one), where (H100, fast mode, bwd, 2 parts / 1,
# thirty-seventh and thirty-eighth sessions): the second band's key tiles walk REST_PARTS_MIN_STEPS
# 64-row steps per head on average or more (0.935-0.965 at 14-36 on multi-group layouts at 32 / 4
# and 16 / 2; with the store-and-ticket sums 0.909-0.955 at 8.5-9.6 on the fused kernel's layouts
# of 1024-token responses, 0.874 with 4 parts at group 16; the 1.04-1.08 once measured at 9.6 were
# layouts that fast mode runs on the deterministic kernels, whose lists take no parts: fewer steps
# are not measured), and at most REST_PARTS_MAX_STEPS_PER_HEAD x group
# (group 8: level at 60 and 1.018 at 129; group 16, whose heads drift twice as far: 0.95 at 60);
# and the band holds REST_PARTS_SHARE of the steps or more (the long single-group shapes, 1-3 %,
# measured level). One kv head is in: since fast mode's parts meet by store and ticket instead of
# atomics (thirty-eighth session), 8 / 1 measured 0.989-1.001 with 2 parts and 16 / 1 0.936-0.991
# with 4 on three layouts (with atomics 8 / 1 had lost 1.4-1.6 %, and a bound on the long band's
# longest CTA, 0.9 of an SM's share, left both out). Not in deterministic mode (1.053: each part
# stores its sums and the last adds them in part order) nor on split lists.
REST_PARTS_MIN_STEPS = 8.0
REST_PARTS_MAX_STEPS_PER_HEAD = 6.0
REST_PARTS_SHARE = 0.15


def auto_rest_parts(items: list, hkv: int, group: int, head_parts: int = 1) -> int:
    """group / 4 or 1: the second band's head parts on a fast-mode list by the rule above
    (`head_parts`: the long band's, whose CTAs count in the steps the band's share is of)."""
    n_long = items[0][5] if items else 0
    rest = items[n_long:]
    if group < HEAD_PARTS_GROUP or not rest or group % 4:
        return 1
    mean_steps = sum(it[4] for it in rest) / len(rest)
    rest_steps = hkv * sum(it[4] * group + WS_CTA_OVERHEAD for it in rest)
    long_steps = hkv * sum(it[4] * group + WS_CTA_OVERHEAD * head_parts for it in items[:n_long])
    walks_fit = REST_PARTS_MIN_STEPS <= mean_steps <= REST_PARTS_MAX_STEPS_PER_HEAD * group
    band_matters = rest_steps >= REST_PARTS_SHARE * (rest_steps + long_steps)
    return group // 4 if walks_fit and band_matters else 1


def ws_rest_parts(work: "Work", group: int) -> int:
    """Head parts of the ws backward's second band (bwd_ws_sm90's rest_parts): every item after the
    long band as rest_parts CTAs per kv head, each walking group / rest_parts query heads, their
    dK/dV summed in fp32 slots (fast mode: rest_parts - 1 per item and kv head, where every part
    but the last to finish stores its sums, about 2 (rest_parts - 1) / group of the fp32 dQ sums in
    size; deterministic: one per part). auto: `auto_rest_parts` (Work.ws_rest_parts), 1 on
    lists split by query rows and deterministic lists. MEGATRON_DUALKV_WS_REST_PARTS=1, 2, 4 or 8 forces
    the parts where the list allows them (must divide the group)."""
    forced = _env_choice("MEGATRON_DUALKV_WS_REST_PARTS", ("auto", "1", "2", "4", "8"))
    parts = work.ws_rest_parts if forced == "auto" else int(forced)
    if group % parts:
        raise ValueError(f"MEGATRON_DUALKV_WS_REST_PARTS={parts} does not divide the {group} query heads per kv head")
    return 1 if work.ws_slots[0] else parts


def ws_dq_beside(work: "Work", head_parts: int) -> bool:
    """Whether the deterministic ws backward's dQ kernel may start beside its dK/dV kernel's last
    wave (bwd_ws_sm90's dq_beside; MEGATRON_DUALKV_DQ_STREAM=auto): where the list splits key tiles
    by query rows (many short CTAs; twenty-third and twenty-fifth sessions) or walks its long band in
    head parts taken for balance (`balance_head_parts`: a tensor-parallel rank's few kv heads, whose
    long band about fills the grid once). H100 bwd, beside / after, in four runs: 0.983-0.991 on
    (28, 16384, 2048) at 4 / 1 and (32, 8192, 1024) at 8 / 2 and 16 / 2, also under one hardware
    queue, 0.983-1.000 on (28, 16384, 2048) at 8 / 1; where the parts are for L2 alone
    (`auto_head_parts`) 0.994-1.014, so not there, nor on the long shapes' unsplit lists at 32 / 8
    (docs/PERF.md, thirty-sixth session)."""
    return bool(work.ws_slots[0]) or (head_parts > 1 and work.ws_balance_parts > 1)


def auto_head_parts(group: int, own_share: float) -> int:
    """1 below HEAD_PARTS_GROUP query heads per kv head or OWN_WALKS own walks per CTA (group x
    own_share); else the fewest parts, a power of two up to 8 dividing the group, that leave a CTA
    OWN_WALKS_PER_PART own walks or fewer (group 8: 2 parts at share 0.5-0.625, 4 above; group 16:
    2 at 0.25-0.3125, 4 up to 0.625, 8 above)."""
    walks = group * own_share
    parts = 1
    if group < HEAD_PARTS_GROUP or walks < OWN_WALKS:
        return parts
    while walks / parts > OWN_WALKS_PER_PART and parts < 8 and group % (parts * 2) == 0:
        parts *= 2
    return parts


def ws_split(q: Tensor, k: Tensor, per_part: bool = False) -> Optional[tuple[int, int, int, bool, str, str]]:
    """`ws_kv_work`'s split argument for these heads on q's GPU: (Hkv, Hq / Hkv, SMs, per_part,
    balance, order), or None with MEGATRON_DUALKV_WS_SPLIT=0 (every key tile one CTA, prompt tails
    not merged either; for A/B timings and bitwise checks).
    - per_part: the deterministic mode's lists (a workspace slot per part, summed in part order).
    - balance: head parts for balance (`balance_head_parts`): "auto" on lists not split by query
      rows and, in fast mode, in place of a split where they model ROWS_BALANCE_GAIN shorter
      (`split_by_rows`); "unsplit" the former only (deterministic mode: on (28, 16384, 1024) at
      4 / 1 head parts in place of its split measured level with it, 1.002, once its dQ kernel
      runs beside them (`ws_dq_beside`; 1.016 with it launched after), where fast mode's split was
      13 % slower); "off" none. MEGATRON_DUALKV_WS_BALANCE=unsplit or =off forces one.
    - order: a split list's order (`split_by_rows`): "auto" by segment unless heaviest first
      models SPLIT_ORDER_GAP shorter; deterministic mode "segment" (heaviest first measured 1.002
      and 1.023 there at 4 / 1: its dQ kernel on a second stream fills a short dK/dV tail);
      MEGATRON_DUALKV_WS_SPLIT_ORDER=segment or =work forces one.
    The switches are for A/B timings."""
    if os.environ.get("MEGATRON_DUALKV_WS_SPLIT", "1") == "0":
        return None
    balance = _env_choice("MEGATRON_DUALKV_WS_BALANCE", ("auto", "unsplit", "off"))
    if per_part and balance == "auto":
        balance = "unsplit"
    order = _env_choice("MEGATRON_DUALKV_WS_SPLIT_ORDER", ("auto", "segment", "work"))
    if per_part and order == "auto":
        order = "segment"
    return k.shape[1], q.shape[1] // k.shape[1], _sm_count(q.device), bool(per_part), balance, order


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def cached_query_chunks(segments: SegmentTable, q_rows: Tensor) -> QueryChunks:
    """query_chunks(q_rows), read from the device once per q_rows tensor: cached on the layout
    under the tensor's storage, which the cache keeps alive so it cannot be reused by another
    tensor while the entry exists (every layer of a step passes the same CPShard.rows)."""
    key = ("cuda_backend_q_rows", q_rows.data_ptr(), q_rows.numel(), q_rows._version)
    return segments.cached(key, lambda: (q_rows, query_chunks(q_rows, segments.num_tokens)))[1]


FWD_IMPLS = ("sm90", "mma", "ws")  # "ws": warp-specialized kernels, the default where built
BWD_IMPLS = ("sm90", "mma", "ws")


def _impl(name: Optional[str], env: str, what: str, choices: tuple = FWD_IMPLS, ws_op: str = "fwd_ws_sm90") -> str:
    name = name or os.environ.get(env) or ("ws" if _has_op(ws_op) else "sm90")
    if name not in choices:
        raise ValueError(f"unknown {what} kernel {name!r}; choose one of {choices}")
    return name


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.megatron_dualkv, name)
        return True
    except (AttributeError, RuntimeError):
        return False


# ---------------------------------------------------------------------------------------------
# python side of the ops: fake (meta) implementations
# ---------------------------------------------------------------------------------------------

_registered = False


def _register_python_side() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    def _fwd_fake(q, k, v, row_work, scale):
        return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    torch.library.register_fake("megatron_dualkv::fwd")(_fwd_fake)
    torch.library.register_fake("megatron_dualkv::fwd_sm90")(_fwd_fake)

    def _fwd_ws_fake(q, k, v, row_work, scale, kv_tile=128, narrow_tail=True, persistent=False):
        return _fwd_fake(q, k, v, row_work, scale)

    if _has_op("fwd_ws_sm90"):  # absent from extensions built before it existed
        torch.library.register_fake("megatron_dualkv::fwd_ws_sm90")(_fwd_ws_fake)

    def _bwd_fake(dout, q, k, v, out, lse, dlse, row_work, kv_work, kv_ranges, scale, deterministic, split_slots=0,
                  tail_slots=0, head_parts=1, long_items=0, dq_beside=False, rest_parts=1):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    torch.library.register_fake("megatron_dualkv::bwd")(_bwd_fake)
    torch.library.register_fake("megatron_dualkv::bwd_sm90")(_bwd_fake)
    if _has_op("bwd_ws_sm90"):
        torch.library.register_fake("megatron_dualkv::bwd_ws_sm90")(_bwd_fake)


class _DualKVFunction(torch.autograd.Function):
    """apply(q, k, v, fwd_rows, bwd_rows, bwd_kv, bwd_ranges, scale, deterministic, fwd_kind,
    bwd_kind, slots, fwd_tiling, ops_ns): kinds "ws", "sm90", "mma"; bwd_kind is the kernel that runs
    (`_lists` picks the work lists that match both kinds); slots: the ws backward's workspace slots
    (key tiles split by query rows, prompt tails: `Work.ws_slots`), then its head parts and long
    items (`ws_head_parts`), dq_beside (`ws_dq_beside`) and the second band's parts
    (`ws_rest_parts`); fwd_tiling: the ws forward's (keys per tile, narrowed parent tail,
    persistent CTAs) (`ws_fwd_tile`, `ws_fwd_narrow_tail`, `ws_fwd_persistent`); ops_ns: the build
    whose ops run the forward and its backward (`ops_namespace`)."""

    @staticmethod
    def forward(ctx, q, k, v, fwd_rows, bwd_rows, bwd_kv, bwd_ranges, scale, deterministic, fwd_kind, bwd_kind,
                slots, fwd_tiling, ops_ns=DEFAULT_OPS):
        ops = _ops(ops_ns)
        if fwd_kind == "ws":
            out, lse = ops.fwd_ws_sm90(q, k, v, fwd_rows, scale, *fwd_tiling)
        else:
            out, lse = {"sm90": ops.fwd_sm90, "mma": ops.fwd}[fwd_kind](q, k, v, fwd_rows, scale)
        ctx.save_for_backward(q, k, v, out, lse, bwd_rows, bwd_kv, bwd_ranges)
        ctx.scale, ctx.deterministic, ctx.bwd_kind, ctx.slots, ctx.ops_ns = scale, deterministic, bwd_kind, slots, ops_ns
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, rows, kv, ranges = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        ops = _ops(ctx.ops_ns)
        args = (dout.contiguous(), q, k, v, out, lse, None, rows, kv, ranges, ctx.scale, ctx.deterministic)
        if ctx.bwd_kind == "ws":
            dq, dk, dv = ops.bwd_ws_sm90(*args, *ctx.slots)
        else:
            dq, dk, dv = {"sm90": ops.bwd_sm90, "mma": ops.bwd}[ctx.bwd_kind](*args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


def _lists(work: Work, fwd_kind: str, bwd_kind: str) -> tuple:
    """(forward rows, backward rows, kv items, ranges, backward kernel, workspace slots (split
    parts', prompt tails')) for the kernels chosen. The ws backward's deterministic mode takes
    `work` built without phase-aligned walks and with a workspace slot per split part (forward()
    builds it so) and the 128-row query tiles for its dQ kernel."""
    fwd_rows = work.rows64 if fwd_kind == "mma" else work.rows128
    if bwd_kind == "ws":
        return fwd_rows, work.rows128, work.ws_kv, work.ws_ranges, "ws", work.ws_slots
    if bwd_kind == "mma":
        return fwd_rows, work.rows64, work.kv64, work.ranges, "mma", (0, 0)
    return fwd_rows, work.rows128, work.kv128, work.ranges, "sm90", (0, 0)


def _check(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, local: bool) -> None:
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"DualKV CUDA backend unavailable: {why}")
    if not q.is_cuda:
        raise ValueError(f"DualKV CUDA backend: q is on {q.device}, not a CUDA device")
    problem = _input_problem(q, k, v, local)
    if problem:
        raise ValueError(f"DualKV CUDA backend: {problem}")
    if segments.num_tokens != k.shape[0] or (not local and segments.num_tokens != q.shape[0]):
        raise ValueError(f"DualKV CUDA backend: the layout packs {segments.num_tokens} tokens, q holds {q.shape[0]}, "
                         f"k and v {k.shape[0]}")
    if segments.depth > 2:
        raise ValueError(
            f"DualKV CUDA backend: segment trees of depth {segments.depth} are not supported (depth <= 2: prompt + responses)"
        )


def _local_dq_problem() -> str:
    """'' when the deterministic backward's dQ kernel takes local queries (the ws one), else why not."""
    if os.environ.get("MEGATRON_DUALKV_DQ_KERNEL", "ws") == "sm90":
        return "local queries run on the ws dQ kernel only; $MEGATRON_DUALKV_DQ_KERNEL=sm90 takes all rows"
    return ""


def supports_q_rows(deterministic: bool = False) -> tuple[bool, str]:
    """Local queries (q_rows) run on the ws kernels; deterministic=True on the ws dQ kernel."""
    if deterministic and (why := _local_dq_problem()):
        return False, why
    ok, why = _load()
    if not ok:
        return False, why
    if not (_has_op("fwd_ws_sm90") and _has_op("bwd_ws_sm90")):
        return False, "local queries need the ws kernels; the loaded extension predates them"
    for env in ("MEGATRON_DUALKV_CUDA_FWD", "MEGATRON_DUALKV_CUDA_BWD"):
        if os.environ.get(env, "ws") != "ws":
            return False, f"local queries run on the ws kernels only; ${env}={os.environ[env]}"
    return True, ""


def forward(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: Optional[float] = None,
            deterministic: bool = False, fwd_impl: Optional[str] = None,
            bwd_impl: Optional[str] = None, q_rows: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out [Tq, Hq, D], lse [Hq, Tq] float32). Differentiable in q, k, v through `out`.

    fwd_impl / bwd_impl: "ws" (warp-specialized, default where the extension has it), "sm90"
    (wgmma, synchronous) or "mma" (mma.sync kernels); deterministic=True: bitwise reproducible
    backward (ws: dK/dV by the ws kernel, split key tiles' parts summed in part order, dQ by the
    ws dQ kernel). With deterministic=False the ws backward still takes those kernels where they
    are the faster ones (`fast_bwd_separate_dq`: head dim 64, and at head dim 128 GRPO layouts of
    short prompts and responses).
    $MEGATRON_DUALKV_CUDA_FWD / $MEGATRON_DUALKV_CUDA_BWD set the defaults.
    q_rows: int64 [Tq], ascending packed rows of q's rows when q holds only some queries (context
    parallelism) while k, v hold all T rows; runs on the ws kernels (the deterministic backward's dQ
    then gives those rows bitwise as the whole micro-batch's deterministic backward does).
    """
    local = q_rows is not None
    _check(q, k, v, segments, local)
    fi = _impl(fwd_impl, "MEGATRON_DUALKV_CUDA_FWD", "forward")
    bi = _impl(bwd_impl, "MEGATRON_DUALKV_CUDA_BWD", "backward", BWD_IMPLS, "bwd_ws_sm90")
    for kind, op in ((fi, "fwd_ws_sm90"), (bi, "bwd_ws_sm90")):
        if kind == "ws" and not _has_op(op):
            raise RuntimeError(f"DualKV CUDA backend: impl 'ws' needs op megatron_dualkv::{op}; the loaded extension "
                               "predates it: rebuild (python csrc/build_ext.py or pip install -e .)")
    chunks = None
    if local:
        if fi != "ws" or bi != "ws":
            raise ValueError(f"DualKV CUDA backend: local queries (q_rows) run on the ws forward and backward only; "
                             f"got fwd_impl={fi!r}, bwd_impl={bi!r} (the flex backend takes the other cases)")
        if deterministic and (why := _local_dq_problem()):
            raise ValueError(f"DualKV CUDA backend: {why}")
        if q_rows.device != q.device or q_rows.dim() != 1 or q_rows.shape[0] != q.shape[0]:
            raise ValueError(f"DualKV CUDA backend: q_rows must be [{q.shape[0]}] on {q.device}, "
                             f"got {tuple(q_rows.shape)} on {q_rows.device}")
        chunks = cached_query_chunks(segments, q_rows)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # (local queries: on the ws dQ kernel only)
    if (not deterministic and bi == "ws" and fast_bwd_separate_dq(segments, q.shape[-1])
            and not (local and _local_dq_problem())):
        deterministic = True  # the faster backward on this layout (fast_bwd_separate_dq)
    # phase-aligned walks start where other CTAs are (order varies); a deterministic split stores
    # each part's dK/dV in a slot of its own and sums them in part order
    fast_ws_bwd = bi == "ws" and not deterministic
    split = ws_split(q, k, per_part=bool(deterministic)) if bi == "ws" else None
    # prompt tails merged into their responses' key tiles: parts summed like a split's (so not with
    # MEGATRON_DUALKV_WS_SPLIT=0, every key tile one CTA that stores its dK/dV alone)
    work = work_tensors(segments, q.device, chunks, split, fast_ws_bwd and ws_phase(), ws_long_band_by_segment(),
                        split is not None and ws_tail_merge())
    fwd_rows, bwd_rows, kv, ranges, bwd_kernel, slots = _lists(work, fi, bi)
    if bwd_kernel == "ws":
        group = q.shape[1] // k.shape[1]
        head_parts, long_items = ws_head_parts(work, group, split is not None)
        rest_parts = ws_rest_parts(work, group)
        if rest_parts > 1:  # the kernel then counts the long band's CTAs from long_items
            long_items = work.ws_long_items
        slots = (*slots, head_parts, long_items, ws_dq_beside(work, head_parts), rest_parts)
    d = q.shape[-1]
    fwd_tiling = (ws_fwd_tile(work, d), ws_fwd_narrow_tail(), ws_fwd_persistent(work, d)) if fi == "ws" else (128, False, False)
    return _DualKVFunction.apply(q, k, v, fwd_rows, bwd_rows, kv, ranges, scale, bool(deterministic), fi, bwd_kernel,
                                 slots, fwd_tiling, ops_namespace())


def attention(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: Optional[float] = None,
              deterministic: bool = False, fwd_impl: Optional[str] = None,
              bwd_impl: Optional[str] = None, q_rows: Optional[Tensor] = None) -> Tensor:
    """out [Tq, Hq, D]; differentiable."""
    return forward(q, k, v, segments, softmax_scale, deterministic, fwd_impl, bwd_impl, q_rows)[0]
