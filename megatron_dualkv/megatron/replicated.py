"""The replicated baseline: every [prompt | response] as its own sequence through stock Megatron.

    base = build_replicated_model(cfg, pg_collection=pgs)   # stock GPTModel, local spec
    copy_weights(dualkv_model, base)                          # same parameter names
    ref = replicated_logprobs(base, layout)                   # EdgeLogprobs in layout edge order

The micro-batch is rebuilt as M right-padded rows (one per response; a row is the response's
ancestors - its prompt - followed by the response), run in bshd with an explicit causal mask and
a padding mask (so MoE routing statistics skip the padding), through GPTModel's own output layer
for every row, and Megatron's vocab_parallel_cross_entropy gives the logprobs. This is what
DualKV must equal: logprobs, losses and every parameter gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel

from ..layout import PackedLayout
from .logprobs import EdgeLogprobs


@dataclass(frozen=True)
class ReplicatedBatch:
    input_ids: Tensor  # int64 [M, S], right-padded
    position_ids: Tensor  # int64 [M, S]
    padding_mask: Tensor  # bool [M, S], True on padding
    attention_mask: Tensor  # bool [1, 1, S, S], True = masked (Megatron convention)
    edge_row: Tensor  # int64 [E] which sequence
    edge_col: Tensor  # int64 [E] which position predicts the edge's target
    target_ids: Tensor  # int64 [E]


def replicated_batch(layout: PackedLayout, pad_token_id: int = 0, pad_to_multiple: int = 1) -> ReplicatedBatch:
    """The replicated micro-batch of a layout, edges in the layout's order; the row length is
    padded to a multiple of pad_to_multiple (sequence parallelism shards it over TP)."""
    seg = layout.segments
    ids = layout.input_ids.cpu()
    rows, edge_row, edge_col = [], [], []
    for resp_segs in layout.group_response_segments:
        for s in resp_segs:
            chain = list(reversed(seg.ancestors(s))) + [s]
            row = torch.cat([ids[seg.host_start[a]: seg.host_start[a] + seg.host_length[a]] for a in chain])
            prefix = row.numel() - seg.host_length[s]
            m = len(rows)
            rows.append(row)
            edge_row.extend([m] * seg.host_length[s])
            edge_col.extend(range(prefix - 1, row.numel() - 1))
    width = max(r.numel() for r in rows)
    width += (-width) % pad_to_multiple
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    padding = torch.ones(len(rows), width, dtype=torch.bool)
    for m, r in enumerate(rows):
        input_ids[m, : r.numel()] = r
        padding[m, : r.numel()] = False
    dev = layout.device
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)[None, None]
    return ReplicatedBatch(
        input_ids=input_ids.to(dev),
        position_ids=torch.arange(width).expand(len(rows), width).contiguous().to(dev),
        padding_mask=padding.to(dev),
        attention_mask=causal.to(dev),
        edge_row=torch.tensor(edge_row, dtype=torch.int64, device=dev),
        edge_col=torch.tensor(edge_col, dtype=torch.int64, device=dev),
        target_ids=layout.target_ids,
    )


def replicated_logprobs(
    model,
    layout: PackedLayout,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    pad_token_id: int = 0,
    tp_group=None,
) -> EdgeLogprobs:
    """Logprobs (and entropy) of the layout's edges from the stock model on the replicated batch."""
    cfg = model.config
    batch = replicated_batch(layout, pad_token_id, cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1)
    # No padding mask when no row is padded: same result, and it avoids Megatron 0.19's
    # expert-bias update, which cannot broadcast a padding mask against the routing map.
    padding_mask = batch.padding_mask if bool(batch.padding_mask.any()) else None
    logits = model(
        batch.input_ids, batch.position_ids, batch.attention_mask, padding_mask=padding_mask
    )  # [M, S, V/tp] (vocab-parallel unless the model gathers)
    if tp_group is None:
        tp_group = model.pg_collection.tp
    edge_logits = logits[batch.edge_row, batch.edge_col]  # [E, V/tp]
    edge_logits = edge_logits.to(torch.promote_types(edge_logits.dtype, torch.float32)) / temperature
    if edge_logits.shape[-1] == model.vocab_size:  # gathered (or TP=1): plain log-softmax
        full = edge_logits
        logprobs = torch.log_softmax(full, dim=-1).gather(1, batch.target_ids[:, None]).squeeze(1)
    else:
        ce = tensor_parallel.vocab_parallel_cross_entropy(
            edge_logits[:, None, :].clone(), batch.target_ids[:, None], tp_group=tp_group
        )
        logprobs = -ce.squeeze(1)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(edge_logits, group=tp_group) if with_entropy else None
    entropy: Optional[Tensor] = None
    if with_entropy:
        logp = torch.log_softmax(full, dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
    return EdgeLogprobs(logprobs=logprobs, entropy=entropy)


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Load src's parameters and buffers into dst (DualKV <-> stock: the keys are the same)."""
    src_sd, dst_sd = src.state_dict(), dst.state_dict()
    missing = sorted(set(dst_sd) - set(src_sd))
    extra = sorted(set(src_sd) - set(dst_sd))
    if missing or extra:
        raise ValueError(f"state_dict keys differ: missing in source {missing[:8]}, not in destination {extra[:8]}")
    dst.load_state_dict(src_sd, strict=True)
