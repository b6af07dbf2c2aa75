"""Group-normalised advantages of rollout records, from their rewards.

The math is the loss module's (`megatron_dualkv.loss.group_advantages`: baseline "mean" (GRPO) or
"leave_one_out" (RLOO), optional division by the group std + eps), applied to whole records: a
group is normalised over all its responses before the packer may split it into sub-groups, which a
per-micro-batch computation could not do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .schema import RolloutGroup

BASELINES = ("mean", "leave_one_out")


@dataclass(frozen=True)
class AdvantageEstimator:
    """Options of `megatron_dualkv.loss.group_advantages` (same names, same defaults)."""

    baseline: str = "mean"
    normalize_std: bool = True
    unbiased_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if self.baseline not in BASELINES:
            raise ValueError(f"advantage baseline must be one of {BASELINES}, got {self.baseline!r}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


def compute_advantages(records: Sequence[RolloutGroup], estimator: AdvantageEstimator = AdvantageEstimator(),
                       ) -> list[Optional[tuple[float, ...]]]:
    """Per record, the advantages of its rewards (None for a record without rewards), all groups in
    one call (float64)."""
    from ..loss import group_advantages  # the loss module owns the math

    with_rewards = [r for r in records if r.rewards is not None]
    out: list[Optional[tuple[float, ...]]] = [None] * len(records)
    if not with_rewards:
        return out
    group_ids = torch.repeat_interleave(torch.arange(len(with_rewards)),
                                        torch.tensor([r.num_responses for r in with_rewards]))
    rewards = torch.tensor([x for r in with_rewards for x in r.rewards], dtype=torch.float64)
    adv = group_advantages(rewards, group_ids, baseline=estimator.baseline, normalize_std=estimator.normalize_std,
                           unbiased_std=estimator.unbiased_std, eps=estimator.eps).tolist()
    k = 0
    for i, r in enumerate(records):
        if r.rewards is not None:
            out[i] = tuple(adv[k:k + r.num_responses])
            k += r.num_responses
    return out
