"""Context-parallel partition of a packed DualKV micro-batch.

Every CP rank holds the same number L of packed rows (Megatron needs equal shapes on every rank),
as `chunks_per_rank` contiguous chunks of `chunk` rows each. The layout is padded at its end with
one CP padding segment (a root segment: it attends only itself) to `cp * L` rows, cut into
`cp * chunks_per_rank` chunks of equal length, and the chunks are dealt to ranks so that the
ATTENTION work is balanced: with equal row counts every per-token op (norms, projections, MLP/MoE)
already costs the same on every rank, and attention is what differs. A query row costs as many
(query, key) pairs as it attends: a prompt token at position i costs i + 1 keys, a response token
at offset j costs P + j + 1 (its whole prompt and itself causally).

Dealing: chunks sorted by cost (heaviest first) are dealt in rounds of `cp`; within a round the
heaviest chunk goes to the rank with the least work so far (ranks ascending by load get chunks
descending by cost). Every rank ends with exactly `chunks_per_rank` chunks. Bound: the spread of
work across ranks (max - min) is at most the largest spread inside one round
(`CPPartition.spread_bound`). Proof: before a round let the loads be ascending l_1 <= ... <= l_cp
with spread D, and the round's chunks descending c_1 >= ... >= c_cp; for i > j,
(l_i + c_i) - (l_j + c_j) <= l_i - l_j <= D, and for i < j it is <= c_i - c_j <= the round's
spread; so a round never makes the spread larger than max(D, its own spread).

A rank's rows are its chunks in ascending packed order (`CPShard.rows`, global row indices).
Loss edges are computed on the rank that holds their SOURCE row: the last prompt row, which
predicts the first token of every response of its group, may live on another rank than those
responses; its edges are computed where it lives.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..layout import PackedLayout, SegmentTable


def key_counts(segments: SegmentTable) -> Tensor:
    """int64 [T]: keys each query row attends (its ancestors' tokens + itself causally)."""
    seg = segments.token_segment_ids()
    start = segments.start.long()
    above = torch.tensor(
        [sum(segments.host_length[a] for a in segments.ancestors(s)) for s in range(segments.num_segments)],
        dtype=torch.int64, device=segments.device,
    )
    tok = torch.arange(segments.num_tokens, device=segments.device)
    return tok - start[seg] + 1 + above[seg]


def pad_layout(layout: PackedLayout, num_tokens: int, pad_token_id: int = 0) -> PackedLayout:
    """The layout extended to `num_tokens` rows by one padding root segment (no loss edges,
    weight 0, marked as padding). Unchanged when it already holds `num_tokens` rows."""
    t = layout.num_tokens
    if num_tokens == t:
        return layout
    if num_tokens < t:
        raise ValueError(f"cannot pad a layout of {t} tokens to {num_tokens}")
    seg = layout.segments
    n = num_tokens - t
    dev = layout.device
    segments = SegmentTable.from_host(seg.host_start + (t,), seg.host_length + (n,), seg.host_parent + (-1,), device=dev)
    cat = lambda a, b: torch.cat([a, b.to(a.device, a.dtype)])
    return dataclasses.replace(
        layout,
        segments=segments,
        input_ids=cat(layout.input_ids, torch.full((n,), pad_token_id)),
        position_ids=cat(layout.position_ids, torch.arange(n)),
        token_weight=cat(layout.token_weight, torch.zeros(n)),
        padding_mask=cat(layout.padding_mask, torch.ones(n, dtype=torch.bool)),
        _cache={},
    )


@dataclass(frozen=True)
class CPShard:
    """What one CP rank holds of a micro-batch (see `CPPartition.shard`).

    `layout` is the CP-padded global layout (every rank has the same); `rows` are this rank's
    packed rows (global indices, ascending), `edges` the loss edges it computes (global edge
    indices, ascending) and `edge_source` their source rows as indices into `rows`.
    """

    layout: PackedLayout
    cp_rank: int
    cp_size: int
    rows: Tensor  # int64 [L]
    edges: Tensor  # int64 [E_local]
    edge_source: Tensor  # int64 [E_local], index into rows
    all_rows: Tensor  # int64 [cp, L]: rows of every rank (gather order of K/V)
    all_edges: tuple[Tensor, ...]  # edges of every rank
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_local(self) -> int:
        return int(self.rows.numel())

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def input_ids(self) -> Tensor:
        return self.cached("input_ids", lambda: self.layout.input_ids[self.rows])

    @property
    def position_ids(self) -> Tensor:
        return self.cached("position_ids", lambda: self.layout.position_ids[self.rows])

    @property
    def token_weight(self) -> Tensor:
        return self.cached("token_weight", lambda: self.layout.token_weight[self.rows])

    @property
    def padding_mask(self) -> Tensor:
        return self.cached("padding_mask", lambda: self.layout.padding_mask[self.rows])

    @property
    def target_ids(self) -> Tensor:
        return self.cached("target_ids", lambda: self.layout.target_ids[self.edges])

    def gather_order(self) -> Tensor:
        """int64 [cp*L]: for each global row g, its index in the rank-major all-gather of the
        ranks' rows (all_rows flattened)."""
        def build():
            flat = self.all_rows.reshape(-1)
            inv = torch.empty_like(flat)
            inv[flat] = torch.arange(flat.numel(), device=flat.device)
            return inv
        return self.cached("gather_order", build)

    def to(self, device) -> "CPShard":
        device = torch.device(device)
        if device == self.device:
            return self
        return dataclasses.replace(
            self, layout=self.layout.to(device), rows=self.rows.to(device), edges=self.edges.to(device),
            edge_source=self.edge_source.to(device), all_rows=self.all_rows.to(device),
            all_edges=tuple(e.to(device) for e in self.all_edges), _cache={},
        )

    def cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


@dataclass(frozen=True)
class CPPartition:
    """The partition of one micro-batch over `cp_size` ranks (identical on every rank)."""

    layout: PackedLayout  # CP-padded: cp_size * chunks_per_rank * chunk rows
    cp_size: int
    chunk: int
    chunks_per_rank: int
    rank_chunks: tuple[tuple[int, ...], ...]  # chunk indices of each rank, ascending
    chunk_cost: tuple[int, ...]  # attended (query, key) pairs of each chunk
    spread_bound: int  # max - min of rank_cost is at most this (see module docstring)

    @property
    def num_local(self) -> int:
        return self.chunk * self.chunks_per_rank

    @property
    def rank_cost(self) -> tuple[int, ...]:
        return tuple(sum(self.chunk_cost[c] for c in cs) for cs in self.rank_chunks)

    @property
    def imbalance(self) -> float:
        """max rank cost / mean rank cost (1.0 is perfect)."""
        costs = self.rank_cost
        return max(costs) * len(costs) / max(1, sum(costs))

    def rows_of(self, rank: int) -> Tensor:
        dev = self.layout.device
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk, device=dev)
                          for c in self.rank_chunks[rank]])

    def shard(self, cp_rank: int) -> CPShard:
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} outside [0, {self.cp_size})")
        all_rows = torch.stack([self.rows_of(r) for r in range(self.cp_size)])
        owner = torch.empty(self.layout.num_tokens, dtype=torch.int64, device=all_rows.device)
        local_index = torch.empty_like(owner)
        for r in range(self.cp_size):
            owner[all_rows[r]] = r
            local_index[all_rows[r]] = torch.arange(self.num_local, device=all_rows.device)
        src_owner = owner[self.layout.source_rows]
        all_edges = tuple(torch.nonzero(src_owner == r).flatten() for r in range(self.cp_size))
        edges = all_edges[cp_rank]
        return CPShard(
            layout=self.layout, cp_rank=cp_rank, cp_size=self.cp_size, rows=all_rows[cp_rank],
            edges=edges, edge_source=local_index[self.layout.source_rows[edges]], all_rows=all_rows,
            all_edges=all_edges,
        )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cp_partition(layout: PackedLayout, cp_size: int, chunks_per_rank: int = 8, chunk_multiple: int = 128) -> CPPartition:
    """Split a micro-batch over `cp_size` ranks, balancing attention work (see module docstring).

    chunks_per_rank: contiguous chunks each rank holds at least (more: finer balance, more chunk
    edges); up to twice as many are used when that needs less CP padding (every chunk is rounded
    up to `chunk_multiple`, so some counts divide the micro-batch much better than others).
    chunk_multiple: chunk length is a multiple of this and of 2 (Megatron's THD RoPE splits a
    rank's rows in two halves; FlexAttention works in 128-row blocks; sequence parallelism needs
    a multiple of tp rows: pass lcm(128, tp) or lcm(2, tp) for small tests).
    """
    if cp_size < 1 or chunks_per_rank < 1 or chunk_multiple < 1:
        raise ValueError(f"cp_size ({cp_size}), chunks_per_rank ({chunks_per_rank}) and chunk_multiple "
                         f"({chunk_multiple}) must be >= 1")
    step = math.lcm(chunk_multiple, 2)
    t = layout.num_tokens
    padded_len = lambda k: cp_size * k * _round_up(-(-t // (cp_size * k)), step)
    chunks_per_rank = min(range(chunks_per_rank, 2 * chunks_per_rank + 1), key=lambda k: (padded_len(k), k))
    n_chunks = cp_size * chunks_per_rank
    chunk = padded_len(chunks_per_rank) // n_chunks
    padded = pad_layout(layout, chunk * n_chunks)
    keys = key_counts(padded.segments).cpu()
    costs = keys.reshape(n_chunks, chunk).sum(dim=1).tolist()
    order = sorted(range(n_chunks), key=lambda c: (-costs[c], c))
    load = [0] * cp_size
    assigned: list[list[int]] = [[] for _ in range(cp_size)]
    spread_bound = 0
    for a in range(0, n_chunks, cp_size):
        round_chunks = order[a:a + cp_size]  # descending cost
        ranks = sorted(range(cp_size), key=lambda r: (load[r], r))  # ascending load
        for r, c in zip(ranks, round_chunks):
            assigned[r].append(c)
            load[r] += costs[c]
        spread_bound = max(spread_bound, costs[round_chunks[0]] - costs[round_chunks[-1]])
    return CPPartition(
        layout=padded, cp_size=cp_size, chunk=chunk, chunks_per_rank=chunks_per_rank,
        rank_chunks=tuple(tuple(sorted(cs)) for cs in assigned), chunk_cost=tuple(int(c) for c in costs),
        spread_bound=int(spread_bound),
    )


def cp_shard(layout: PackedLayout, cp_rank: int, cp_size: int, chunks_per_rank: int = 8,
             chunk_multiple: int = 128) -> CPShard:
    """`cp_partition(...).shard(cp_rank)`, cached on the layout (every layer and the loss reuse it)."""
    key = ("cp_shard", cp_rank, cp_size, chunks_per_rank, chunk_multiple)
    return layout.cached(key, lambda: cp_partition(layout, cp_size, chunks_per_rank, chunk_multiple).shard(cp_rank))
