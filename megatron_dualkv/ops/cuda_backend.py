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
- `bwd_ws_sm90` (the default fast-mode backward): warp-specialized dK/dV kernel with atomic dQ
  (csrc/dualkv_bwd_ws_sm90.cu); deterministic=True runs the sm90 backward.
An extension built before the ws ops existed falls back to the sm90 kernels.

Work lists (query tiles per segment; key tiles with the query ranges that attend them) are built
on the host once per layout and cached on the `SegmentTable`; any segment lengths (tails masked).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from ..layout import SegmentTable

TILE = 64
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
        _register_python_side()
    _load_state.update(ok=ok, why=why)
    return ok, why


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


def _input_problem(q: Tensor, k: Optional[Tensor] = None, v: Optional[Tensor] = None) -> str:
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
        if k.dim() != 3 or k.shape != v.shape or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]:
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


def build_work(segments: SegmentTable, row_tile: int = TILE, kv_tile: int = TILE) -> tuple[list, list, list]:
    """Host work lists: row items [q0, q1, self0, par0, par1, cost, 0, 0] (query tiles), kv items
    [k0, k1, seg_end, range_lo, range_hi, tiles_per_head, 0, 0] (key tiles), and kv ranges [q0, q1]
    (merged children of each root). Each list is sorted heaviest first (longest-processing-time
    order), so that long prompt tiles start before short response tiles."""
    if segments.depth > 2:
        raise ValueError(
            f"the CUDA DualKV kernels take segment trees of depth <= 2 (root prompt + child responses); "
            f"this layout has depth {segments.depth}"
        )
    starts, lengths, parents = segments.host_start, segments.host_length, segments.host_parent
    children: dict[int, list[int]] = {}
    for s, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(s)
    # merged contiguous child ranges of each root
    ranges: list[tuple[int, int]] = []
    root_ranges: dict[int, tuple[int, int]] = {}
    for p, kids in children.items():
        lo = len(ranges)
        cur = None
        for s in sorted(kids, key=lambda x: starts[x]):
            a, b = starts[s], starts[s] + lengths[s]
            if cur is not None and cur[1] == a:
                cur = (cur[0], b)
            else:
                if cur is not None:
                    ranges.append(cur)
                cur = (a, b)
        ranges.append(cur)
        root_ranges[p] = (lo, len(ranges))

    rows, kvs = [], []
    for s, (a, n, p) in enumerate(zip(starts, lengths, parents)):
        end = a + n
        if p >= 0:
            par0, par1 = starts[p], starts[p] + lengths[p]
        else:
            par0 = par1 = 0
        npar = _ceil(par1 - par0, TILE)
        for q0 in range(a, end, row_tile):
            q1 = min(q0 + row_tile, end)
            rows.append((npar + _ceil(q1 - a, TILE), q0, q1, a, par0, par1))
        rlo, rhi = root_ranges.get(s, (0, 0))
        child_tiles = sum(_ceil(ranges[r][1] - ranges[r][0], TILE) for r in range(rlo, rhi))
        for k0 in range(a, end, kv_tile):
            k1 = min(k0 + kv_tile, end)
            kvs.append((_ceil(end - k0, TILE) + child_tiles, k0, k1, end, rlo, rhi))
    rows.sort(key=lambda r: -r[0])
    kvs.sort(key=lambda r: -r[0])
    row_work = [[q0, q1, a, par0, par1, c, 0, 0] for (c, q0, q1, a, par0, par1) in rows]
    kv_work = [[k0, k1, end, rlo, rhi, c, 0, 0] for (c, k0, k1, end, rlo, rhi) in kvs]
    kv_ranges = [[a, b] for a, b in ranges] or [[0, 0]]
    return row_work, kv_work, kv_ranges


def work_tensors(segments: SegmentTable, device: torch.device) -> tuple[Tensor, ...]:
    """Device work lists for a layout, built once and cached on the SegmentTable:
    (row items of 64-row query tiles, row items of 128-row query tiles, kv items of 64-row key
    tiles, kv items of 128-row key tiles, kv ranges). Row items count kv tiles per their
    kernel, so one list serves any kv tile size; kv items count 64-row query tiles."""

    def build():
        rw, kw, kr = build_work(segments)
        rw128, kw128, _ = build_work(segments, row_tile=128, kv_tile=128)
        mk = lambda x: torch.tensor(x, dtype=torch.int32, device=device).reshape(-1, len(x[0]))
        return mk(rw), mk(rw128), mk(kw), mk(kw128), mk(kr)

    return segments.cached(("cuda_backend_work", str(device)), build)


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
    if _has_op("fwd_ws_sm90"):  # absent from extensions built before it existed
        torch.library.register_fake("megatron_dualkv::fwd_ws_sm90")(_fwd_fake)

    def _bwd_fake(dout, q, k, v, out, lse, dlse, row_work, kv_work, kv_ranges, scale, deterministic):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    torch.library.register_fake("megatron_dualkv::bwd")(_bwd_fake)
    torch.library.register_fake("megatron_dualkv::bwd_sm90")(_bwd_fake)
    if _has_op("bwd_ws_sm90"):
        torch.library.register_fake("megatron_dualkv::bwd_ws_sm90")(_bwd_fake)


class _DualKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rw, rw128, kw, kw128, kr, scale, deterministic, fwd_sm90, bwd_sm90):
        # fwd_sm90: True (wgmma), False (mma.sync) or "ws" (warp-specialized wgmma)
        if fwd_sm90 == "ws":
            out, lse = torch.ops.megatron_dualkv.fwd_ws_sm90(q, k, v, rw128, scale)
        elif fwd_sm90:
            out, lse = torch.ops.megatron_dualkv.fwd_sm90(q, k, v, rw128, scale)
        else:
            out, lse = torch.ops.megatron_dualkv.fwd(q, k, v, rw, scale)
        if bwd_sm90:
            ctx.save_for_backward(q, k, v, out, lse, rw128, kw128, kr)
        else:
            ctx.save_for_backward(q, k, v, out, lse, rw, kw, kr)
        ctx.scale = scale
        ctx.deterministic = deterministic
        ctx.bwd_sm90 = bwd_sm90
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, row_work, kv_work, kv_ranges = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        # bwd_sm90: True (wgmma), False (mma.sync) or "ws" (warp-specialized, fast mode only)
        if ctx.bwd_sm90 == "ws" and not ctx.deterministic:
            op = torch.ops.megatron_dualkv.bwd_ws_sm90
        elif ctx.bwd_sm90:
            op = torch.ops.megatron_dualkv.bwd_sm90
        else:
            op = torch.ops.megatron_dualkv.bwd
        dq, dk, dv = op(
            dout.contiguous(), q, k, v, out, lse, None, row_work, kv_work, kv_ranges, ctx.scale,
            ctx.deterministic,
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable) -> None:
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"DualKV CUDA backend unavailable: {why}")
    if not q.is_cuda:
        raise ValueError(f"DualKV CUDA backend: q is on {q.device}, not a CUDA device")
    problem = _input_problem(q, k, v)
    if problem:
        raise ValueError(f"DualKV CUDA backend: {problem}")
    if segments.num_tokens != q.shape[0]:
        raise ValueError(f"DualKV CUDA backend: the layout packs {segments.num_tokens} tokens, q holds {q.shape[0]}")
    if segments.depth > 2:
        raise ValueError(
            f"DualKV CUDA backend: segment trees of depth {segments.depth} are not supported (depth <= 2: prompt + responses)"
        )


def forward(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: Optional[float] = None,
            deterministic: bool = False, fwd_impl: Optional[str] = None,
            bwd_impl: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """(out [T, Hq, D], lse [Hq, T] float32). Differentiable in q, k, v through `out`.

    fwd_impl / bwd_impl: "ws" (warp-specialized, default where the extension has it), "sm90"
    (wgmma, synchronous) or "mma" (mma.sync kernels); the ws backward has no deterministic mode, so
    with deterministic=True it runs the sm90 one. $MEGATRON_DUALKV_CUDA_FWD /
    $MEGATRON_DUALKV_CUDA_BWD set the defaults.
    """
    _check(q, k, v, segments)
    fi = _impl(fwd_impl, "MEGATRON_DUALKV_CUDA_FWD", "forward")
    bi = _impl(bwd_impl, "MEGATRON_DUALKV_CUDA_BWD", "backward", BWD_IMPLS, "bwd_ws_sm90")
    for kind, op in ((fi, "fwd_ws_sm90"), (bi, "bwd_ws_sm90")):
        if kind == "ws" and not _has_op(op):
            raise RuntimeError(f"DualKV CUDA backend: impl 'ws' needs op megatron_dualkv::{op}; the loaded extension "
                               "predates it: rebuild (python csrc/build_ext.py or pip install -e .)")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    rw, rw128, kw, kw128, kr = work_tensors(segments, q.device)
    fwd_kind = "ws" if fi == "ws" else fi == "sm90"
    bwd_kind = "ws" if bi == "ws" else bi == "sm90"
    return _DualKVFunction.apply(q, k, v, rw, rw128, kw, kw128, kr, scale, bool(deterministic), fwd_kind,
                                 bwd_kind)


def attention(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: Optional[float] = None,
              deterministic: bool = False, fwd_impl: Optional[str] = None,
              bwd_impl: Optional[str] = None) -> Tensor:
    """out [T, Hq, D]; differentiable."""
    return forward(q, k, v, segments, softmax_scale, deterministic, fwd_impl, bwd_impl)[0]
