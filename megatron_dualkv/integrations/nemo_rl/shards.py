"""Driver side: order a batch's rows so that NeMo-RL's contiguous data-parallel shards hold whole,
balanced groups.

    order = group_aligned_order(batch, dp_size=dp, global_batch_size=gbs, num_generations_per_prompt=N)
    batch.reorder_data(order)     # NeMo-RL's BatchedDataDict; or index every [B, ...] entry
    policy.train(batch, loss_fn)  # each rank's shard: whole groups, similar packed-token work

NeMo-RL's Policy cuts each global batch of `global_batch_size` rows into dp_size equal contiguous
shards. Consecutive copies already keep groups whole when a shard holds a multiple of N rows, but
the packed work (P + sum R per group) can differ a lot between shards. This permutation keeps every
global batch's rows inside it, gives each shard the same number of whole groups, and balances the
packed tokens (longest group first, to the least-loaded shard that still has room). The loss does not
depend on row order (its normalisers are global), so training is unchanged except for the balance;
logprobs computed on the reordered batch come back in its order (invert with `inverse_order`).
Needs groups of equal size (NeMo-RL's num_generations_per_prompt) and a number of groups per global
batch divisible by dp_size; anything else is an error naming the numbers.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from .batch import DEFAULT_GROUP_ID_KEY, NemoRLBatchError, convert_batch


def _chunk(data: Mapping[str, Any], start: int, stop: int, batch_size: int) -> dict[str, Any]:
    return {k: (v[start:stop] if hasattr(v, "__len__") and len(v) == batch_size and not isinstance(v, str) else v)
            for k, v in data.items()}


def group_aligned_order(data: Mapping[str, Any], *, dp_size: int, global_batch_size: Optional[int] = None,
                        num_generations_per_prompt: Optional[int] = None,
                        group_id_key: Optional[str] = DEFAULT_GROUP_ID_KEY) -> list[int]:
    """A permutation of the rows (see the module docstring): new row j is old row order[j]."""
    B = int(data["input_ids"].shape[0])
    gbs = B if global_batch_size is None else int(global_batch_size)
    if dp_size < 1 or gbs < 1 or B % gbs or gbs % dp_size:
        raise NemoRLBatchError(f"{B} rows, global_batch_size {gbs}, dp_size {dp_size}: the batch must be whole global "
                               f"batches and a global batch a multiple of dp_size")
    if group_id_key is not None and group_id_key in data and gbs < B:
        ids = data[group_id_key]
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        where: dict[Any, int] = {}
        for b, g in enumerate(ids):
            if where.setdefault(g, b // gbs) != b // gbs:
                raise NemoRLBatchError(f"{group_id_key}={g!r} has rows in global batches {where[g]} and {b // gbs} "
                                       f"(of {gbs} rows): a group must lie inside one global batch")
    order: list[int] = []
    for start in range(0, B, gbs):
        batch = convert_batch(_chunk(data, start, start + gbs, B), num_generations_per_prompt=num_generations_per_prompt,
                              group_id_key=group_id_key)
        groups = batch.claimed_groups
        sizes = {len(rows) for rows in groups}
        if len(sizes) != 1:
            raise NemoRLBatchError(f"rows {start}..{start + gbs - 1}: groups of different sizes {sorted(sizes)}; equal "
                                   f"shards of whole groups need one group size")
        G = len(groups)
        if G % dp_size:
            raise NemoRLBatchError(f"rows {start}..{start + gbs - 1}: {G} groups cannot be dealt evenly to {dp_size} "
                                   f"data-parallel ranks")
        per_rank = G // dp_size
        work = [batch.packed_tokens(rows) for rows in groups]
        load, shards = [0] * dp_size, [[] for _ in range(dp_size)]
        for g in sorted(range(G), key=lambda g: (-work[g], g)):
            r = min((r for r in range(dp_size) if len(shards[r]) < per_rank), key=lambda r: (load[r], r))
            shards[r].append(g)
            load[r] += work[g]
        for shard in shards:
            for g in sorted(shard):
                order.extend(start + b for b in groups[g])
    return order


def inverse_order(order: Sequence[int]) -> list[int]:
    """The permutation that undoes `order` (results of the reordered batch -> original rows)."""
    inv = [0] * len(order)
    for new, old in enumerate(order):
        inv[old] = new
    return inv
