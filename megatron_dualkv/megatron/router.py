"""MoE router whose load-balancing losses equal those of the replicated batch.

A DualKV micro-batch holds each prompt token once, the replicated batch N times (once per
response). Megatron's load-balancing losses count tokens (f_i = tokens routed to expert i /
(T * topk), P_i = mean router probability), so they change when prompts are deduplicated.
`DualKVTopKRouter` weights every token by `layout.token_weight` (N for a prompt token of a group
of N responses, 1 for a response token, 0 for padding) so that each loss, its value and its
gradient, equals the one Megatron computes on the replicated micro-batch (every
[prompt | response] its own sequence, right padding masked out):

- 'aux_loss'          weighted expert counts, probability sums and token count;
- 'global_aux_loss'   same, accumulated over micro-batches/DP like Megatron;
- 'seq_aux_loss'      per replicated sequence: each response's sequence = its prompt (and any
                      ancestors) + itself; Megatron's bshd formula (mean valid length over the
                      batch as T) is reproduced from the layout;
- z-loss              weighted mean over the micro-batch's tokens (equal to Megatron's when
                      TP*CP = 1; under sequence parallelism Megatron averages per-rank means,
                      which depends on the sharding, while this is the sharding-free mean);
- expert-bias counts  (moe_router_enable_expert_bias) weighted.
Not covered: sinkhorn and quantile_balancing routing (no aux loss of this kind) and token
dropping (capacity factor) - token dropping depends on the physical token order, so a
capacity factor is refused while weighting is on.

The model (`DualKVGPTModel`) sets the weights of every DualKV router before each forward
(`set_token_weight`); they stay set for activation recomputation in backward. Without weights
(`set_token_weight(None)`) the router is Megatron's TopKRouter over the packed tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter

from ..layout import PackedLayout


class DualKVTopKRouter(TopKRouter):
    """TopKRouter whose aux losses count each token as often as the replicated batch holds it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._layout: Optional[PackedLayout] = None
        self._rows: Optional[Tensor] = None

    # -- what the model sets before each forward -------------------------------------------
    def set_token_weight(self, layout: Optional[PackedLayout], rows: Optional[Tensor] = None) -> None:
        """Weight tokens by `layout.token_weight` from now on (None: no weighting). rows: the
        packed rows this rank holds under context parallelism (default: all of them)."""
        if layout is not None and self.config.moe_expert_capacity_factor is not None:
            raise ValueError(
                "DualKV token weighting cannot reproduce token dropping (moe_expert_capacity_factor): "
                "which tokens are dropped depends on their physical order; use dropless MoE"
            )
        if layout is not None and self.routing_type in ("sinkhorn", "quantile_balancing"):
            raise ValueError(f"DualKV token weighting does not cover routing type {self.routing_type!r}")
        self._layout = layout
        self._rows = rows if layout is not None else None

    def _local_rows(self, num_local: int):
        """This rank's rows of the packed micro-batch (a slice, or global row indices under
        context parallelism; sequence parallelism shards them further over TP)."""
        total = self._layout.num_tokens if self._rows is None else self._rows.numel()
        if num_local == total:
            return slice(0, total) if self._rows is None else self._rows
        tp = self.tp_group.size()
        if num_local * tp != total:
            raise ValueError(
                f"router sees {num_local} tokens but this rank holds {total} rows of the layout (tensor parallel size {tp})"
            )
        r = self.tp_group.rank()
        part = slice(r * num_local, (r + 1) * num_local)
        return part if self._rows is None else self._rows[part]

    def _weight(self, num_local: int, dtype: torch.dtype) -> Tensor:
        return self._layout.token_weight[self._local_rows(num_local)].to(dtype)

    # -- losses ------------------------------------------------------------------------------
    def apply_z_loss(self, logits, padding_mask: Optional[Tensor] = None):
        if self._layout is None or self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        # The weighted mean over ALL tokens of the micro-batch: each TP/CP rank adds its share
        # (sum of its tokens / global count). Megatron instead averages per-rank means, which
        # depends on how the tokens are sharded; both agree when TP*CP = 1.
        coeff = self.config.moe_z_loss_coeff
        tp_cp = self.tp_cp_group.size()
        w = self._weight(logits.shape[0], torch.float32)
        count = w.sum().detach()
        if tp_cp > 1:
            count = count.clone()
            torch.distributed.all_reduce(count, group=self.tp_cp_group)
        z = (torch.logsumexp(logits, dim=-1).float().square() * w).sum() / count.clamp(min=1.0) * coeff
        if self.calculate_per_token_loss:
            logits = MoEAuxLossAutoScaler.apply(logits, z * count)
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z)
        get_moe_metrics_tracker().record(
            "z_loss", z.detach() * tp_cp / coeff, self.layer_number, self._num_layers(), avg_group=self.tp_dp_cp_group
        )
        return logits

    def _num_layers(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def _weighted_counts(self, routing_map: Tensor, scores: Tensor, group) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(weighted local scores, global tokens per expert, local token count, global token count)."""
        w = self._weight(routing_map.shape[0], torch.float32)
        local_tpe = (routing_map.float() * w[:, None]).sum(dim=0)
        global_tpe = reduce_from_tensor_model_parallel_region(local_tpe, group)
        return scores * w[:, None].to(scores.dtype), global_tpe, w.sum(), global_tpe.sum() / self.topk

    def _tp_cp_mean_count(self, local_n: Tensor) -> Tensor:
        """The weighted token count per TP x CP rank, the same on every rank of the group.

        With calculate_per_token_loss, Megatron scales a rank's aux-loss gradient by
        valid_token_count * tp_cp_size, assuming every rank of the group holds the same number
        of tokens (sequence-parallel shards of equal size). Weighted counts differ between the
        shards (prompt tokens weigh N), and the rank-local count would give each shard's partial
        router gradient a different scale; the group mean gives them all the scale of TP=1."""
        size = self.tp_cp_group.size()
        if size == 1:
            return local_n
        total = local_n.detach().clone()
        torch.distributed.all_reduce(total, group=self.tp_cp_group)
        return total / size

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if self._layout is None or coeff == 0:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        scores, global_tpe, local_n, total_n = self._weighted_counts(routing_map, scores_for_aux_loss, self.tp_cp_group)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores, tokens_per_expert=global_tpe, total_num_tokens=total_n, topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion,
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group,
            valid_token_count=self._tp_cp_mean_count(local_n),
        )

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if self._layout is None or coeff == 0:
            return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        scores, global_tpe, local_n, total_n = self._weighted_counts(routing_map, scores_for_aux_loss, self.tp_dp_cp_group)
        self.global_tokens_per_expert += global_tpe
        self.ga_steps += 1
        aux_loss = switch_load_balancing_loss_func(
            probs=scores, tokens_per_expert=self.global_tokens_per_expert / self.ga_steps, total_num_tokens=total_n,
            topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion,
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "global_load_balancing_loss", self.tp_dp_cp_group,
            needs_dp_avg=False, valid_token_count=self._tp_cp_mean_count(local_n),
        )

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if self._layout is None or coeff == 0:
            return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask)
        layout = self._layout
        seg_of_token = layout.cached("router_token_segments", layout.segments.token_segment_ids)
        seg = seg_of_token[self._local_rows(routing_map.shape[0])]
        num_seg = layout.segments.num_segments
        # per-segment sums, then each replicated sequence = a response segment plus its ancestors
        seg_scores = scores_for_aux_loss.new_zeros(num_seg, scores_for_aux_loss.shape[1]).index_add(0, seg, scores_for_aux_loss)
        seg_counts = torch.zeros(num_seg, routing_map.shape[1], device=routing_map.device).index_add(0, seg, routing_map.float())
        seg_counts = reduce_from_tensor_model_parallel_region(seg_counts, self.tp_cp_group)
        seq_matrix = layout.cached("router_sequence_matrix", lambda: _sequence_matrix(layout, scores_for_aux_loss.device))
        seq_scores = seq_matrix.to(seg_scores.dtype) @ seg_scores  # [M, E]
        seq_counts = seq_matrix @ seg_counts  # [M, E]
        num_seq = seq_matrix.shape[0]
        mean_len = layout.replicated_num_tokens() / num_seq  # Megatron's T for bshd with padding masked
        aux_loss = (seq_scores * seq_counts.to(seq_scores.dtype)).sum() * (
            self.config.num_moe_experts * coeff / (self.topk * mean_len * mean_len)
        ) / num_seq
        w = self._weight(routing_map.shape[0], torch.float32)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group,
            valid_token_count=self._tp_cp_mean_count(w.sum()),
        )

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self._layout is None:
            return super()._apply_expert_bias(routing_map, padding_mask=padding_mask)
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                w = self._weight(routing_map.shape[0], self.local_tokens_per_expert.dtype)
                self.local_tokens_per_expert += (routing_map.to(w.dtype) * w[:, None]).sum(dim=0)


def _sequence_matrix(layout: PackedLayout, device) -> Tensor:
    """[M, S] float: row m marks response m's segment and its ancestors (its replicated sequence)."""
    seg = layout.segments
    rows = []
    for resp_segs in layout.group_response_segments:
        for s in resp_segs:
            row = torch.zeros(seg.num_segments)
            for a in [s] + seg.ancestors(s):
                row[a] = 1.0
            rows.append(row)
    return torch.stack(rows).to(device)
