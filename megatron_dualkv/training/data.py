"""Rollout groups -> the stream of packed micro-batches a Megatron training run consumes.

    stream = RolloutStepStream(records, groups_per_step=8, micro_batches_per_step=4,
                               packing=PackingConfig(max_tokens=4096, dp_size=dp), dp_rank=r)
    it = stream.iterate(start_step=args.iteration)      # yields StepItem, micro_batches_per_step per step

A rollout batch is `groups_per_step` groups taken in order from an endless sequence of epochs
(each epoch a seeded shuffle of the records), packed by `packing.plan_packing` over the
data-parallel ranks; each batch is used for `updates_per_batch` consecutive optimizer steps
(PPO-style epochs over one rollout batch; 1 = every step a new batch). Every rank plans the same step (the plan is deterministic) and
materialises only its own micro-batches, so step-wide totals (tokens, pairs, replicated tokens)
are known on every rank without communication.

Megatron runs a fixed number of micro-batches per step (global batch / (micro batch * DP)); the
packer may need fewer. The remaining slots are yielded FIRST as empty items (`micro_batch is None`)
that the forward step turns into a zero loss without model work (first, so that the last
micro-batch, whose backward triggers DDP's overlapped gradient reduction, is always a real one).
Every rank gets the same number of real micro-batches (the packer deals them evenly), so the
collectives inside the model stay matched.
A step that needs more micro-batches than that is an error naming the step and the fix.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ..data.schema import RolloutGroup
from ..flops import group_pairs
from ..packing import MicroBatch, PackingConfig, build_micro_batches, plan_packing


@dataclass(frozen=True)
class StepTotals:
    """Step-wide sums over every data-parallel rank (from the plan, identical on every rank)."""

    groups: int
    responses: int
    packed_tokens: int  # P + sum(R) per (sub-)group: what every per-token op of DualKV processes
    replicated_tokens: int  # sum over responses of P + R: what the replicated batch processes
    loss_edges: int  # response tokens (logits are computed only here)
    attention_pairs: int  # DualKV-mask (query, key) pairs
    replicated_attention_pairs: int
    micro_batches_per_rank: int  # real ones (the rest of the step's slots are empty)

    @property
    def dedup_ratio(self) -> float:
        return self.replicated_tokens / self.packed_tokens


@dataclass(frozen=True)
class StepItem:
    """One micro-batch slot of a step: what the forward step receives from the iterator."""

    step: int  # 0-based training step (Megatron iteration - 1)
    batch: int  # rollout batch the step trains on (step // updates_per_batch)
    update: int  # which update of that batch (0 = its first pass)
    index: int  # slot in the step, 0 .. micro_batches_per_step - 1
    micro_batch: Optional[MicroBatch]  # None: an empty slot (zero loss, no model work)
    totals: StepTotals


class RolloutStepStream:
    """Endless, resumable stream of packed micro-batches for one data-parallel rank."""

    def __init__(self, records: Sequence[RolloutGroup], *, groups_per_step: int, micro_batches_per_step: int,
                 packing: PackingConfig, dp_rank: int, seed: int = 0, updates_per_batch: int = 1,
                 device: torch.device | str = "cpu"):
        self.records = list(records)
        if not self.records:
            raise ValueError("no rollout groups to train on")
        if not 1 <= groups_per_step <= len(self.records):
            raise ValueError(f"groups per step ({groups_per_step}) must lie in [1, {len(self.records)}] "
                             f"(the rollout file holds {len(self.records)} groups; a step cannot repeat a group)")
        if micro_batches_per_step < 1:
            raise ValueError(f"micro-batches per step must be >= 1, got {micro_batches_per_step}")
        if updates_per_batch < 1:
            raise ValueError(f"updates per rollout batch must be >= 1, got {updates_per_batch}")
        if not 0 <= dp_rank < packing.dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {packing.dp_size})")
        self.groups_per_step = groups_per_step
        self.micro_batches_per_step = micro_batches_per_step
        self.packing = packing
        self.dp_rank = dp_rank
        self.seed = seed
        self.updates_per_batch = updates_per_batch
        self.device = device
        self._epoch_orders: dict[int, list[int]] = {}
        self._built = None  # (batch, totals, micro-batches) of the last rollout batch built

    # -- which records make a step --------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._epoch_orders:
            order = list(range(len(self.records)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            # keep this epoch and the one before (a batch may straddle them); steps only advance
            self._epoch_orders = {e: o for e, o in self._epoch_orders.items() if e == epoch - 1}
            self._epoch_orders[epoch] = order
        return self._epoch_orders[epoch]

    def batch_records(self, batch: int) -> list[RolloutGroup]:
        """The groups of rollout batch `batch`: positions [batch*G, (batch+1)*G) of the epoch
        sequence (a batch that straddles two epochs takes the end of one and the start of the
        next, skipping groups it already holds)."""
        n, g = len(self.records), self.groups_per_step
        out, seen = [], set()
        pos = batch * g
        while len(out) < g:
            epoch, i = divmod(pos, n)
            idx = self._epoch_order(epoch)[i]
            if idx not in seen:  # only possible across an epoch boundary
                seen.add(idx)
                out.append(self.records[idx])
            pos += 1
        return out

    # -- packing ---------------------------------------------------------------------------------
    def plan_batch(self, batch: int):
        records = self.batch_records(batch)
        cfg = dataclasses.replace(self.packing, seed=self.packing.seed + batch)
        plan = plan_packing(records, cfg)
        m = plan.num_micro_batches_per_rank
        if m > self.micro_batches_per_step:
            raise ValueError(
                f"rollout batch {batch}: its {len(records)} groups need {m} micro-batches per data-parallel rank under a "
                f"budget of {cfg.max_tokens} tokens, but a step runs at most {self.micro_batches_per_step} "
                f"(--global-batch-size / data-parallel size); raise --global-batch-size, raise "
                f"--max-tokens-per-micro-batch or lower --groups-per-step")
        return records, plan

    @staticmethod
    def totals(records: Sequence[RolloutGroup], plan) -> StepTotals:
        packed = replicated = edges = pairs = repl_pairs = responses = 0
        for rank in plan.ranks:
            for mb in rank:
                for pc in mb:
                    rec = records[pc.record]
                    p = len(rec.prompt)
                    lens = [len(rec.responses[i]) for i in pc.responses]
                    packed += p + sum(lens)
                    replicated += sum(p + r for r in lens)
                    edges += sum(lens)
                    d, r = group_pairs(p, lens)
                    pairs, repl_pairs = pairs + d, repl_pairs + r
                    responses += len(lens)
        return StepTotals(groups=len(records), responses=responses, packed_tokens=packed,
                          replicated_tokens=replicated, loss_edges=edges, attention_pairs=pairs,
                          replicated_attention_pairs=repl_pairs,
                          micro_batches_per_rank=plan.num_micro_batches_per_rank)

    def step_items(self, step: int) -> list[StepItem]:
        """This rank's micro-batch slots of `step` (empty ones first, then the real ones)."""
        batch, update = divmod(step, self.updates_per_batch)
        if self._built is None or self._built[0] != batch:
            records, plan = self.plan_batch(batch)
            self._built = (batch, self.totals(records, plan), build_micro_batches(records, plan, self.dp_rank, self.device))
        _, totals, mbs = self._built
        slots: list[Optional[MicroBatch]] = [None] * (self.micro_batches_per_step - len(mbs)) + list(mbs)
        return [StepItem(step=step, batch=batch, update=update, index=i, micro_batch=mb, totals=totals)
                for i, mb in enumerate(slots)]

    def iterate(self, start_step: int = 0, num_steps: Optional[int] = None) -> Iterator[StepItem]:
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield from self.step_items(step)
            step += 1
