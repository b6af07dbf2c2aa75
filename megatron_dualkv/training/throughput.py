"""Model FLOPs of a training step, deduplicated or replicated, and MFU.

Matrix FLOPs per token of every layer (forward, 2 per multiply-add): the QKV and output
projections, the MLP (SwiGLU: three matrices) or, for MoE, the router plus top-k experts (and a
shared expert when configured). Logits are counted only where the model computes them for the
loss (one row per loss edge; DualKV never computes the other prompt rows). Attention scores and
values use `megatron_dualkv.flops.attention_flops` over the attended (query, key) pairs.
Forward + backward: 3x the forward for matrix products, `flops.FWD_BWD_FACTOR` (3.5x) for attention,
the convention of megatron_dualkv.flops.

"Useful" FLOPs are those of the deduplicated problem (P + sum R tokens, DualKV pairs): MFU divides
them by the elapsed time and the peak of every device, so the replicated baseline (--no-dualkv),
which does more work for the same update, shows a lower MFU for the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..flops import attention_flops
from .data import StepTotals

# bf16 dense peak (TFLOP/s) of the GPUs we run on; --peak-tflops overrides
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "B200": 2250.0}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    gated_linear_unit: bool = True
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 1
    moe_shared_expert_intermediate_size: Optional[int] = None

    @staticmethod
    def of(transformer_config, vocab_size: int) -> "ModelShape":
        c = transformer_config
        return ModelShape(
            num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups or c.num_attention_heads,
            kv_channels=c.kv_channels or c.hidden_size // c.num_attention_heads, vocab_size=vocab_size,
            gated_linear_unit=bool(c.gated_linear_unit), num_moe_experts=c.num_moe_experts,
            moe_ffn_hidden_size=c.moe_ffn_hidden_size, moe_router_topk=c.moe_router_topk or 1,
            moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
        )

    def token_matmul_flops(self) -> float:
        """Forward matrix FLOPs of one token through every layer (no attention scores, no logits)."""
        h, d = self.hidden_size, self.kv_channels
        qkv = 2 * h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        proj = 2 * self.num_attention_heads * d * h
        mats = 3 if self.gated_linear_unit else 2
        if self.num_moe_experts:
            mlp = 2 * h * self.num_moe_experts + self.moe_router_topk * mats * 2 * h * self.moe_ffn_hidden_size
            if self.moe_shared_expert_intermediate_size:
                mlp += mats * 2 * h * self.moe_shared_expert_intermediate_size
        else:
            mlp = mats * 2 * h * self.ffn_hidden_size
        return float(self.num_layers * (qkv + proj + mlp))

    def step_flops(self, tokens: int, attention_pairs: int, logit_rows: int) -> float:
        """Forward + backward FLOPs of `tokens` tokens, `attention_pairs` pairs per layer and the
        output layer on `logit_rows` rows."""
        matmul = tokens * self.token_matmul_flops() + logit_rows * 2.0 * self.hidden_size * self.vocab_size
        attn = self.num_layers * attention_flops(attention_pairs, self.num_attention_heads, self.kv_channels,
                                                  backward=True)
        return 3.0 * matmul + attn

    def useful_flops(self, totals: StepTotals) -> float:
        """The deduplicated problem of a step (what DualKV computes)."""
        return self.step_flops(totals.packed_tokens, totals.attention_pairs, totals.loss_edges)

    def replicated_flops(self, totals: StepTotals) -> float:
        """What the replicated batch computes for the same step (logits at the loss rows only)."""
        return self.step_flops(totals.replicated_tokens, totals.replicated_attention_pairs, totals.loss_edges)


def peak_tflops(override: Optional[float] = None) -> Optional[float]:
    """Per-device peak TFLOP/s: the override, else a known GPU's bf16 dense peak, else None."""
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
