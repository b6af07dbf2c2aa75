"""NeMo-RL plug-in: its [B, S] batches deduplicated through DualKV (docs/NEMO_RL.md).

    batch.py         NeMo-RL batch <-> groups, micro-batches and [B, S] logprobs
    loss_adapter.py  ClippedPGLossFn's options, loss and metrics on DualKV loss edges
    runner.py        train() / get_logprobs() of one rank, through Megatron's schedule
    convert.py       a built stock GPTModel -> DualKVGPTModel in place
    shards.py        driver side: row order giving DP shards of whole, balanced groups
    worker.py        the MegatronPolicyWorker extension (imports NeMo-RL only when used)

Importing this package imports megatron.core (through the model conversion) but never NeMo-RL.
"""

from .batch import EdgeIndex, NemoRLBatch, NemoRLBatchError, convert_batch, plan_micro_batches
from .convert import to_dualkv_model
from .loss_adapter import ClippedPGAdapter, EdgeBatch, all_reduce_metrics, reduce_metrics
from .runner import DualKVPolicyRunner, DualKVSettings
from .shards import group_aligned_order, inverse_order

__all__ = [
    "ClippedPGAdapter", "DualKVPolicyRunner", "DualKVSettings", "EdgeBatch", "EdgeIndex", "NemoRLBatch",
    "NemoRLBatchError", "all_reduce_metrics", "convert_batch", "group_aligned_order", "inverse_order",
    "plan_micro_batches", "reduce_metrics", "to_dualkv_model",
]
