"""Hugging Face Qwen3 / Qwen3-MoE checkpoints into and out of a (sharded) DualKV Megatron model.

    cfg = model_config_from_hf(hf_dir, params_dtype=torch.bfloat16, tensor_model_parallel_size=2)
    model = build_dualkv_model(cfg, pg_collection=pgs)
    load_hf_checkpoint(model, hf_dir)              # every rank reads and keeps only its shard
    ... train ...
    save_hf_checkpoint(model, out_dir, cfg)        # every rank calls; TP/EP shards are gathered,
                                                   # global rank 0 writes config.json + safetensors

Works for any TP / EP (and expert-TP) split: each local parameter is mapped to its full name
(sharding.py), the full tensor is built from the HF tensors (qwen3_weights.py) and cut to this
rank's shard; export gathers shards over the TP group and experts over the EP group, then
converts back. Import under pipeline parallelism works per stage (global layer numbers); export
needs PP = 1. Offline conversion without a model (full TP=1 state dicts): `hf_to_megatron_state_dict`
and `megatron_state_dict_to_hf` (tools/convert_hf_checkpoint.py uses them).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..megatron.config import ModelConfig
from .hf_config import hf_config_from_model_config, moe_layer_pattern
from .qwen3_weights import Qwen3WeightMap, qwen3_megatron_names
from .safetensors_io import HFTensorSource, copy_non_weight_files, write_hf_checkpoint
from .sharding import Placement, gather_experts, gather_full, parameter_placements, take_shard

Source = Union[str, os.PathLike, Mapping[str, Tensor], HFTensorSource]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _weight_map(model) -> Qwen3WeightMap:
    return Qwen3WeightMap(model.config, tied=bool(model.share_embeddings_and_output_weights))


def _as_source(source: Source) -> HFTensorSource:
    return source if isinstance(source, HFTensorSource) else HFTensorSource(source)


@torch.no_grad()
def _load_full(model, full_tensor: Callable[[str], Tensor], pg_collection=None) -> None:
    """Copy into every local parameter its shard of full_tensor(full name)."""
    places = parameter_placements(model, pg_collection)
    for name, param in model.named_parameters():
        p: Placement = places[name]
        local = take_shard(full_tensor(p.full_name), p)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(f"{name} (full {p.full_name}): checkpoint gives shape {tuple(local.shape)} on this rank, "
                             f"the model has {tuple(param.shape)}")
        param.copy_(local)


def check_hf_names(source: HFTensorSource, wmap: Qwen3WeightMap, transformer_config) -> None:
    """Refuse a checkpoint holding tensors this model would not use (a config/checkpoint mismatch)."""
    names = qwen3_megatron_names(transformer_config, wmap.tied, moe_layer_pattern(transformer_config))
    expected = wmap.expected_hf_names(names)
    allowed = set(expected)
    if wmap.tied:
        allowed.add("lm_head.weight")  # a tied model's in-memory state dict repeats the embedding
    for i, is_moe in enumerate(moe_layer_pattern(transformer_config)):
        if is_moe:  # transformers 5 in-memory fused experts
            allowed.update({f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"})
    unexpected = sorted(source.names() - allowed)
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"{source.description}: tensors the model has no place for: {unexpected[:5]}{more}; "
                         "does the model config match the checkpoint's config.json?")


def load_hf_checkpoint(model: torch.nn.Module, source: Source, pg_collection=None, strict: bool = True) -> None:
    """Load a HF Qwen3 / Qwen3-MoE checkpoint (directory or state dict) into this rank's shards.
    strict: also refuse checkpoint tensors that the model does not use."""
    model = _unwrap(model)
    src = _as_source(source)
    wmap = _weight_map(model)
    if strict:
        check_hf_names(src, wmap, model.config)
    _load_full(model, lambda full_name: wmap.to_megatron(full_name, src), pg_collection)


def load_full_state_dict(model: torch.nn.Module, state_dict: Mapping[str, Tensor], pg_collection=None) -> None:
    """Load a full (TP=1, EP=1) Megatron state dict, e.g. from hf_to_megatron_state_dict, into this rank's shards."""
    model = _unwrap(model)

    def full(name: str) -> Tensor:
        if name not in state_dict:
            raise KeyError(f"full state dict has no {name!r}")
        return state_dict[name]

    _load_full(model, full, pg_collection)


@torch.no_grad()
def iter_full_megatron_state(model: torch.nn.Module, pg_collection=None) -> Iterator[tuple[str, Tensor]]:
    """(full name, full tensor) of every parameter, gathered over TP and EP. A collective: every
    rank of the model-parallel group must consume the whole iterator, in step."""
    model = _unwrap(model)
    pgs = pg_collection if pg_collection is not None else model.pg_collection
    pp = getattr(pgs, "pp", None)
    if pp is not None and pp.size() > 1:
        raise ValueError("export needs pipeline parallel size 1 (gather the stages' layers first)")
    places = parameter_placements(model, pg_collection)
    for name, param in model.named_parameters():
        p = places[name]
        full = gather_full(param, p)
        if p.is_expert:
            yield from gather_experts(full, p)
        else:
            yield p.full_name, full


def iter_hf_state(model: torch.nn.Module, pg_collection=None, dtype: Optional[torch.dtype] = None
                  ) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of the whole model in the Hub's per-expert layout (collective, see above)."""
    wmap = _weight_map(_unwrap(model))
    for name, full in iter_full_megatron_state(model, pg_collection):
        for hf_name, t in wmap.to_hf(name, full):
            yield hf_name, (t if dtype is None else t.to(dtype))


def save_hf_checkpoint(model: torch.nn.Module, out_dir: Union[str, os.PathLike], model_config: ModelConfig,
                       pg_collection=None, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: int = 5 * 2**30,
                       copy_files_from: Optional[Union[str, os.PathLike]] = None) -> None:
    """Write a HF checkpoint (config.json + safetensors) of the model; every rank must call it,
    global rank 0 writes. dtype: of the written tensors (default: the model config's params_dtype).
    copy_files_from: a HF directory whose tokenizer / generation config files are copied along."""
    dtype = dtype or model_config.transformer.params_dtype
    tensors = iter_hf_state(model, pg_collection, dtype)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    if writer:
        write_hf_checkpoint(out_dir, hf_config_from_model_config(model_config, dtype), tensors, max_shard_bytes)
        if copy_files_from is not None:
            copy_non_weight_files(copy_files_from, out_dir)
    else:
        for _ in tensors:  # take part in the gathers
            pass
    if dist.is_initialized():
        dist.barrier()


# -- offline: full state dicts, no model -----------------------------------------------------

def hf_to_megatron_state_dict(source: Source, cfg: ModelConfig, dtype: Optional[torch.dtype] = None,
                              strict: bool = True) -> dict[str, Tensor]:
    """The full (TP=1, EP=1, local spec) Megatron state dict of a HF checkpoint."""
    src = _as_source(source)
    wmap = Qwen3WeightMap(cfg.transformer, cfg.share_embeddings_and_output_weights)
    if strict:
        check_hf_names(src, wmap, cfg.transformer)
    names = qwen3_megatron_names(cfg.transformer, cfg.share_embeddings_and_output_weights,
                                 moe_layer_pattern(cfg.transformer))
    out = {}
    for name in names:
        t = wmap.to_megatron(name, src)
        out[name] = t if dtype is None else t.to(dtype)
    return out


def megatron_state_dict_to_hf(state_dict: Mapping[str, Tensor], cfg: ModelConfig,
                              dtype: Optional[torch.dtype] = None) -> dict[str, Tensor]:
    """HF tensors (per-expert layout) of a full Megatron state dict (extra keys such as
    `_extra_state` are ignored; a missing parameter is an error)."""
    wmap = Qwen3WeightMap(cfg.transformer, cfg.share_embeddings_and_output_weights)
    names = qwen3_megatron_names(cfg.transformer, cfg.share_embeddings_and_output_weights,
                                 moe_layer_pattern(cfg.transformer))
    missing = [n for n in names if n not in state_dict]
    if missing:
        raise KeyError(f"Megatron state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out = {}
    for name in names:
        for hf_name, t in wmap.to_hf(name, state_dict[name]):
            out[hf_name] = t if dtype is None else t.to(dtype)
    return out
