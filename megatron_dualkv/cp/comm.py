"""The two collectives of DualKV context parallelism, as autograd functions.

- `gather_rows`: every rank's local rows [L, ...] -> all ranks' rows in packed (global) order
  [cp*L, ...]; backward reduce-scatters the gradient back (dK/dV of a rank's rows is the sum of
  what every rank's queries contributed). Used for K and V together (one collective, GQA keeps it
  small: 2 * Hkv * D values per row).
- `gather_edges`: every rank's loss-edge values [E_r] -> all E edges in layout order, identical
  on every rank (like the vocab-parallel logprobs on every TP rank); backward keeps this rank's
  edges' gradient: every rank computes the same loss from the same [E] values, so the upstream
  gradient is identical on every rank and needs no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .partition import CPShard


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_rows(x: Tensor, shard: CPShard, group) -> Tensor:
    """x [L, ...] (this rank's rows) -> [cp*L, ...] in global row order; differentiable."""
    if x.shape[0] != shard.num_local:
        raise ValueError(f"expected this rank's {shard.num_local} rows, got {x.shape[0]}")
    if shard.cp_size == 1:
        return x
    gathered = _AllGatherRows.apply(x, group)  # rank-major
    return gathered.index_select(0, shard.gather_order().to(x.device))


class _GatherEdges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, shard: CPShard, group) -> Tensor:
        ctx.edges = shard.edges.to(x.device)
        counts = [int(e.numel()) for e in shard.all_edges]
        width = max(counts)
        buf = x.new_zeros((width,) + tuple(x.shape[1:]))
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in counts]
        dist.all_gather(parts, buf, group=group)
        out = x.new_empty((shard.layout.num_edges,) + tuple(x.shape[1:]))
        for part, n, edges in zip(parts, counts, shard.all_edges):
            out[edges.to(x.device)] = part[:n]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(0, ctx.edges), None, None


def gather_edges(x: Tensor, shard: CPShard, group) -> Tensor:
    """x [E_local] (values of this rank's edges) -> [E] in layout edge order; differentiable."""
    if x.shape[0] != shard.edges.numel():
        raise ValueError(f"expected values for this rank's {shard.edges.numel()} loss edges, got {x.shape[0]}")
    if shard.cp_size == 1:
        return x
    return _GatherEdges.apply(x, shard, group)
