"""Context parallelism for DualKV: partition of a packed micro-batch over CP ranks (balanced by
attention work), K/V all-gather with local queries, loss-edge gather. docs/CONTEXT_PARALLEL.md."""

from .attention import cp_dualkv_attention
from .comm import gather_edges, gather_rows
from .partition import CPPartition, CPShard, cp_partition, cp_shard, key_counts, pad_layout

__all__ = ["CPPartition", "CPShard", "cp_dualkv_attention", "cp_partition", "cp_shard", "gather_edges",
           "gather_rows", "key_counts", "pad_layout"]
