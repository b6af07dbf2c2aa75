"""Hugging Face Qwen3 / Qwen3-MoE config.json <-> ModelConfig (qwen3_config).

    cfg = model_config_from_hf(read_hf_config(hf_dir), params_dtype=torch.bfloat16)
    hf = hf_config_from_model_config(cfg)          # dict for config.json

Field mapping (HF -> Megatron):
    num_hidden_layers -> num_layers, hidden_size, intermediate_size -> ffn_hidden_size,
    num_attention_heads, num_key_value_heads -> num_query_groups, head_dim -> kv_channels
    (Qwen3 sets it independently of hidden_size / heads), rms_norm_eps -> layernorm_epsilon
    (also used by q/k layernorm on both sides), rope_theta (or rope_parameters.rope_theta)
    -> rotary_base, max_position_embeddings -> max_sequence_length, vocab_size,
    tie_word_embeddings -> share_embeddings_and_output_weights.
Qwen3-MoE: num_experts (transformers 5 writes num_local_experts) -> num_moe_experts,
    num_experts_per_tok -> moe_router_topk, moe_intermediate_size -> moe_ffn_hidden_size,
    norm_topk_prob -> moe_router_pre_softmax = not norm_topk_prob (Megatron without pre-softmax
    takes the top-k logits and softmaxes over them: the renormalised top-k probabilities; with
    pre-softmax it softmaxes over all experts and keeps the top-k values unnormalised),
    router_aux_loss_coef -> moe_aux_loss_coeff (same number; the two losses are normalised
    differently, see docs/CHECKPOINTS.md), decoder_sparse_step / mlp_only_layers -> moe_layer_freq.
Anything this mapping cannot express (attention biases, sliding windows, RoPE scaling, another
activation) is refused with a ValueError naming the field.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

import torch

from ..megatron.config import ModelConfig, qwen3_config

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def read_hf_config(source: Union[str, os.PathLike, Mapping[str, Any], Any]) -> dict:
    """config.json of a checkpoint directory (or a dict, or a transformers PretrainedConfig) as a dict."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for what in (params, scaling):
        kind = what.get("rope_type", what.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"HF config: RoPE scaling {kind!r} is not supported (only plain RoPE, rope_type 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError("HF config: no rope_theta (neither top level nor in rope_parameters)")
    return float(theta)


def _is_sparse_layer(hf: Mapping[str, Any], i: int) -> bool:
    """Qwen3MoeDecoderLayer's rule for an MoE (vs dense MLP) layer."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    return i not in (hf.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _check_supported(hf: Mapping[str, Any]) -> None:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"HF config: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config: hidden_act {hf['hidden_act']!r} is not supported (Qwen3 uses 'silu')")
    if hf.get("attention_bias", False):
        raise ValueError("HF config: attention_bias=True is not supported (Megatron's add_qkv_bias has no o_proj bias)")
    if hf.get("use_sliding_window", False):
        raise ValueError("HF config: use_sliding_window=True is not supported (DualKV attention is full causal)")
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"HF config: layer_types {sorted(kinds)} are not supported (only full_attention)")


def model_config_from_hf(hf_config: Union[str, os.PathLike, Mapping[str, Any], Any], **overrides) -> ModelConfig:
    """The ModelConfig of a Qwen3 / Qwen3-MoE checkpoint; overrides go to qwen3_config (e.g.
    params_dtype, tensor_model_parallel_size, expert_model_parallel_size, sequence_parallel)."""
    hf = read_hf_config(hf_config)
    _check_supported(hf)
    heads = int(hf["num_attention_heads"])
    theta = _rope_theta(hf)
    values: dict[str, Any] = dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        layernorm_epsilon=float(hf["rms_norm_eps"]),
        vocab_size=int(hf["vocab_size"]),
        max_sequence_length=int(hf["max_position_embeddings"]),
        rotary_base=int(theta) if theta.is_integer() else theta,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )
    size = "tiny"
    if hf["model_type"] == "qwen3_moe":
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not num_experts:
            raise ValueError("HF config: qwen3_moe without num_experts")
        size = "tiny-moe"
        freq = [1 if _is_sparse_layer(hf, i) else 0 for i in range(values["num_layers"])]
        values.update(
            num_moe_experts=int(num_experts),
            moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
            moe_layer_freq=1 if all(freq) else freq,
        )
    return qwen3_config(size, **{**values, **overrides})


def _layer_is_moe(tc, i: int) -> bool:
    if not tc.num_moe_experts:
        return False
    freq = tc.moe_layer_freq
    if isinstance(freq, int):
        return i % freq == 0
    return bool(freq[i])


def moe_layer_pattern(transformer_config) -> list[bool]:
    """Per layer: MoE (True) or dense MLP (False), as Megatron's block spec builds it."""
    return [_layer_is_moe(transformer_config, i) for i in range(transformer_config.num_layers)]


def hf_config_from_model_config(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict:
    """config.json for a ModelConfig (the inverse of model_config_from_hf). Writes rope_theta
    both at the top level (transformers 4 / inference engines) and in rope_parameters (transformers 5)."""
    tc = cfg.transformer
    if not (tc.normalization == "RMSNorm" and tc.qk_layernorm and tc.gated_linear_unit and not tc.add_bias_linear
            and not tc.add_qkv_bias and cfg.position_embedding_type == "rope"):
        raise ValueError("model config is not Qwen3-shaped (RMSNorm, qk-layernorm, SwiGLU, no biases, RoPE)")
    dtype = dtype or tc.params_dtype
    dtype_name = next((k for k, v in _DTYPES.items() if v == dtype), None)
    if dtype_name is None:
        raise ValueError(f"no HF dtype name for {dtype}")
    moe = bool(tc.num_moe_experts)
    theta = cfg.rotary_base
    hf: dict[str, Any] = dict(
        architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        model_type="qwen3_moe" if moe else "qwen3",
        vocab_size=cfg.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.ffn_hidden_size,
        num_hidden_layers=tc.num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_query_groups or tc.num_attention_heads,
        head_dim=tc.kv_channels,
        hidden_act="silu",
        max_position_embeddings=cfg.max_sequence_length,
        rms_norm_eps=tc.layernorm_epsilon,
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        tie_word_embeddings=cfg.share_embeddings_and_output_weights,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        dtype=dtype_name,
        torch_dtype=dtype_name,
    )
    if moe:
        if (tc.moe_router_score_function != "softmax" or tc.moe_shared_expert_intermediate_size
                or tc.moe_router_topk_scaling_factor not in (None, 1.0) or tc.moe_router_enable_expert_bias
                or tc.moe_router_num_groups):
            raise ValueError("MoE config is not Qwen3-MoE-shaped (softmax router, no shared expert, "
                             "no top-k scaling, no expert bias, no group-limited routing)")
        pattern = moe_layer_pattern(tc)
        hf.update(
            num_experts=tc.num_moe_experts,
            num_experts_per_tok=tc.moe_router_topk,
            moe_intermediate_size=tc.moe_ffn_hidden_size,
            norm_topk_prob=not tc.moe_router_pre_softmax,
            router_aux_loss_coef=tc.moe_aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, is_moe in enumerate(pattern) if not is_moe],
        )
    return hf
