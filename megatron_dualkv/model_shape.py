"""The one description of a decoder's shape: its parameter counts and its FLOPs.

Read by the memory planner (megatron_dualkv.planner) and by the training script's MFU
(megatron_dualkv.training.log, .providers), so both count FLOPs with the same formulas:

- matrix FLOPs of one token through every layer, forward, 2 per multiply-add: the QKV and output
  projections, the MLP (SwiGLU: three matrices, else two) or, for MoE, the router plus top-k
  experts (and a shared expert when configured);
- the output layer, 2 x hidden x vocab per row whose logits are computed (DualKV: loss edges only);
- attention scores and values, `megatron_dualkv.flops.attention_flops` over the attended
  (query, key) pairs of every layer;
- forward + backward: 3x the forward for matrix products, `flops.FWD_BWD_FACTOR` (3.5x) for attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .flops import attention_flops

if TYPE_CHECKING:  # training.data imports torch and Megatron helpers; only its field names are read
    from .training.data import StepTotals

MATMUL_FWD_BWD_FACTOR = 3.0  # backward of a matrix product: two products of the forward's size


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-style decoder (RMSNorm, optional qk-norm, gated or plain MLP, no biases, RoPE)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 1
    qk_layernorm: bool = True
    untied_embeddings: bool = True
    name: str = "custom"
    gated_linear_unit: bool = True  # SwiGLU: three MLP matrices (two otherwise)
    moe_shared_expert_intermediate_size: Optional[int] = None

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "vocab_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape.{f} must be >= 1, got {getattr(self, f)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_query_groups {self.num_query_groups}")
        if self.num_moe_experts:
            if not self.moe_ffn_hidden_size:
                raise ValueError("an MoE shape needs moe_ffn_hidden_size")
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(f"moe_router_topk must be in [1, {self.num_moe_experts}], got {self.moe_router_topk}")
        elif self.moe_shared_expert_intermediate_size:
            raise ValueError("moe_shared_expert_intermediate_size needs num_moe_experts (a shared expert is an MoE part)")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_linear_unit else 2

    @staticmethod
    def preset(size: str, **overrides) -> "ModelShape":
        """The shape of megatron_dualkv.megatron.qwen3_config(size, **overrides)."""
        from .megatron.config import qwen3_config

        cfg = qwen3_config(size, **overrides)
        return ModelShape.of(cfg.transformer, cfg.vocab_size, untied=not cfg.share_embeddings_and_output_weights,
                             name=size)

    @staticmethod
    def of(transformer_config, vocab_size: int, untied: bool = True, name: str = "custom") -> "ModelShape":
        """The shape of a Megatron TransformerConfig (whatever it configures; the planner refuses
        what its memory model does not cover)."""
        c = transformer_config
        return ModelShape(
            num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups or c.num_attention_heads,
            kv_channels=c.kv_channels or c.hidden_size // c.num_attention_heads, vocab_size=vocab_size,
            num_moe_experts=c.num_moe_experts, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
            moe_router_topk=(c.moe_router_topk or 1) if c.num_moe_experts else 1,
            qk_layernorm=bool(c.qk_layernorm), untied_embeddings=untied, name=name,
            gated_linear_unit=bool(c.gated_linear_unit),
            moe_shared_expert_intermediate_size=getattr(c, "moe_shared_expert_intermediate_size", None),
        )

    # -- parameters --------------------------------------------------------------------------
    def _qkv_out(self) -> int:
        return self.kv_channels * (self.num_attention_heads + 2 * self.num_query_groups)

    def _attention_weights(self) -> int:
        """QKV and output projection weights of one layer."""
        return self.hidden_size * self._qkv_out() + self.num_attention_heads * self.kv_channels * self.hidden_size

    def param_counts(self) -> dict:
        """Whole-model parameter counts by how they are sharded:
        tp: split over TP (QKV, output projection, dense MLP); vocab: split over TP (embedding,
        output layer); replicated: on every rank (norms, router); expert: split over EP x ETP."""
        if self.moe_shared_expert_intermediate_size:
            raise ValueError("parameter counts do not model shared experts (nor their optional gate)")
        h, L, m = self.hidden_size, self.num_layers, self.mlp_matrices
        rep = h + (2 * self.kv_channels if self.qk_layernorm else 0) + h  # input norm, qk norms, pre-MLP norm
        if self.is_moe:
            mlp_tp, expert = 0, self.num_moe_experts * m * h * self.moe_ffn_hidden_size
            rep += self.num_moe_experts * h  # router
        else:
            mlp_tp, expert = m * h * self.ffn_hidden_size, 0
        vocab = self.vocab_size * h * (2 if self.untied_embeddings else 1)
        return {"tp": L * (self._attention_weights() + mlp_tp), "vocab": vocab, "replicated": L * rep + h,
                "expert": L * expert}

    def total_params(self) -> int:
        return sum(self.param_counts().values())

    def active_weights_per_token(self) -> tuple[int, int]:
        """(dense, expert): weights a token is multiplied by in the decoder layers, all layers.
        dense: projections, dense MLP or router (+ shared expert); expert: its top-k experts."""
        h, m = self.hidden_size, self.mlp_matrices
        dense, expert = self._attention_weights(), 0
        if self.is_moe:
            dense += self.num_moe_experts * h  # router
            if self.moe_shared_expert_intermediate_size:
                dense += m * h * self.moe_shared_expert_intermediate_size
            expert = self.moe_router_topk * m * h * self.moe_ffn_hidden_size
        else:
            dense += m * h * self.ffn_hidden_size
        return self.num_layers * dense, self.num_layers * expert

    def active_params_per_token(self) -> int:
        """Weights a token is multiplied by in the decoder layers (MoE: router + top-k experts)."""
        return sum(self.active_weights_per_token())

    # -- FLOPs -------------------------------------------------------------------------------
    def token_matmul_flops_by_kind(self) -> tuple[float, float]:
        """(dense, expert) forward matrix FLOPs of one token through every layer (2 per weight)."""
        dense, expert = self.active_weights_per_token()
        return 2.0 * dense, 2.0 * expert

    def token_matmul_flops(self) -> float:
        """Forward matrix FLOPs of one token through every layer (no attention scores, no logits)."""
        return sum(self.token_matmul_flops_by_kind())

    def logits_flops(self, rows: int) -> float:
        """Forward FLOPs of the output layer on `rows` rows."""
        return 2.0 * self.hidden_size * self.vocab_size * rows

    def attention_flops(self, pairs: int, backward: bool = False) -> float:
        """Attention FLOPs of every layer over `pairs` attended (query, key) pairs per layer."""
        return self.num_layers * attention_flops(pairs, self.num_attention_heads, self.kv_channels, backward=backward)

    def step_flops(self, tokens: int, attention_pairs: int, logit_rows: int) -> float:
        """Forward + backward FLOPs of `tokens` tokens, `attention_pairs` pairs per layer and the
        output layer on `logit_rows` rows."""
        matmul = tokens * self.token_matmul_flops() + self.logits_flops(logit_rows)
        return MATMUL_FWD_BWD_FACTOR * matmul + self.attention_flops(attention_pairs, backward=True)

    def useful_flops(self, totals: "StepTotals") -> float:
        """The deduplicated problem of a step (what DualKV computes)."""
        return self.step_flops(totals.packed_tokens, totals.attention_pairs, totals.loss_edges)

    def replicated_flops(self, totals: "StepTotals") -> float:
        """What the replicated batch computes for the same step (logits at the loss rows only)."""
        return self.step_flops(totals.replicated_tokens, totals.replicated_attention_pairs, totals.loss_edges)
