"""All-to-all (Ulysses) context parallelism: heads split over CP ranks instead of queries.

Each rank holds L rows with all (TP-local) heads. An all-to-all turns that into ALL cp * L rows
with 1/cp of the heads: the rank then runs the ordinary DualKV attention of the whole micro-batch
(no local queries: every backend, the fused CUDA kernel included, takes it as it is) for its
heads, and a second all-to-all returns the output rows to their owners. Work is balanced by
construction (every rank does the whole mask for an equal share of heads). Needs the query heads
and the key/value heads of a TP rank to be multiples of cp.

Traffic per rank and layer (forward; backward the same): (cp-1)/cp * L * (2 Hq + 2 Hkv) * D values
(q, k, v out and the output back) against (cp-1) * L * 2 Hkv * D for the K/V all-gather: the
all-gather moves less at small cp with GQA, the all-to-all less at large cp.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import dualkv_attention
from .partition import CPShard


class _AllToAll(torch.autograd.Function):
    """x [cp, ...] -> y [cp, ...] with y[s] on rank r = x[r] on rank s; backward is the same."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _rows_to_heads(x: Tensor, shard: CPShard, group) -> Tensor:
    """[L, cp, H, D] (this rank's rows; head part p goes to rank p) -> [cp*L, H, D] (all rows in
    packed order, this rank's head part)."""
    n, cp, h, d = x.shape
    got = _AllToAll.apply(x.transpose(0, 1), group)  # [cp (source rank), L, H, D]
    return got.reshape(cp * n, h, d).index_select(0, shard.gather_order().to(x.device))


def _heads_to_rows(y: Tensor, shard: CPShard, group) -> Tensor:
    """[cp*L, H/cp, D] (all rows, this rank's heads) -> [L, H, D] (this rank's rows, all heads)."""
    cp, n = shard.cp_size, shard.num_local
    rank_major = y.index_select(0, shard.all_rows.reshape(-1).to(y.device)).reshape(cp, n, y.shape[1], y.shape[2])
    got = _AllToAll.apply(rank_major, group)  # [cp (head part), L, H/cp, D]
    return got.transpose(0, 1).reshape(n, cp * y.shape[1], y.shape[2])


def ulysses_problem(num_q_heads: int, num_kv_heads: int, cp: int) -> str:
    """Why the all-to-all variant cannot split these heads over cp ranks ('' when it can)."""
    if num_q_heads % cp or num_kv_heads % cp:
        return (f"all-to-all context parallelism splits heads over the {cp} CP ranks: query heads ({num_q_heads}) and "
                f"key/value heads ({num_kv_heads}) per tensor-parallel rank must both be multiples of {cp}")
    return ""


def ulysses_dualkv_attention(q: Tensor, k: Tensor, v: Tensor, shard: CPShard, group,
                             softmax_scale: Optional[float] = None, backend: Optional[str] = None,
                             deterministic: bool = False) -> Tensor:
    """q [L, Hq, D], k and v [L, Hkv, D]: this rank's rows -> out [L, Hq, D]; differentiable.
    deterministic: dualkv_attention's (all-to-all CP keeps every query row: the cuda kernel takes it)."""
    if shard.cp_size == 1:
        return dualkv_attention(q, k, v, shard.layout, softmax_scale, backend, deterministic=deterministic)
    problem = ulysses_problem(q.shape[1], k.shape[1], shard.cp_size)
    if problem:
        raise ValueError(problem)
    cp, n, d = shard.cp_size, q.shape[0], q.shape[2]
    hq, hkv = q.shape[1] // cp, k.shape[1] // cp
    # head part p of q, k and v travels to rank p in one all-to-all; query head i of a part uses
    # kv head i // (hq / hkv) of the same part, as in the unsplit GQA layout
    parts = torch.cat([q.reshape(n, cp, hq, d), k.reshape(n, cp, hkv, d), v.reshape(n, cp, hkv, d)], dim=2)
    qkv = _rows_to_heads(parts, shard, group)  # [cp*L, hq + 2 hkv, D]
    q_h, k_h, v_h = (x.contiguous() for x in (qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
    out = dualkv_attention(q_h, k_h, v_h, shard.layout, softmax_scale, backend, deterministic=deterministic)
    return _heads_to_rows(out, shard, group)
