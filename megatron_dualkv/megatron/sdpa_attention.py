"""Core attention for the stock (replicated) baseline through torch's scaled_dot_product_attention.

Without Transformer Engine, Megatron's local spec runs `DotProductAttention`: it materialises the
[rows, heads, S, S] scores and probabilities (bf16, plus their gradients in backward), which at
S = P + R = 10K is gigabytes per row and layer and ~80 TFLOP/s on an H100. `--no-dualkv
--stock-attention sdpa` swaps in this module, so that the replicated baseline runs a flash-style
attention (SDPA picks flash / cuDNN / memory-efficient kernels on CUDA) without TE: a fair
baseline where TE is not installed.

Same interface and parameters as DotProductAttention (query [sq, b, np, hn], key / value
[sk, b, ng, hn] -> [sq, b, np * hn]); causal only. The replicated batch's rows are right-padded
([prompt | response | padding]): every key a real query may see lies before it in its own row, so
the causal mask alone equals the model's causal + padding mask for every real token; the padding
rows' own outputs carry no loss.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SdpaDotProductAttention(MegatronModule):
    """DotProductAttention's contract, computed by F.scaled_dot_product_attention (causal, GQA)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:  # padding_causal would need the mask it ignores
            raise ValueError(f"SdpaDotProductAttention computes causal attention only, got attn_mask_type {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("SdpaDotProductAttention has no context parallelism (the DualKV model has its own)")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SdpaDotProductAttention has no sliding window (config.window_size is set)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SdpaDotProductAttention computes the vanilla softmax, got {config.softmax_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:  # DotProductAttention forks the TP RNG for it; SDPA's dropout would not
            raise ValueError(f"SdpaDotProductAttention has no attention dropout (got {dropout}); GRPO runs without it")
        # apply_query_key_layer_scaling divides the scale by the layer number and the softmax multiplies
        # it back (DotProductAttention): the product is the plain scale
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaDotProductAttention takes bshd rows without packed_seq_params or attention_bias")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaDotProductAttention computes causal attention only, got {attn_mask_type}")
        sq, b, heads, dim = query.shape
        if key.shape[0] != sq:
            raise ValueError(f"causal self-attention needs as many keys as queries, got {key.shape[0]} and {sq}")
        # [s, b, h, d] -> [b, h, s, d]; GQA: SDPA repeats the kv heads itself (no copy per query head)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)
