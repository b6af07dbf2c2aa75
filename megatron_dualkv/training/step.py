"""Megatron forward_step / loss_func for the GRPO policy update, DualKV or replicated.

    forward_step = PolicyForwardStep(PolicyLossConfig(...), dualkv=True, log=step_log)
    # Megatron: output, loss_func = forward_step(data_iterator, model)
    #           loss_sum, num_tokens, metrics = loss_func(output)

The data iterator yields `data.StepItem`s. DualKV runs the packed micro-batch through
DualKVGPTModel (logprobs at the loss edges); `dualkv=False` runs the same responses as the
replicated batch through the stock GPTModel (`--no-dualkv`, the A/B baseline). Both then apply
the same `loss.policy_loss`.

Normalisation (Megatron's per-token-loss convention, `calculate_per_token_loss=True`): loss_func
returns this micro-batch's share of the SUM of the loss and its count (valid loss tokens for
"token" aggregation, responses for "sequence"); Megatron sums the counts over micro-batches and
data-parallel ranks and divides every gradient by that total in finalize_model_grads. The total
is exactly the global normaliser of `policy_loss`, so the gradient is that of the token-mean (or
response-mean) over the whole step, independent of how the step is split into micro-batches.

Context parallelism (the model's pg_collection.cp of size c > 1): every CP rank runs the same
micro-batch, the DualKV model returns the logprobs of ALL its loss edges on every CP rank
(gathered from the ranks holding their source rows: a group's last prompt row may live on
another rank than its responses), so loss_func computes the full micro-batch's loss on each CP
rank, and backward keeps each rank's own edges' share. Megatron sums the returned counts over
DP x CP (finalize_model_grads), so only CP rank 0 reports the count (`cp_token_count`); the
metric pairs are full on every CP rank (their ratios are what is logged, unchanged by the sum).

Metrics are Megatron's reporting convention: each value a [sum, count] pair that Megatron (and
`StepLog`) sums over micro-batches and DP ranks before dividing: loss, pg_loss, kl (k3, 0 when
the rollouts carry no reference logprobs), clip_fraction, ratio (mean importance ratio) and
dedup_ratio (replicated tokens / packed tokens).

When the rollouts carry no old-policy logprobs the update is on-policy (ratio 1), unless an
`OldLogprobCache` is given: the logprobs of a rollout batch's first pass are recorded and used
as the old policy by its later passes (PPO-style epochs, --updates-per-batch). When they carry no
reference logprobs, a `ReferencePolicy` (a frozen copy of the initial model) can supply them.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from ..loss import PolicyLossConfig, count_valid, policy_loss
from .data import StepItem

METRIC_KEYS = ("loss", "pg_loss", "kl", "clip_fraction", "ratio", "dedup_ratio")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's wrappers (DDP, Float16Module): our forward needs its own
    keyword arguments, and the wrappers add nothing on a single pipeline stage (our inputs are ids)."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def policy_logprobs(model: torch.nn.Module, layout, *, dualkv: bool, temperature: float = 1.0) -> Tensor:
    """[E] logprobs at the layout's loss edges: DualKV on the packed micro-batch, or the stock
    model on the replicated batch."""
    if dualkv:
        return model(layout=layout, temperature=temperature).logprobs
    from ..megatron.replicated import replicated_logprobs

    return replicated_logprobs(model, layout, temperature=temperature).logprobs


class ReferencePolicy:
    """A frozen model (e.g. a copy of the initial policy) giving reference logprobs for the KL."""

    def __init__(self, model: torch.nn.Module, *, dualkv: bool = True, temperature: float = 1.0):
        self.model = model
        self.dualkv = dualkv
        self.temperature = temperature
        for p in model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, layout) -> Tensor:
        return policy_logprobs(self.model, layout, dualkv=self.dualkv, temperature=self.temperature).detach()


def frozen_copy(model: torch.nn.Module, build: Callable[[], torch.nn.Module], *, dualkv: bool,
                temperature: float = 1.0) -> ReferencePolicy:
    """A ReferencePolicy holding a copy of `model`'s current weights in a model made by `build`
    (same class, parallel groups, device and dtype)."""
    p = next(model.parameters())
    ref = build().to(device=p.device, dtype=p.dtype)
    ref.load_state_dict(model.state_dict())
    ref.eval()
    return ReferencePolicy(ref, dualkv=dualkv, temperature=temperature)


class OldLogprobCache:
    """Old-policy logprobs recorded at a rollout batch's first pass, keyed by (batch, slot)."""

    def __init__(self):
        self._store: dict[tuple[int, int], Tensor] = {}

    def old_logprobs(self, item: StepItem, logprobs: Tensor) -> Tensor:
        key = (item.batch, item.index)
        if item.update == 0 or key not in self._store:
            if item.update != 0:
                raise KeyError(f"no recorded old logprobs for rollout batch {item.batch}, slot {item.index} "
                               f"(resumed in the middle of a batch without its cache?)")
            # keep only the current batch: older ones are never read again
            self._store = {k: v for k, v in self._store.items() if k[0] == item.batch}
            self._store[key] = logprobs.detach().to("cpu", copy=True)
        return self._store[key].to(logprobs.device)

    def state_dict(self) -> dict:
        return dict(self._store)

    def load_state_dict(self, state: dict) -> None:
        self._store = dict(state)


class PolicyForwardStep:
    """forward_step(data_iterator, model) -> (output, loss_func) for Megatron's schedules."""

    def __init__(self, loss_config: PolicyLossConfig, *, dualkv: bool = True, temperature: float = 1.0,
                 log: Optional["StepLog"] = None, reference: Optional[ReferencePolicy] = None,
                 reference_factory: Optional[Callable[[torch.nn.Module], ReferencePolicy]] = None,
                 old_logprobs: Optional[OldLogprobCache] = None):
        """reference_factory: builds the reference policy from the (unwrapped) model at the first
        micro-batch, i.e. from the weights the run starts with (pretrain() builds the model itself)."""
        self.loss_config = loss_config
        self.dualkv = dualkv
        self.temperature = temperature
        self.log = log
        self.reference = reference
        self.reference_factory = reference_factory
        self.old_cache = old_logprobs

    def __call__(self, data_iterator, model):
        item: StepItem = next(data_iterator)
        if not isinstance(item, StepItem):
            raise TypeError(f"the data iterator must yield StepItem (training.data), got {type(item).__name__}")
        core = unwrap_model(model)
        device = _device_of(core)
        if self.reference is None and self.reference_factory is not None:
            self.reference = self.reference_factory(core)
        if self.log is not None:
            self.log.begin_micro_batch(item)
        if item.micro_batch is None:
            # An empty slot: a zero loss with a (trivial) graph so that the schedule's backward runs.
            zero = torch.zeros((), dtype=torch.float32, device=device, requires_grad=True)
            return zero, partial(self.empty_loss_func, item)
        mb = item.micro_batch.to(device)
        cp_group = getattr(getattr(core, "pg_collection", None), "cp", None)
        logprobs = policy_logprobs(core, mb.layout, dualkv=self.dualkv, temperature=self.temperature)
        batch = mb.policy_batch()
        if batch.old_logprobs is None and self.old_cache is not None:
            batch = dataclasses.replace(batch, old_logprobs=self.old_cache.old_logprobs(item, logprobs))
        if batch.ref_logprobs is None and self.reference is not None:
            batch = dataclasses.replace(batch, ref_logprobs=self.reference(mb.layout))
        return logprobs, partial(self.loss_func, mb, batch, cp_group=cp_group)

    # -- loss functions ---------------------------------------------------------------------
    def loss_func(self, mb, batch, logprobs: Tensor, cp_group=None):
        """(loss_sum, count, metrics) of one packed micro-batch (count on CP rank 0 only)."""
        cfg = self.loss_config
        # Normalise by this micro-batch's own count (at least 1) and multiply back: the product is
        # the micro-batch's share of the step's sum; Megatron divides by the global count.
        local = count_valid(batch, mb.layout)
        unit = "num_tokens" if cfg.aggregation == "token" else "num_responses"
        count = float(local[unit])
        if abs(count - round(count)) > 1e-6:
            raise ValueError(f"micro-batch {mb.index} of rank {mb.dp_rank}: {unit} is {count}, not an integer "
                             f"(fractional loss-mask weights): Megatron's per-token loss counts whole tokens")
        norm = max(count, 1.0)
        kwargs = {"global_num_tokens": norm} if cfg.aggregation == "token" else {"global_num_responses": norm}
        loss, m = policy_loss(logprobs, batch, mb.layout, cfg, **kwargs)
        loss_sum = loss * norm
        n_tok = m["num_tokens"]
        f32 = lambda x: torch.as_tensor(x, dtype=torch.float32, device=logprobs.device)
        pair = lambda s, c: torch.stack([f32(s), f32(c)])
        metrics = {
            "loss": pair(loss_sum.detach(), count),
            "pg_loss": pair(m["pg_loss"] * norm, count),
            "kl": pair(m.get("kl_sum", 0.0), n_tok),
            "clip_fraction": pair(m["clip_low_count"] + m["clip_high_count"], n_tok),
            "ratio": pair(m["ratio_sum"], n_tok),
            "dedup_ratio": pair(mb.stats.replicated_tokens, mb.stats.tokens),
        }
        if self.log is not None:
            self.log.add(metrics)
        num = torch.tensor(int(round(count)), dtype=torch.int, device=logprobs.device)
        if cp_group is not None and cp_group.size() > 1:
            from ..megatron.model import cp_token_count

            num = cp_token_count(num, cp_group)  # the micro-batch counted once per CP group
        return loss_sum, num, metrics

    def empty_loss_func(self, item: StepItem, zero: Tensor):
        metrics = {k: torch.zeros(2, dtype=torch.float32, device=zero.device) for k in METRIC_KEYS}
        return zero * 1.0, torch.tensor(0, dtype=torch.int, device=zero.device), metrics
