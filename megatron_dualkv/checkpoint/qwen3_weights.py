"""Qwen3 / Qwen3-MoE weights: Hugging Face names and tensors <-> full Megatron-Core tensors.

"Full" Megatron names are those of the model at TP=1, EP=1, PP=1 built from the local spec
(what `qwen3_megatron_names(cfg)` lists); sharding to and from a live model is sharding.py's job.

    wmap = Qwen3WeightMap(cfg.transformer, tied=cfg.share_embeddings_and_output_weights)
    full = wmap.to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", source)
    for hf_name, t in wmap.to_hf("decoder.layers.0.mlp.linear_fc1.weight", full): ...

Mapping (layer i, expert j), checked against megatron-core 0.19.2 and transformers 5:
    embedding.word_embeddings.weight                    model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight             model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight   q_proj, k_proj, v_proj, interleaved per
        query group g along the output dim: [q heads of g | k_g | v_g] for g = 0..ng-1
        (Attention.get_query_key_value_tensors views it as [ng, (np/ng + 2) * hn])
    ...self_attention.q_layernorm / k_layernorm         self_attn.q_norm / k_norm
    ...self_attention.linear_proj.weight                self_attn.o_proj.weight
    decoder.layers.i.pre_mlp_layernorm.weight           post_attention_layernorm.weight
    ...mlp.linear_fc1.weight                            cat(mlp.gate_proj, mlp.up_proj) (SwiGLU
        takes the first half as the gate: megatron.core.transformer.mlp / fused_bias_swiglu)
    ...mlp.linear_fc2.weight                            mlp.down_proj.weight
    ...mlp.router.weight                                mlp.gate.weight
    ...mlp.experts.local_experts.j.linear_fc1/fc2       mlp.experts.j.cat(gate_proj, up_proj) / down_proj
    decoder.final_layernorm.weight                      model.norm.weight
    output_layer.weight                                 lm_head.weight (absent when tied)
Transformer Engine spec aliases are accepted as well: the input norm fused into linear_qkv
(`linear_qkv.layer_norm_weight`), the pre-MLP norm fused into a dense fc1
(`linear_fc1.layer_norm_weight`) and grouped experts (`experts.linear_fc1.weight<j>`).
HF expert tensors may also come fused as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); exports always
write the per-expert layout of checkpoints on the Hub.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .safetensors_io import HFTensorSource

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
# per-layer Megatron suffix (TE aliases included) -> parameter kind
_LAYER_KINDS = {
    "input_layernorm.weight": "input_norm",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
    "self_attention.linear_proj.weight": "o_proj",
    "pre_mlp_layernorm.weight": "post_attn_norm",
    "mlp.linear_fc1.layer_norm_weight": "post_attn_norm",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc2.weight": "fc2",
    "mlp.router.weight": "router",
}
_HF_LAYER_NAMES = {
    "input_norm": ["input_layernorm.weight"],
    "q_norm": ["self_attn.q_norm.weight"],
    "k_norm": ["self_attn.k_norm.weight"],
    "o_proj": ["self_attn.o_proj.weight"],
    "post_attn_norm": ["post_attention_layernorm.weight"],
    "qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "fc1": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "fc2": ["mlp.down_proj.weight"],
    "router": ["mlp.gate.weight"],
}


@dataclass(frozen=True)
class ParamKey:
    """What a full Megatron parameter is: kind, layer (global, 0-based), expert (global)."""

    kind: str
    layer: Optional[int] = None
    expert: Optional[int] = None


def parse_megatron_name(name: str) -> ParamKey:
    """The ParamKey of a full Megatron parameter name; ValueError for a name this converter does not know."""
    top = {
        "embedding.word_embeddings.weight": "embed",
        "decoder.final_layernorm.weight": "final_norm",
        "output_layer.weight": "lm_head",
    }
    if name in top:
        return ParamKey(top[name])
    m = _LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _LAYER_KINDS:
            return ParamKey(_LAYER_KINDS[rest], layer)
        e = _EXPERT.match(rest)
        if e:
            expert = int(e.group(1) if e.group(1) is not None else e.group(4))
            fc = e.group(2) or e.group(3)
            return ParamKey("expert_" + fc[len("linear_"):], layer, expert)
    raise ValueError(f"parameter {name!r} has no Qwen3 Hugging Face counterpart (unknown to the converter)")


def qwen3_megatron_names(transformer_config, tied: bool, moe_pattern: list[bool]) -> list[str]:
    """Full parameter names of the Megatron model (local spec, SequentialMLP experts), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i, is_moe in enumerate(moe_pattern):
        p = f"decoder.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "self_attention.linear_proj.weight",
                                  "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
                                  "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight")]
        if is_moe:
            names.append(p + "mlp.router.weight")
            for j in range(transformer_config.num_moe_experts):
                names += [f"{p}mlp.experts.local_experts.{j}.linear_fc1.weight",
                          f"{p}mlp.experts.local_experts.{j}.linear_fc2.weight"]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not tied:
        names.append("output_layer.weight")
    return names


class Qwen3WeightMap:
    """Converts one full parameter at a time between the HF and the Megatron layout."""

    def __init__(self, transformer_config, tied: bool):
        tc = transformer_config
        self.num_heads = tc.num_attention_heads
        self.num_groups = tc.num_query_groups or tc.num_attention_heads
        self.head_dim = tc.kv_channels
        self.tied = tied
        if self.num_heads % self.num_groups:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of {self.num_groups} query groups")

    # -- names ------------------------------------------------------------------------------
    def hf_names(self, key: ParamKey) -> list[str]:
        """The HF tensors (per-expert layout) that one Megatron parameter is made of."""
        if key.kind == "embed":
            return ["model.embed_tokens.weight"]
        if key.kind == "final_norm":
            return ["model.norm.weight"]
        if key.kind == "lm_head":
            # tied: a pipeline's last stage holds a copy of the embedding as output_layer.weight
            return ["model.embed_tokens.weight"] if self.tied else ["lm_head.weight"]
        p = f"model.layers.{key.layer}."
        if key.kind == "expert_fc1":
            return [f"{p}mlp.experts.{key.expert}.gate_proj.weight", f"{p}mlp.experts.{key.expert}.up_proj.weight"]
        if key.kind == "expert_fc2":
            return [f"{p}mlp.experts.{key.expert}.down_proj.weight"]
        return [p + s for s in _HF_LAYER_NAMES[key.kind]]

    # -- HF -> Megatron ---------------------------------------------------------------------
    def to_megatron(self, name: str, source: HFTensorSource) -> Tensor:
        key = parse_megatron_name(name)
        parts = [self._read(n, key, source) for n in self.hf_names(key)]
        if key.kind == "qkv":
            return self.interleave_qkv(*parts)
        if key.kind in ("fc1", "expert_fc1"):
            return torch.cat(parts, dim=0)
        (t,) = parts
        return t

    def _read(self, hf_name: str, key: ParamKey, source: HFTensorSource) -> Tensor:
        if source.has(hf_name):
            return source.get(hf_name)
        if key.kind.startswith("expert_"):
            # transformers 5 in memory: experts fused into [E, 2I, H] gate_up_proj / [E, H, I] down_proj
            p = f"model.layers.{key.layer}.mlp.experts."
            if key.kind == "expert_fc1" and source.has(p + "gate_up_proj"):
                gate, up = source.get(p + "gate_up_proj")[key.expert].chunk(2, dim=0)
                return gate if hf_name.endswith("gate_proj.weight") else up
            if key.kind == "expert_fc2" and source.has(p + "down_proj"):
                return source.get(p + "down_proj")[key.expert]
        raise KeyError(f"{source.description}: missing tensor {hf_name!r} (needed for Megatron {key})")

    def interleave_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ng, hd = self.num_groups, self.head_dim
        per = self.num_heads // ng
        hidden = q.shape[-1]
        for what, t, rows in (("q_proj", q, self.num_heads * hd), ("k_proj", k, ng * hd), ("v_proj", v, ng * hd)):
            if tuple(t.shape) != (rows, hidden):
                raise ValueError(f"{what}: expected shape {(rows, hidden)}, got {tuple(t.shape)}")
        return torch.cat([q.reshape(ng, per * hd, hidden), k.reshape(ng, hd, hidden), v.reshape(ng, hd, hidden)],
                         dim=1).reshape(ng * (per + 2) * hd, hidden)

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ng, hd = self.num_groups, self.head_dim
        per = self.num_heads // ng
        grouped = qkv.reshape(ng, (per + 2) * hd, qkv.shape[-1])
        q, k, v = grouped.split([per * hd, hd, hd], dim=1)
        return (q.reshape(-1, qkv.shape[-1]), k.reshape(-1, qkv.shape[-1]), v.reshape(-1, qkv.shape[-1]))

    # -- Megatron -> HF ---------------------------------------------------------------------
    def to_hf(self, name: str, full: Tensor) -> list[tuple[str, Tensor]]:
        """HF tensors of one full Megatron parameter (none for a tied output layer)."""
        key = parse_megatron_name(name)
        if key.kind == "lm_head" and self.tied:
            return []
        names = self.hf_names(key)
        if key.kind == "qkv":
            parts = self.split_qkv(full)
        elif key.kind in ("fc1", "expert_fc1"):
            if full.shape[0] % 2:
                raise ValueError(f"{name}: SwiGLU fc1 with an odd number of rows {full.shape[0]}")
            parts = full.chunk(2, dim=0)
        else:
            parts = (full,)
        return [(n, t.contiguous()) for n, t in zip(names, parts)]

    def expected_hf_names(self, megatron_names: list[str]) -> set[str]:
        """Every HF tensor name that a checkpoint of this model holds (per-expert layout)."""
        out: set[str] = set()
        for name in megatron_names:
            key = parse_megatron_name(name)
            if not (key.kind == "lm_head" and self.tied):
                out.update(self.hf_names(key))
        return out
