"""DualKV attention of one context-parallel rank: local queries against all keys.

K and V of every rank are all-gathered (one collective for both) into packed order; the rank's
queries attend them through the attention entry point with their global rows (`q_rows`), so the
DualKV mask is exactly the one of the whole micro-batch. Backward: dQ stays local, dK/dV are
reduce-scattered back to the ranks that own the rows.

Communication per layer and rank: (cp - 1) * L * 2 * Hkv * D values in, the same out in backward,
against O(L * T * Hq * D) attention work: for long prompts the all-gather is a few percent of
the layer's attention time (docs/CONTEXT_PARALLEL.md), so it is issued as one blocking
collective rather than split into a ring that overlaps it with partial attention.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops import dualkv_attention
from .comm import gather_rows
from .partition import CPShard


def cp_dualkv_attention(q: Tensor, k: Tensor, v: Tensor, shard: CPShard, group,
                        softmax_scale: Optional[float] = None, backend: Optional[str] = None,
                        deterministic: bool = False) -> Tensor:
    """q [L, Hq, D], k and v [L, Hkv, D]: this rank's rows -> out [L, Hq, D]; differentiable.
    deterministic: dualkv_attention's (with CP > 1 the cuda kernel's dQ is then bitwise the CP = 1
    dQ of the rank's rows)."""
    if q.shape[0] != shard.num_local or k.shape[0] != shard.num_local or v.shape[0] != shard.num_local:
        raise ValueError(f"context-parallel rank {shard.cp_rank} holds {shard.num_local} rows; "
                         f"q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if shard.cp_size == 1:
        return dualkv_attention(q, k, v, shard.layout, softmax_scale, backend, deterministic=deterministic)
    hkv = k.shape[1]
    kv = gather_rows(torch.cat([k, v], dim=1), shard, group)
    # dense K and V (the CUDA kernels refuse strided views; GQA keeps the copies small)
    k_all, v_all = kv[:, :hkv].contiguous(), kv[:, hkv:].contiguous()
    return dualkv_attention(q, k_all, v_all, shard.layout, softmax_scale, backend, q_rows=shard.rows,
                            deterministic=deterministic)
