"""The DualKV attention entry point: one call, backend chosen at run time.

Backends, fastest first: `cuda` (fused dual-region kernels, csrc/), `flex` (FlexAttention with a
DualKV block mask, CUDA only), `reference` (exact PyTorch math, any device). `backend=None` picks
the first one that is available for the inputs and says once, in one line, which one and why.
The environment variable MEGATRON_DUALKV_ATTENTION_BACKEND forces one.

Local queries (context parallelism): `q_rows` gives the packed row of every query when q holds
only some rows while k, v hold all of them. Every backend says whether it takes them with
`supports_q_rows(deterministic) -> (ok, reason)` (reference, flex: always; cuda: its ws kernels,
fast-mode backward); a backend that does not is skipped with its reason.

`deterministic=True` (Megatron: `config.deterministic_mode`) asks the cuda kernel for its bitwise
reproducible backward (dQ by a kernel of its own instead of fp32 atomics; on the H100 1.02-1.13x
the fast backward's time on the published shapes, 0.89-1.03x on GRPO shapes: docs/PERF.md,
"Twenty-third session", "Twenty-fifth session"; fast mode itself takes that backward on the GRPO
layouts where it is the faster one, "Twenty-sixth session" §4). flex and reference take no such
mode: they run as they are.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from typing import Optional, Union

import torch
from torch import Tensor

from ..layout import PackedLayout, SegmentTable

logger = logging.getLogger("megatron_dualkv")

BACKENDS = ("cuda", "flex", "reference")
_ENV = "MEGATRON_DUALKV_ATTENTION_BACKEND"
_announced: set = set()


def _backend_module(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown DualKV attention backend {name!r}; choose one of {BACKENDS}")
    mod = {"cuda": "cuda_backend", "flex": "flex_backend", "reference": "reference_backend"}[name]
    try:
        return importlib.import_module(f".{mod}", __package__), ""
    except ImportError as exc:  # a backend module that is not there yet / cannot import
        return None, f"module megatron_dualkv.ops.{mod} cannot be imported ({exc})"


def backend_status(name: str, q: Tensor, local_queries: bool = False, deterministic: bool = False) -> tuple[bool, str]:
    """(available for these inputs, reason when not). local_queries: q holds only some rows
    (q_rows given)."""
    mod, why = _backend_module(name)
    if mod is None:
        return False, why
    if local_queries:
        ok, why = mod.supports_q_rows(deterministic)
        if not ok:
            return False, why
    return mod.is_available(q)


def select_backend(q: Tensor, requested: Optional[str] = None, local_queries: bool = False,
                   deterministic: bool = False) -> tuple[str, str]:
    """(backend name, one-line reason for the choice)."""
    requested = requested or os.environ.get(_ENV) or None
    if requested is not None:
        ok, why = backend_status(requested, q, local_queries, deterministic)
        if not ok:
            raise RuntimeError(f"DualKV attention backend {requested!r} was requested but is unavailable: {why}")
        return requested, "requested"
    skipped = []
    for name in BACKENDS:
        ok, why = backend_status(name, q, local_queries, deterministic)
        if ok:
            reason = "; ".join(f"{n}: {w}" for n, w in skipped) or "fastest available"
            return name, reason
        skipped.append((name, why))
    raise RuntimeError("no DualKV attention backend is available: " + "; ".join(f"{n}: {w}" for n, w in skipped))


def dualkv_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Union[PackedLayout, SegmentTable],
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
    q_rows: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tensor:
    """Attention of packed THD tensors over the layout's two KV regions.

    q [T, Hq, D], k and v [T, Hkv, D]; returns [T, Hq, D]. Differentiable.
    q_rows: int64 [Tq], the packed row of each query when q [Tq, Hq, D] holds only some rows
    (ascending, as a context-parallel rank holds them); returns [Tq, Hq, D].
    deterministic: the cuda kernel's bitwise reproducible backward (module docstring).
    """
    segments = layout.segments if isinstance(layout, PackedLayout) else layout
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q_rows is not None:
        if q_rows.dim() != 1 or q_rows.shape[0] != q.shape[0] or q_rows.dtype != torch.int64:
            raise ValueError(f"q_rows must be int64 [{q.shape[0]}] (the packed row of each query), "
                             f"got {q_rows.dtype} {tuple(q_rows.shape)}")
        if q_rows.device != q.device:
            raise ValueError(f"q_rows is on {q_rows.device} but q is on {q.device}")
    if not (q.shape[0] if q_rows is None else k.shape[0]) == k.shape[0] == v.shape[0] == segments.num_tokens:
        raise ValueError(
            f"q, k, v hold {q.shape[0]}, {k.shape[0]}, {v.shape[0]} tokens but the layout packs {segments.num_tokens}"
        )
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (GQA needs Hq % Hkv == 0)")
    if segments.device != q.device:
        raise ValueError(f"layout is on {segments.device} but q is on {q.device}; move it with layout.to(device)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    local = q_rows is not None
    name, reason = select_backend(q, backend, local_queries=local, deterministic=deterministic)
    key = (name, q.device.type, q.dtype, local, deterministic)
    if key not in _announced:
        _announced.add(key)
        logger.info("DualKV attention backend: %s on %s/%s%s%s (%s)", name, q.device.type, q.dtype,
                    " with local queries" if local else "", ", deterministic" if deterministic else "", reason)
    mod, _ = _backend_module(name)
    extra = {"deterministic": True} if deterministic and name == "cuda" else {}
    if local:
        return mod.attention(q, k, v, segments, scale, q_rows=q_rows, **extra)
    return mod.attention(q, k, v, segments, scale, **extra)
