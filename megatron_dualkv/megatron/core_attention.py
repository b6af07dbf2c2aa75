"""DualKV core attention for Megatron-Core's SelfAttention.

Use it as `SelfAttentionSubmodules.core_attention` (the specs in `megatron_dualkv.megatron.specs`
do this) and hand the micro-batch layout to the model through the packed-sequence parameters:

    psp = dualkv_packed_seq_params(layout)          # qkv_format 'thd', carries the layout
    model(input_ids, position_ids=None, attention_mask=None, packed_seq_params=psp)

(`DualKVGPTModel(layout=...)` builds `psp` itself.) The whole micro-batch is described to
Megatron as ONE packed sequence (cu_seqlens = [0, T]): Megatron's THD RoPE then applies the
per-token rotary table row by row (see `DualKVGPTModel._preprocess`), and this module replaces
Megatron's per-sequence causal attention by the DualKV mask read from the layout.

Context parallelism (cp > 1): the packed-seq params also carry the rank's `CPShard`; the module
all-gathers K/V over the CP group and runs the rank's queries against them with their global
rows (megatron_dualkv.cp). To Megatron the micro-batch is one sequence of cp * L rows of which
this rank holds L (cu_seqlens = [0, cp * L]), so its THD RoPE takes this rank's slice of a table
built for that (see `DualKVGPTModel._preprocess`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from ..cp import CPShard, cp_dualkv_attention, ulysses_dualkv_attention, ulysses_problem
from ..layout import PackedLayout
from ..ops import dualkv_attention


@dataclass
class DualKVPackedSeqParams(PackedSeqParams):
    """PackedSeqParams that also carry the DualKV layout of the micro-batch (qkv_format 'thd')."""

    layout: Optional[PackedLayout] = None
    cp_shard: Optional[CPShard] = None  # this rank's rows under context parallelism


def rotary_position_limit(layout: PackedLayout) -> int:
    """1 + the largest rotary position of the layout (one host sync per micro-batch, cached)."""
    return layout.cached("rotary_position_limit", lambda: int(layout.position_ids.max().item()) + 1)


def dualkv_packed_seq_params(layout: PackedLayout | CPShard, host_cu_seqlens: bool = True) -> DualKVPackedSeqParams:
    """The packed-sequence parameters Megatron's attention path needs for one DualKV micro-batch.

    cu_seqlens = [0, T]: Megatron sees one sequence, so its THD RoPE maps a [T, 1, 1, d] rotary
    table row by row onto the tokens; max_seqlen is the rotary position limit (the size of the
    rotary table the model gathers per-token positions from). host_cu_seqlens keeps cu_seqlens on
    the CPU: Megatron's unfused THD RoPE reads it with .tolist()/.item() in every layer, which
    would be a device sync each time; TE's fused RoPE (config.apply_rope_fusion) needs it on the
    device. Not cached on the layout: the params refer to the layout, and a layout caching them
    would be a reference cycle that keeps each micro-batch's device tensors (rotary table, work
    lists) alive until the garbage collector runs (Megatron's --manual-gc delays that); the model
    builds them once per forward.
    A `CPShard` (context parallelism): the shard's global layout, cu_seqlens = [0, cp * L] (L rows
    per rank), and the shard itself for the core attention.
    """
    shard = layout if isinstance(layout, CPShard) else None
    full = shard.layout if shard is not None else layout

    device = "cpu" if host_cu_seqlens else full.device
    total = full.num_tokens if shard is None else shard.cp_size * shard.num_local
    cu = torch.tensor([0, total], dtype=torch.int32, device=device)
    limit = rotary_position_limit(full)
    return DualKVPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=limit,
        max_seqlen_kv=limit,
        layout=full,
        cp_shard=shard,
    )


CP_COMM_TYPES = (None, "all_gather", "a2a")


def megatron_softmax_scale(config: TransformerConfig, softmax_scale: Optional[float]) -> float:
    """The scale Megatron's DotProductAttention applies to q.k, as one number.

    DotProductAttention uses `softmax_scale` (config.softmax_scale, set e.g. by muP) or
    1/sqrt(kv_channels). apply_query_key_layer_scaling divides the scores by layer_number and
    the fused softmax multiplies them back by the same coefficient (an fp16 range trick), so
    the effective scale is unchanged by it.
    """
    if softmax_scale is not None:
        return float(softmax_scale)
    return 1.0 / math.sqrt(config.kv_channels)


class DualKVCoreAttention(MegatronModule):
    """Core attention over the DualKV layout (prompt once, responses attend to it).

    Constructor arguments are those Megatron passes to any core attention (see
    DotProductAttention); `backend` picks the DualKV attention backend (None: fastest available,
    or the MEGATRON_DUALKV_ATTENTION_BACKEND environment variable). config.deterministic_mode
    selects the cuda kernel's bitwise reproducible backward.
    forward: q [T, np, hn], k and v [T, ng, hn] (heads local to this TP rank) -> [T, np*hn].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: Optional[str] = None,
        **unused,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        self.pg_collection = pg_collection
        if attention_type != "self":
            raise ValueError(f"DualKVCoreAttention implements self attention only, got attention_type={attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"DualKVCoreAttention has no attention dropout (got attention_dropout={dropout}); "
                "set TransformerConfig.attention_dropout=0.0 (GRPO policy updates use none)"
            )
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"DualKVCoreAttention's context parallelism is 'all_gather' (K/V all-gather, the default) or 'a2a' "
                f"(heads split by all-to-all); got cp_comm_type={cp_comm_type!r}"
            )
        self.cp_comm_type = cp_comm_type or "all_gather"
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        cp = self.cp_group.size() if self.cp_group is not None else 1
        if self.cp_comm_type == "a2a" and cp > 1:
            tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
            problem = ulysses_problem(config.num_attention_heads // tp, (config.num_query_groups or config.num_attention_heads) // tp, cp)
            if problem:
                raise ValueError(f"cp_comm_type='a2a': {problem}; use cp_comm_type='all_gather'")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"DualKVCoreAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("DualKVCoreAttention does not support sliding-window attention (config.window_size)")
        self.softmax_scale = megatron_softmax_scale(config, softmax_scale)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        **unused,
    ) -> Tensor:
        layout = getattr(packed_seq_params, "layout", None)
        if layout is None:
            raise ValueError(
                "DualKVCoreAttention needs the micro-batch layout: call the model with "
                "packed_seq_params=dualkv_packed_seq_params(layout) (or DualKVGPTModel(..., layout=layout)); "
                f"got packed_seq_params={type(packed_seq_params).__name__}"
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"DualKVCoreAttention expects qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
        if attention_bias is not None:
            raise ValueError("DualKVCoreAttention does not support an attention bias")
        # Megatron splits the fused QKV projection into strided views; the fused kernels read dense
        # [T, H, D] rows (a no-op for tensors that already are; with GQA K/V are the small ones).
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        # Megatron's switch for reproducible kernels: the cuda kernel's deterministic backward
        deterministic = bool(getattr(self.config, "deterministic_mode", False))
        shard = getattr(packed_seq_params, "cp_shard", None)
        cp = self.cp_group.size() if self.cp_group is not None else 1
        if shard is None and cp > 1:
            raise ValueError(
                f"DualKVCoreAttention runs with context parallel size {cp} but the packed-seq params carry no "
                "CPShard: call DualKVGPTModel(layout=...) (it shards the micro-batch) or pass "
                "dualkv_packed_seq_params(cp_shard(layout, cp_rank, cp_size))"
            )
        if shard is not None:
            if shard.cp_size != cp:
                raise ValueError(f"the CPShard splits the micro-batch over {shard.cp_size} ranks but the CP group has {cp}")
            attend = ulysses_dualkv_attention if self.cp_comm_type == "a2a" else cp_dualkv_attention
            out = attend(query, key, value, shard, self.cp_group, self.softmax_scale, self.backend, deterministic)
        else:
            out = dualkv_attention(query, key, value, layout, softmax_scale=self.softmax_scale, backend=self.backend,
                                   deterministic=deterministic)
        return out.reshape(out.size(0), -1)
