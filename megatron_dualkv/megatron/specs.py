"""Layer and block specs for DualKV models: Megatron's GPT specs with the DualKV pieces swapped in.

    spec = get_dualkv_decoder_block_spec(config)             # TE spec if TE imports, else local
    spec = get_dualkv_decoder_block_spec(config, use_transformer_engine=False)
    layer = get_dualkv_layer_spec(num_experts=8, qk_layernorm=True, normalization="RMSNorm")

Each layer is exactly Megatron's (local or Transformer Engine) GPT layer, with
`self_attention.submodules.core_attention = DualKVCoreAttention` and, for MoE layers, the router
replaced by `DualKVTopKRouter`; nothing else changes, so parameters and state_dict keys are the
stock model's. qk-layernorm (Qwen3) and RMSNorm come from the config like in Megatron.
`get_replicated_decoder_block_spec` is the matching stock spec (the baseline for tests; its
`stock_attention="sdpa"` swaps in torch SDPA for a flash-style baseline without TE). Without TE,
`config.moe_grouped_gemm` runs the experts as GroupedGemmSequentialMLP (grouped_experts.py).
Local specs (no TE) name `SequenceParallelTorchNorm` where Megatron's name its torch-norm
fallback, so tensor parallelism with sequence parallelism runs without TE or apex (norms.py);
without sequence parallelism the norms are the stock ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from .core_attention import DualKVCoreAttention
from .grouped_experts import GroupedGemmSequentialMLP
from .norms import map_spec, with_sequence_parallel_norms
from .router import DualKVTopKRouter
from .sdpa_attention import SdpaDotProductAttention


def transformer_engine_available() -> bool:
    """Whether Megatron can use Transformer Engine in this process."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext

        return bool(getattr(te_ext, "HAVE_TE", False))
    except Exception:  # TE missing or broken: use the local spec
        return False


def _resolve_te(use_transformer_engine: Optional[bool]) -> bool:
    if use_transformer_engine is None:
        return transformer_engine_available()
    if use_transformer_engine and not transformer_engine_available():
        raise ValueError("use_transformer_engine=True but Transformer Engine is not importable")
    return bool(use_transformer_engine)


def with_grouped_experts(layer_spec):
    """A copy of a local GPT layer spec whose SequentialMLP experts are GroupedGemmSequentialMLP (same
    parameters, grouped GEMMs: what --moe-grouped-gemm asks for where TE's grouped experts are
    missing); dense layers come back unchanged, an MoE layer without SequentialMLP experts is an error."""
    seen = {MoELayer: False, SequentialMLP: False}

    def swap(x):  # every leaf of the spec: module classes and plain values
        for cls in seen:
            seen[cls] |= x is cls
        return GroupedGemmSequentialMLP if x is SequentialMLP else x

    spec = map_spec(layer_spec, swap)
    if seen[MoELayer] and not seen[SequentialMLP]:
        raise ValueError("moe_grouped_gemm without Transformer Engine swaps SequentialMLP experts for grouped ones, "
                         f"but this MoE layer spec has none: {layer_spec!r}")
    return spec


def _with_dualkv_mlp(mlp):
    """MoE layers: swap the router; dense MLPs are returned unchanged."""
    if isinstance(mlp, functools.partial) and mlp.func is MoELayer and "submodules" in mlp.keywords:
        sub = dataclasses.replace(mlp.keywords["submodules"], router=DualKVTopKRouter)
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})
    if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
        return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=DualKVTopKRouter))
    return mlp


def dualkv_layer_spec_from(layer_spec: ModuleSpec, attention_backend: Optional[str] = None) -> ModuleSpec:
    """A copy of a stock GPT layer spec with the DualKV core attention and router."""
    core = DualKVCoreAttention if attention_backend is None else functools.partial(DualKVCoreAttention, backend=attention_backend)
    spec = with_core_attention(layer_spec, core)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=_with_dualkv_mlp(spec.submodules.mlp)))


def get_dualkv_layer_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    normalization: Optional[str] = None,
    use_transformer_engine: Optional[bool] = None,
    attention_backend: Optional[str] = None,
) -> ModuleSpec:
    """One DualKV GPT layer (dense when num_experts is None, else MoE)."""
    if _resolve_te(use_transformer_engine):
        stock = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm
        )
    else:
        stock = with_sequence_parallel_norms(get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
            normalization=normalization,
        ))
        if moe_grouped_gemm:
            stock = with_grouped_experts(stock)
    return dualkv_layer_spec_from(stock, attention_backend)


STOCK_ATTENTIONS = ("megatron", "sdpa")


def with_core_attention(layer_spec: ModuleSpec, core_attention) -> ModuleSpec:
    """A copy of a GPT layer spec whose self-attention uses `core_attention`."""
    sub = layer_spec.submodules
    attn = dataclasses.replace(sub.self_attention,
                               submodules=dataclasses.replace(sub.self_attention.submodules, core_attention=core_attention))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, self_attention=attn))


def get_replicated_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    stock_attention: str = "megatron",
) -> TransformerBlockSubmodules:
    """Megatron's stock GPT block spec for `config` (dense or MoE per config.moe_layer_freq).
    stock_attention: "megatron", the spec's own core attention (TE's fused one with TE, the local
    unfused DotProductAttention without), or "sdpa", torch's scaled_dot_product_attention
    (SdpaDotProductAttention: a flash-style baseline without TE)."""
    if stock_attention not in STOCK_ATTENTIONS:
        raise ValueError(f"stock_attention must be one of {STOCK_ATTENTIONS}, got {stock_attention!r}")
    te = _resolve_te(use_transformer_engine)
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage, pp_rank=pp_rank,
    )
    block = block if te else with_sequence_parallel_norms(block)
    if not te and config.moe_grouped_gemm:
        block = dataclasses.replace(block, layer_specs=[with_grouped_experts(s) for s in block.layer_specs])
    if stock_attention == "sdpa":
        block = dataclasses.replace(block, layer_specs=[with_core_attention(s, SdpaDotProductAttention)
                                                        for s in block.layer_specs])
    return block


def get_dualkv_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    attention_backend: Optional[str] = None,
) -> TransformerBlockSubmodules:
    """The DualKV block spec: the stock block spec with every layer made DualKV."""
    block = get_replicated_decoder_block_spec(config, use_transformer_engine, vp_stage, pp_rank)
    return dataclasses.replace(
        block, layer_specs=[dualkv_layer_spec_from(s, attention_backend) for s in block.layer_specs]
    )
