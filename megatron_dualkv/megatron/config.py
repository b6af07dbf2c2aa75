"""Qwen3-shaped model configs and model providers.

    cfg = qwen3_config("tiny")                      # or "tiny-moe", "8b", "30b-a3b"; **overrides
    model = build_dualkv_model(cfg, pg_collection=pgs)        # DualKVGPTModel
    base = build_replicated_model(cfg, pg_collection=pgs)     # stock GPTModel, same parameter names
    base.load_state_dict(model.state_dict())                  # or copy_weights(model, base)

`qwen3_config` returns a `ModelConfig`: the TransformerConfig plus the GPTModel arguments that are
not part of it (vocabulary, rotary base, untied embeddings, max positions). Overrides go to
whichever of the two has the field (e.g. num_layers=4, vocab_size=512, params_dtype=torch.float64).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from .model import DualKVGPTModel
from .specs import get_dualkv_decoder_block_spec, get_replicated_decoder_block_spec


@dataclass
class ModelConfig:
    """TransformerConfig + the GPTModel constructor arguments it does not hold."""

    transformer: TransformerConfig
    vocab_size: int
    max_sequence_length: int
    rotary_base: int = 1_000_000
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "rope"
    extra: dict = field(default_factory=dict)  # any other GPTModel keyword

    def gpt_kwargs(self) -> dict:
        return dict(
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            rotary_base=self.rotary_base,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            position_embedding_type=self.position_embedding_type,
            **self.extra,
        )


# Qwen3 architecture shared by all sizes: RMSNorm 1e-6, qk-layernorm, SwiGLU, no biases,
# rotary base 1e6, untied embeddings, no dropout (policy updates).
_QWEN3_COMMON: dict[str, Any] = dict(
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    qk_layernorm=True,
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    add_qkv_bias=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
)

_MOE_COMMON: dict[str, Any] = dict(
    moe_router_topk=2,
    moe_router_load_balancing_type="aux_loss",
    moe_router_pre_softmax=False,  # top-k then softmax = Qwen3's normalised top-k probabilities
    moe_token_dispatcher_type="alltoall",
    moe_grouped_gemm=False,
)

_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, vocab_size=256, max_sequence_length=512,
    ),
    "tiny-moe": dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, vocab_size=256, max_sequence_length=512,
        num_moe_experts=4, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, **_MOE_COMMON,
    ),
    "8b": dict(
        num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8,
        kv_channels=128, vocab_size=151936, max_sequence_length=40960,
    ),
    "30b-a3b": dict(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
        kv_channels=128, vocab_size=151936, max_sequence_length=40960,
        num_moe_experts=128, moe_ffn_hidden_size=768, moe_aux_loss_coeff=1e-3,
        **{**_MOE_COMMON, "moe_router_topk": 8},
    ),
}

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"transformer", "extra"}


def qwen3_config(size: str = "tiny", **overrides) -> ModelConfig:
    """A Qwen3-shaped config ('tiny', 'tiny-moe', '8b', '30b-a3b'), with overrides applied."""
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(_SIZES)}")
    values = {**_QWEN3_COMMON, **_SIZES[size], **overrides}
    model_kw = {k: values.pop(k) for k in list(values) if k in _MODEL_FIELDS}
    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(values) - tc_fields)
    if unknown:
        raise ValueError(f"qwen3_config: unknown fields {unknown} (neither TransformerConfig nor GPTModel arguments)")
    if values.get("params_dtype") in (torch.bfloat16,) and "bf16" not in overrides:
        values["bf16"] = True
    return ModelConfig(transformer=TransformerConfig(**values), **model_kw)


def build_dualkv_model(
    cfg: ModelConfig,
    *,
    pg_collection=None,
    pre_process: bool = True,
    post_process: bool = True,
    use_transformer_engine: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    attention_backend: Optional[str] = None,
    replicate_moe_aux_loss: bool = True,
    cp_chunks_per_rank: int = 8,
    cp_chunk_multiple: int = 128,
) -> DualKVGPTModel:
    """Model provider for DualKV training: DualKVGPTModel with the DualKV block spec.
    cp_*: how micro-batches are split under context parallelism (see DualKVGPTModel)."""
    spec = get_dualkv_decoder_block_spec(
        cfg.transformer, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage,
        attention_backend=attention_backend,
    )
    return DualKVGPTModel(
        cfg.transformer, spec, pre_process=pre_process, post_process=post_process,
        pg_collection=pg_collection, vp_stage=vp_stage, replicate_moe_aux_loss=replicate_moe_aux_loss,
        cp_chunks_per_rank=cp_chunks_per_rank, cp_chunk_multiple=cp_chunk_multiple, **cfg.gpt_kwargs(),
    )


def build_replicated_model(
    cfg: ModelConfig,
    *,
    pg_collection=None,
    pre_process: bool = True,
    post_process: bool = True,
    use_transformer_engine: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    stock_attention: str = "megatron",
) -> GPTModel:
    """The stock GPTModel for the same config: the replicated baseline. use_transformer_engine
    is resolved like build_dualkv_model's, so both have the same parameter names; stock_attention
    "sdpa" runs torch SDPA instead of the spec's core attention (get_replicated_decoder_block_spec)."""
    spec = get_replicated_decoder_block_spec(cfg.transformer, use_transformer_engine=use_transformer_engine,
                                             vp_stage=vp_stage, stock_attention=stock_attention)
    return GPTModel(
        cfg.transformer, spec, pre_process=pre_process, post_process=post_process,
        pg_collection=pg_collection, vp_stage=vp_stage, **cfg.gpt_kwargs(),
    )
