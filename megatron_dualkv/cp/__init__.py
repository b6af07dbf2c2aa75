"""Context parallelism for DualKV: partition of a packed micro-batch over CP ranks (balanced by
attention work), K/V all-gather with local queries (or heads split by all-to-all), loss-edge gather. docs/CONTEXT_PARALLEL.md."""

from .attention import cp_dualkv_attention
from .comm import gather_edges, gather_rows
from .partition import CPPartition, CPShard, cp_partition, cp_shard, key_counts, pad_layout
from .ulysses import ulysses_dualkv_attention, ulysses_problem

__all__ = ["CPPartition", "CPShard", "cp_dualkv_attention", "cp_partition", "cp_shard", "gather_edges",
           "gather_rows", "key_counts", "pad_layout", "ulysses_dualkv_attention", "ulysses_problem"]
