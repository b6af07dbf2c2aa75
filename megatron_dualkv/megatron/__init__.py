"""Megatron-Core glue for DualKV: core attention, specs, model, logprobs, MoE router, baseline.

    from megatron_dualkv import Group, build_layout
    from megatron_dualkv.megatron import qwen3_config, build_dualkv_model, build_replicated_model
    from megatron_dualkv.megatron import copy_weights, replicated_logprobs

    cfg = qwen3_config("tiny-moe")
    model = build_dualkv_model(cfg)                     # DualKVGPTModel
    layout = build_layout(groups, vocab_size=cfg.vocab_size)
    out = model(layout=layout)                          # EdgeLogprobs: logprobs [E] (+ entropy)

    base = build_replicated_model(cfg); copy_weights(model, base)
    ref = replicated_logprobs(base, layout)             # equal to out.logprobs to rounding

Importing this package imports megatron.core (and triton); the rest of megatron_dualkv does not.
"""

from .config import ModelConfig, build_dualkv_model, build_replicated_model, qwen3_config
from .core_attention import (
    DualKVCoreAttention,
    DualKVPackedSeqParams,
    dualkv_packed_seq_params,
    megatron_softmax_scale,
)
from .logprobs import EdgeLogprobs, vocab_parallel_logprobs
from .model import DualKVGPTModel, cp_token_count
from .replicated import ReplicatedBatch, copy_weights, replicated_batch, replicated_logprobs
from .router import DualKVTopKRouter
from .sdpa_attention import SdpaDotProductAttention
from .specs import (
    dualkv_layer_spec_from,
    get_dualkv_decoder_block_spec,
    get_dualkv_layer_spec,
    get_replicated_decoder_block_spec,
    transformer_engine_available,
)

__all__ = [
    "DualKVCoreAttention", "DualKVGPTModel", "DualKVPackedSeqParams", "DualKVTopKRouter", "EdgeLogprobs",
    "ModelConfig", "ReplicatedBatch", "SdpaDotProductAttention", "build_dualkv_model", "build_replicated_model", "copy_weights", "cp_token_count",
    "dualkv_layer_spec_from", "dualkv_packed_seq_params", "get_dualkv_decoder_block_spec",
    "get_dualkv_layer_spec", "get_replicated_decoder_block_spec", "megatron_softmax_scale", "qwen3_config",
    "replicated_batch", "replicated_logprobs", "transformer_engine_available", "vocab_parallel_logprobs",
]
