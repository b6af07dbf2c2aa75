"""train() and get_logprobs() of a Megatron policy worker, deduplicated (no NeMo-RL needed).

    runner = DualKVPolicyRunner(model, DualKVSettings(max_tokens_per_microbatch=8192,
                                                      num_generations_per_prompt=8),
                                temperature=1.0, dp_group=dp_group)
    logprobs = runner.get_logprobs(data)                      # [B, S], NeMo-RL's convention
    out = runner.train(data, ClippedPGAdapter.from_config(loss_cfg), local_batch_size=gbs // dp,
                       zero_grad=..., optimizer_step=...)     # one optimizer step per local batch

`model` is a DualKVGPTModel, possibly wrapped (Megatron DDP, Float16Module): anything whose
forward passes `layout=` / `temperature=` through. `data` is this data-parallel rank's share of the
batch (a mapping of tensors, e.g. a BatchedDataDict): NeMo-RL's Policy splits the batch into
contiguous shards, so groups stay whole on one rank when each shard holds whole groups. Inside
the rank, groups are packed by `plan_micro_batches` (a group stays in one micro-batch when it fits
max_tokens_per_microbatch).

Training goes through Megatron's own schedule (`get_forward_backward_func`), as NeMo-RL's worker
does, so DDP's no_sync / finalize_model_grads and the MoE aux-loss scaling behave the same. Each
micro-batch's loss is its share of the global loss (normalised by NeMo-RL's global_valid_toks /
global_valid_seqs, all-reduced over `dp_group`), multiplied by the number of micro-batches to undo
the schedule's averaging: the gradient is that of NeMo-RL's loss on the replicated batch, with
the same data-parallel reduction the worker's DDP config applies to it.
Supported parallelism: TP (with or without sequence parallelism), EP, DP; refused: CP > 1
(the DualKV core attention has none) and PP > 1 (not wired here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from .batch import DEFAULT_GROUP_ID_KEY, EdgeIndex, NemoRLBatch, convert_batch, plan_micro_batches
from .loss_adapter import ClippedPGAdapter, EdgeBatch, all_reduce_metrics, reduce_metrics


@dataclass(frozen=True)
class DualKVSettings:
    """The `policy.dualkv` section of a NeMo-RL config (docs/NEMO_RL.md)."""

    max_tokens_per_microbatch: int
    max_attention_pairs: Optional[int] = None
    num_generations_per_prompt: Optional[int] = None
    group_id_key: Optional[str] = DEFAULT_GROUP_ID_KEY
    pad_token_id: int = 0
    enabled: bool = True

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "DualKVSettings":
        names = {f.name for f in dataclasses.fields(DualKVSettings)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"policy.dualkv: unknown key(s) {unknown}; known: {sorted(names)}")
        if "max_tokens_per_microbatch" not in d:
            raise ValueError("policy.dualkv.max_tokens_per_microbatch is required (packed tokens per micro-batch)")
        return DualKVSettings(**d)


def unwrap(model: Any) -> Any:
    """The GPTModel under DDP / Float16Module wrappers (they hold it as `.module`)."""
    from megatron.core.models.gpt import GPTModel

    inner = model
    while not isinstance(inner, GPTModel):
        if not hasattr(inner, "module"):
            raise TypeError(f"expected a Megatron GPTModel (or a wrapper holding one as .module), got {type(model).__name__}")
        inner = inner.module
    return inner


def slice_rows(data: Mapping[str, Any], start: int, stop: int, batch_size: int) -> dict[str, Any]:
    """Rows [start, stop) of every per-row entry (first dimension B) of a batch mapping."""
    out = {}
    for k, v in data.items():
        if (isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == batch_size) or (
                isinstance(v, (list, tuple)) and len(v) == batch_size):
            out[k] = v[start:stop]
        else:
            out[k] = v
    return out


def _batch_size(data: Mapping[str, Any]) -> int:
    ids = data["input_ids"]
    return int(ids.shape[0])


class DualKVPolicyRunner:
    """Deduplicated get_logprobs / train over one rank's NeMo-RL batch (module docstring)."""

    def __init__(self, model: Any, settings: DualKVSettings, *, temperature: float = 1.0, dp_group=None):
        self.model = model
        self.settings = settings
        self.temperature = float(temperature)
        self.dp_group = dp_group
        inner = unwrap(model)
        cfg = inner.config
        if getattr(cfg, "context_parallel_size", 1) > 1:
            raise ValueError("DualKV NeMo-RL worker: context_parallel_size > 1 is not supported (set it to 1)")
        if getattr(cfg, "pipeline_model_parallel_size", 1) > 1:
            raise ValueError("DualKV NeMo-RL worker: pipeline_model_parallel_size > 1 is not supported (set it to 1)")
        tp = getattr(cfg, "tensor_model_parallel_size", 1)
        self.pad_to_multiple = tp if getattr(cfg, "sequence_parallel", False) else 1
        self.vocab_size = getattr(inner, "vocab_size", None)
        self.pg_collection = getattr(inner, "pg_collection", None)

    # -- batch -> micro-batches -------------------------------------------------------------------
    def prepare(self, data: Mapping[str, Any]) -> tuple[NemoRLBatch, list, list[EdgeIndex]]:
        s = self.settings
        if "curr_logprobs_keep_mask" in data:
            raise ValueError("the batch carries curr_logprobs_keep_mask (top-k/top-p filtered training logprobs): "
                             "not supported by DualKV")
        batch = convert_batch(data, num_generations_per_prompt=s.num_generations_per_prompt,
                              group_id_key=s.group_id_key)
        mbs = plan_micro_batches(batch, max_tokens=s.max_tokens_per_microbatch,
                                 max_attention_pairs=s.max_attention_pairs, pad_to_multiple=self.pad_to_multiple,
                                 pad_token_id=s.pad_token_id, vocab_size=self.vocab_size, device=self._device())
        return batch, mbs, [batch.edge_index(mb) for mb in mbs]

    def _device(self) -> torch.device:
        p = next(iter(self.model.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    # -- logprobs -------------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, data: Mapping[str, Any]) -> Tensor:
        """float32 [B, S]: log p(token t | tokens < t) on each row's response span, 0 elsewhere."""
        batch, mbs, indices = self.prepare(data)
        pieces = []
        for mb, index in zip(mbs, indices):
            out = self.model(layout=mb.layout, temperature=self.temperature)
            pieces.append((index, out.logprobs.float()))
        return batch.to_sequences(pieces, dtype=torch.float32, device=data["input_ids"].device)

    # -- training -------------------------------------------------------------------------------
    def global_counts(self, batch: NemoRLBatch) -> tuple[float, float]:
        """NeMo-RL's (global_valid_toks, global_valid_seqs), summed over dp_group."""
        tm = batch.data["token_mask"]
        sm = batch.data.get("sample_mask")
        sm = torch.ones(batch.batch_size, dtype=torch.float64) if sm is None else torch.as_tensor(sm)
        toks = (tm[:, 1:].double().cpu() * sm.double().cpu()[:, None]).sum()
        counts = torch.stack([toks, sm.double().cpu().sum()])
        if self.dp_group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(self.dp_group) > 1:
            counts = counts.to(self._device())
            torch.distributed.all_reduce(counts, group=self.dp_group)
        return float(counts[0]), float(counts[1])

    def forward_backward(self, data: Mapping[str, Any], adapter: ClippedPGAdapter,
                         forward_only: bool = False) -> tuple[list[dict[str, float]], list, tuple[float, float]]:
        """Forward (and backward) over one local global batch through Megatron's schedule:
        (per-micro-batch metrics (NeMo-RL names, this rank's shares), the micro-batches' stats,
        (global_valid_toks, global_valid_seqs))."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch, mbs, indices = self.prepare(data)
        toks, seqs = self.global_counts(batch)
        device = self._device()
        items = iter(list(zip(mbs, indices)))
        n = len(mbs)
        metrics: list[dict[str, float]] = []

        def forward_step(data_iterator, model):
            mb, index = next(data_iterator)
            edges = EdgeBatch.gather(batch, index, device)
            lp = model(layout=mb.layout, temperature=self.temperature).logprobs

            def loss_func(logprobs):
                loss, m = adapter(logprobs, edges, mb.layout, global_valid_toks=toks, global_valid_seqs=seqs)
                metrics.append(m)
                # the schedule divides by the number of micro-batches: undo it (NeMo-RL does too)
                return loss * n, {"loss": loss.detach()}

            return lp, loss_func

        kwargs = {} if self.pg_collection is None else {"pg_collection": self.pg_collection}
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=items, model=[self.model], num_microbatches=n,
            seq_length=max(mb.layout.num_tokens for mb in mbs), micro_batch_size=1, forward_only=forward_only,
            **kwargs,
        )
        if batch.empty_rows and metrics and "sample_mask" in batch.data:
            # NeMo-RL counts every row's sample_mask; rows without a response are in no micro-batch
            sm = torch.as_tensor(batch.data["sample_mask"])
            metrics[0]["num_valid_samples"] += float(sm[list(batch.empty_rows)].double().sum())
        return metrics, [mb.stats for mb in mbs], (toks, seqs)

    def train(self, data: Mapping[str, Any], adapter: ClippedPGAdapter, *, local_batch_size: Optional[int] = None,
              zero_grad: Optional[Callable[[], None]] = None,
              optimizer_step: Optional[Callable[[], Optional[Mapping[str, Any]]]] = None,
              eval_mode: bool = False) -> dict[str, Any]:
        """One optimizer step per `local_batch_size` rows (default: all rows), as NeMo-RL's worker.

        zero_grad / optimizer_step: the worker's hooks (e.g. DDP.zero_grad_buffer + optimizer.zero_grad;
        optimizer.step + scheduler.step); optimizer_step may return values to report (grad_norm).
        Returns {"loss": [steps] global losses, "metrics": per-step metrics reduced over micro-batches
        and all-reduced over dp_group, "mb_metrics": [step][micro-batch] this rank's metric shares,
        "global_counts": [step] (global_valid_toks, global_valid_seqs), "step_outputs": what
        optimizer_step returned, "micro_batch_stats": [step] lists of MicroBatchStats}.
        """
        B = _batch_size(data)
        size = B if local_batch_size is None else int(local_batch_size)
        if size < 1 or B % size:
            raise ValueError(f"{B} rows are not a whole number of local batches of {size} rows")
        out: dict[str, list] = {k: [] for k in ("metrics", "mb_metrics", "global_counts", "step_outputs",
                                                 "micro_batch_stats")}
        for start in range(0, B, size):
            chunk = slice_rows(data, start, start + size, B)
            if not eval_mode and zero_grad is not None:
                zero_grad()
            mb_metrics, mb_stats, counts = self.forward_backward(chunk, adapter, forward_only=eval_mode)
            out["metrics"].append(all_reduce_metrics(reduce_metrics(mb_metrics), self.dp_group, device=self._device()))
            out["mb_metrics"].append(mb_metrics)
            out["global_counts"].append(counts)
            out["micro_batch_stats"].append(mb_stats)
            if not eval_mode and optimizer_step is not None:
                out["step_outputs"].append(optimizer_step())
        return {"loss": torch.tensor([m["loss"] for m in out["metrics"]], dtype=torch.float64), **out}
