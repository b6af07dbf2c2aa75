"""FlexAttention backend: torch's flex_attention with a DualKV block mask (CUDA only).

Block mask. Built from the `SegmentTable` at BLOCK level, never as a dense T x T token mask (at
T = 90K a dense mask asked for 60 GiB). The mask is a union of disjoint pieces in (query, key)
space: every token sees [start of its segment, itself] and the whole of each ancestor segment.
For each query block and key block we count the allowed pairs exactly from those intervals with
two histograms (O(T + blocks^2) integer work on the device), and classify the block as full
(every pair allowed: no mask_mod call), partial (mask_mod decides per element) or empty
(skipped). The result feeds `BlockMask.from_kv_blocks` and is cached on the SegmentTable, so
the layers of one micro-batch build it once.

Compilation policy (also in docs/PERF.md). `torch.compile(flex_attention)` with static shapes
recompiles for every new packed length and falls back, after 8 of them, to an unfused path that
materialises T x T scores. Here the compiled function is dynamic in the token count, the number of
segments and the block counts (dynamic=True, duck shaping off so that a length never shares a
symbol with a head count), so one compilation serves every micro-batch. The tokens are padded up
to a multiple of the 128-token block (padding is its own root segment: it attends only itself,
so no row is empty; it is sliced off again) and handed over as [blocks, 128, heads, dim], so the
length the kernel sees is 128 * blocks and it keeps its unchecked loads. One compiled function is kept per static configuration
(dtype, head dim, heads, scale, kernel backend, autograd or not), each with its own dynamo cache,
so mixing configurations never eats into another one's recompile limit. A micro-batch of one
block (T <= 128) specialises once more (dynamo's 0/1 rule on the block count).

Kernel backend. FLASH (flash-attn-4's CuTe DSL kernels, `kernel_options={"BACKEND": "FLASH"}`)
when `flash_attn.cute` is importable on a Hopper-or-newer GPU and the inputs are bf16 or fp16
(flash-attn-4 takes no float32), TRITON otherwise; MEGATRON_DUALKV_FLEX_KERNEL=TRITON|FLASH
forces one (FLASH where it cannot run is an error naming why).

Local queries (context parallelism, `q_rows`): q holds some packed rows (int64 global indices),
k and v all of them. The block mask is then built for query blocks of those rows against all key
blocks (same exact block classification, with each query's global row), the mask_mod looks the
global row up, and q is padded to whole blocks by repeating its last row (those outputs are cut
off; their zero output gradient adds nothing to dK, dV).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Callable, Optional

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

from ..layout import SegmentTable

try:  # flex_attention arrived in torch 2.5; the package must import without it
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    _FLEX_MISSING = ""
except ImportError as exc:  # pragma: no cover - depends on the torch build
    BlockMask = flex_attention = None
    _FLEX_MISSING = f"this torch has no FlexAttention ({exc})"

BLOCK = 128  # sparse block size (query and key); the compiled input is shaped in these blocks
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # flash-attn-4's kernels: no float32
_KERNEL_ENV = "MEGATRON_DUALKV_FLEX_KERNEL"


# ---------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def flash_installed() -> bool:
    """flash-attn-4 (CuTe DSL) importable: the FLASH kernel backend of flex_attention needs it."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


def flash_problem(device: torch.device, dtype: torch.dtype) -> str:
    """Why the FLASH kernels cannot run these inputs ("" when they can)."""
    if not flash_installed():
        return "flash-attn-4 (flash_attn.cute) is not installed"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "the FLASH kernels need a Hopper-or-newer GPU (compute capability >= 9.0)"
    if dtype not in FLASH_DTYPES:
        return f"the FLASH kernels take bf16 or fp16, not {dtype}"
    return ""


def default_kernel(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """FLASH where it can run these inputs, else TRITON; $MEGATRON_DUALKV_FLEX_KERNEL forces one."""
    forced = os.environ.get(_KERNEL_ENV)
    if forced:
        if forced not in ("TRITON", "FLASH"):
            raise ValueError(f"{_KERNEL_ENV} must be TRITON or FLASH, got {forced!r}")
        return forced
    return "TRITON" if flash_problem(device, dtype) else "FLASH"


def is_available(q: Tensor) -> tuple[bool, str]:
    if _FLEX_MISSING:
        return False, _FLEX_MISSING
    if not q.is_cuda:
        return False, f"FlexAttention backend needs CUDA tensors, got {q.device.type}"
    if q.dtype not in SUPPORTED_DTYPES:
        return False, f"dtype {q.dtype} is not supported (use one of {SUPPORTED_DTYPES})"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return False, f"head dim {q.shape[-1]} is not supported (use one of {SUPPORTED_HEAD_DIMS})"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return False, "FlexAttention's Triton kernels need compute capability >= 8.0"
    from torch.utils._triton import has_triton

    if not has_triton():
        return False, "Triton is not installed (FlexAttention compiles Triton kernels)"
    return True, ""


def supports_q_rows(deterministic: bool = False) -> tuple[bool, str]:
    """Local queries against all keys (context parallelism): always taken."""
    return True, ""


# ---------------------------------------------------------------------------------------------
# block mask
# ---------------------------------------------------------------------------------------------


def padded_segments(segments: SegmentTable, block: int = BLOCK) -> SegmentTable:
    """The table extended by one padding root segment up to a multiple of `block` tokens."""
    pad = (-segments.num_tokens) % block
    if not pad:
        return segments
    return SegmentTable.from_host(
        segments.host_start + (segments.num_tokens,),
        segments.host_length + (pad,),
        segments.host_parent + (-1,),
        device=segments.device,
    )


def ancestor_levels(segments: SegmentTable) -> list[list[int]]:
    """levels[l][s]: the (l+1)-th ancestor of segment s, or -1 (depth - 1 levels)."""
    levels = []
    current = list(segments.host_parent)
    while any(a >= 0 for a in current):
        levels.append(current)
        current = [segments.host_parent[a] if a >= 0 else -1 for a in current]
    return levels


def _sum_block_prefix(x: Tensor, rows_block: Tensor, n_q: int, n_kv: int, kv_block: int) -> Tensor:
    """[n_q, n_kv]: sum over the query tokens i of each query block of |[0, x_i) & key block|."""
    col, rem = torch.div(x, kv_block, rounding_mode="floor"), x % kv_block
    flat = rows_block * (n_kv + 1) + col
    count = torch.zeros(n_q * (n_kv + 1), dtype=torch.int64, device=x.device)
    part = torch.zeros_like(count)
    count.scatter_add_(0, flat, torch.ones_like(flat))
    part.scatter_add_(0, flat, rem)
    count, part = count.view(n_q, n_kv + 1), part.view(n_q, n_kv + 1)
    # key blocks strictly before x's block are covered fully, x's own block up to x
    beyond = count.flip(1).cumsum(1).flip(1)  # beyond[:, c] = #tokens with block index >= c
    return kv_block * beyond[:, 1:] + part[:, :n_kv]


def block_classes(segments: SegmentTable, q_block: int = BLOCK, kv_block: int = BLOCK,
                  q_rows: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(full, partial): bool [n_q_blocks, n_kv_blocks] of the DualKV mask, exact.

    A block is full when every (query, key) pair inside the sequence is allowed, partial when
    some are, and absent from both when none are. q_rows: the packed rows of the queries when
    they are not all rows in order (local queries).
    """
    t, device = segments.num_tokens, segments.device
    tok = torch.arange(t, device=device) if q_rows is None else q_rows.to(device)
    t_q = tok.shape[0]
    n_q, n_kv = -(-t_q // q_block), -(-t // kv_block)
    seg = segments.token_segment_ids()[tok]
    rows_block = torch.div(torch.arange(t_q, device=device), q_block, rounding_mode="floor")
    start = segments.start.long()
    end = start + segments.length.long()
    # allowed keys of token i: [start(seg i), i] and all of each ancestor segment; disjoint
    allowed = _sum_block_prefix(tok + 1, rows_block, n_q, n_kv, kv_block)
    allowed -= _sum_block_prefix(start[seg], rows_block, n_q, n_kv, kv_block)
    for level in ancestor_levels(segments):
        anc = torch.tensor(level, dtype=torch.long, device=device)[seg]
        has = anc >= 0
        if not bool(has.any()):
            continue
        a = anc.clamp(min=0)
        lo, hi = torch.where(has, start[a], 0), torch.where(has, end[a], 0)
        allowed += _sum_block_prefix(hi, rows_block, n_q, n_kv, kv_block)
        allowed -= _sum_block_prefix(lo, rows_block, n_q, n_kv, kv_block)
    q_count = (t_q - torch.arange(n_q, device=device) * q_block).clamp(max=q_block)
    kv_cols = (t - torch.arange(n_kv, device=device) * kv_block).clamp(max=kv_block)
    area = q_count[:, None] * kv_cols[None, :]
    full = allowed == area
    return full, (allowed > 0) & ~full


def _blocks_first(selected: Tensor) -> tuple[Tensor, Tensor]:
    """(num [1, 1, n_q] int32, indices [1, 1, n_q, n_kv] int32): selected key blocks first, in order."""
    num = selected.sum(-1, dtype=torch.int32)
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None].contiguous(), order[None, None].contiguous()


def _dualkv_allowed(seg: Tensor, levels: tuple, q_row: Tensor, kv_idx: Tensor) -> Tensor:
    """The DualKV rule for packed query row q_row and key kv_idx: same segment and kv <= q, or
    kv's segment an ancestor of q's. Tensor ops only (traced by vmap and torch.compile); the loop
    runs over the tree's static depth."""
    sq, sk = seg[q_row], seg[kv_idx]
    ok = (sq == sk) & (kv_idx <= q_row)
    for anc in levels:
        ok = ok | (anc[sq] == sk)
    return ok


def dualkv_mask_mod(segments: SegmentTable, q_rows: Optional[Tensor] = None) -> Callable:
    """mask_mod(b, h, q_idx, kv_idx) of the DualKV mask; q_rows: local queries, q_idx being
    packed row q_rows[q_idx] (all rows in order otherwise, with no lookup in the kernel).

    Built as a closure of one code object per kind (all rows, local rows) for every micro-batch:
    dynamo guards a closure on its code, so new tables do not recompile; only a different tree
    depth (number of levels) does.
    """
    seg = segments.token_segment_ids().to(torch.int32)
    levels = tuple(torch.tensor(lv, dtype=torch.int32, device=segments.device) for lv in ancestor_levels(segments))
    if q_rows is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return _dualkv_allowed(seg, levels, q_idx, kv_idx)
    else:
        rows = q_rows.to(device=segments.device, dtype=torch.int32)

        def mask_mod(b, h, q_idx, kv_idx):
            return _dualkv_allowed(seg, levels, rows[q_idx], kv_idx)
    return mask_mod


def build_block_mask(segments: SegmentTable, block: int = BLOCK, q_rows: Optional[Tensor] = None):
    """The DualKV BlockMask of a (block-padded or not) segment table, built at block level;
    q_rows: local queries (their packed rows) against all keys."""
    if BlockMask is None:
        raise RuntimeError(_FLEX_MISSING)
    full, partial = block_classes(segments, block, block, q_rows)
    kv_num, kv_idx = _blocks_first(partial)
    full_num, full_idx = _blocks_first(full)
    t = segments.num_tokens
    t_q = t if q_rows is None else q_rows.shape[0]
    mask_mod = dualkv_mask_mod(segments, q_rows)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(t_q, t),
    )


def cached_block_mask(segments: SegmentTable) -> tuple[SegmentTable, "BlockMask"]:
    """(padded table, its block mask), built once per micro-batch and reused by every layer."""
    def build():
        padded = padded_segments(segments, BLOCK)
        return padded, build_block_mask(padded, BLOCK)
    return segments.cached(("flex_block_mask", BLOCK), build)


def _padded_rows(q_rows: Tensor, block: int = BLOCK) -> Tensor:
    """q_rows extended to whole blocks by repeating its last row."""
    pad = (-q_rows.shape[0]) % block
    return torch.cat([q_rows, q_rows[-1:].expand(pad)]) if pad else q_rows


def cached_local_block_mask(segments: SegmentTable, q_rows: Tensor) -> tuple[SegmentTable, Tensor, "BlockMask"]:
    """(padded table, block-padded q rows, block mask) for local queries, built once per
    micro-batch and rank (kept while the same q_rows tensor is passed, as a CP shard does)."""
    key = ("flex_local_block_mask", BLOCK)
    hit = segments._cache.get(key)
    if hit is None or hit[0] is not q_rows:
        padded = padded_segments(segments, BLOCK)
        rows = _padded_rows(q_rows.to(segments.device), BLOCK)
        hit = (q_rows, padded, rows, build_block_mask(padded, BLOCK, rows))
        segments._cache[key] = hit
    return hit[1], hit[2], hit[3]


# ---------------------------------------------------------------------------------------------
# compiled attention
# ---------------------------------------------------------------------------------------------


def _flex_padded(q, k, v, block_mask, scale, enable_gqa, kernel_options):
    """q [n, BLOCK, Hq, D], k/v [n, BLOCK, Hkv, D] (n dynamic) -> out [n * BLOCK, Hq, D]."""
    # The length reaches flex_attention as the product BLOCK * n, so the kernel knows it is a
    # multiple of its block and keeps unchecked loads (a ragged length would make every block
    # bounds-checked). The check pins the block dimension, which dynamic=True leaves symbolic.
    torch._check(q.shape[1] == BLOCK)
    torch._check(k.shape[1] == BLOCK)
    qh, kh, vh = (x.flatten(0, 1).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = flex_attention(qh, kh, vh, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                         kernel_options=kernel_options)
    return out.squeeze(0).transpose(0, 1)


_compiled: dict = {}


def compiled_count() -> int:
    """Number of static configurations compiled so far in this process."""
    return len(_compiled)


def _compiled_for(scale: float, enable_gqa: bool, kernel: str, key: tuple) -> Callable:
    """A compiled entry point for one static configuration.

    Generated from source so that (1) the scale is a literal: with dynamic=True dynamo turns a
    float argument into a 0-d CPU tensor input, which the FLASH kernel cannot take and Triton
    would guard on anyway; (2) each configuration has its own code object, hence its own dynamo
    cache and recompile limit.
    """
    fn = _compiled.get(key)
    if fn is None:
        name = f"_flex_config_{len(_compiled)}"
        src = (f"def {name}(q, k, v, block_mask):\n"
               f"    return _flex_padded(q, k, v, block_mask, {float(scale)!r}, {bool(enable_gqa)!r}, "
               f"{{'BACKEND': {kernel!r}}})\n")
        scope = {"_flex_padded": _flex_padded}
        exec(compile(src, f"<megatron_dualkv flex {key}>", "exec"), scope)
        fn = torch.compile(scope[name], dynamic=True, fullgraph=True)
        _compiled[key] = fn
    return fn


def _blocked(x: Tensor, padded_tokens: int) -> Tensor:
    """x [T, H, D] -> [padded_tokens // BLOCK, BLOCK, H, D], zero-padded at the end."""
    pad = padded_tokens - x.shape[0]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    return x.reshape(padded_tokens // BLOCK, BLOCK, x.shape[1], x.shape[2])


def attention(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: Optional[float] = None,
              kernel: Optional[str] = None, compiled: bool = True, q_rows: Optional[Tensor] = None) -> Tensor:
    """DualKV attention of packed THD tensors: out [T, Hq, D]; differentiable.

    kernel: "TRITON" or "FLASH" (default: `default_kernel`, FLASH where flash-attn-4 can run the inputs).
    compiled=False runs flex_attention eagerly (unfused, dense scores: small tests only, any device).
    q_rows: int64 [Tq], packed rows of the queries when q [Tq, Hq, D] holds only some of them
    (local queries against all T keys); out is then [Tq, Hq, D].
    """
    if flex_attention is None:
        raise RuntimeError(_FLEX_MISSING)
    t, hq, d = q.shape
    hkv = k.shape[1]
    t_kv = segments.num_tokens if q_rows is not None else t
    if t_kv != segments.num_tokens or k.shape[0] != t_kv or v.shape[0] != t_kv:
        raise ValueError(f"q, k, v hold {q.shape[0]}, {k.shape[0]}, {v.shape[0]} tokens; the layout packs {segments.num_tokens}")
    if q_rows is not None and tuple(q_rows.shape) != (t,):
        raise ValueError(f"q_rows must be [{t}] (one packed row per query), got {tuple(q_rows.shape)}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    if q_rows is None:
        padded, block_mask = cached_block_mask(segments)
        tp = tq = padded.num_tokens
    else:
        padded, rows, block_mask = cached_local_block_mask(segments, q_rows)
        tp, tq = padded.num_tokens, rows.shape[0]
    qp, kp, vp = _blocked(q, tq), _blocked(k, tp), _blocked(v, tp)
    gqa = hq != hkv
    if not compiled:
        out = _flex_padded(qp, kp, vp, block_mask, scale, gqa, None)
    else:
        kernel = kernel or default_kernel(q.device, q.dtype)
        if kernel not in ("TRITON", "FLASH"):
            raise ValueError(f"kernel must be 'TRITON' or 'FLASH', got {kernel!r}")
        problem = flash_problem(q.device, q.dtype) if kernel == "FLASH" else ""
        if problem:
            raise ValueError(f"FlexAttention FLASH kernel requested ({_KERNEL_ENV} or kernel=): {problem}")
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        key = (q.device.index, q.dtype, d, hq, hkv, scale, kernel, grad) + (("local",) if q_rows is not None else ())
        # Duck shaping would give equal sizes one symbol (e.g. 32 blocks and 32 heads), and the
        # heads' specialisation would then pin the length: compile without it.
        with fx_config.patch(use_duck_shape=False):
            out = _compiled_for(scale, gqa, kernel, key)(qp, kp, vp, block_mask)
    return out[:t]
