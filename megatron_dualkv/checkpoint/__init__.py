"""Checkpoint conversion: Hugging Face Qwen3 / Qwen3-MoE <-> the DualKV Megatron model.

    from megatron_dualkv.checkpoint import model_config_from_hf, load_hf_checkpoint, save_hf_checkpoint
    cfg = model_config_from_hf(hf_dir, params_dtype=torch.bfloat16)     # config.json -> ModelConfig
    model = build_dualkv_model(cfg, pg_collection=pgs)
    load_hf_checkpoint(model, hf_dir)                                    # shards for any TP/EP
    save_hf_checkpoint(model, out_dir, cfg)                              # gathers, rank 0 writes

Modules: hf_config (config mapping), qwen3_weights (names and tensor layout), sharding (TP/EP
placement of a live model's parameters), safetensors_io (lazy reading, sharded writing),
hf_qwen3 (import/export API). docs/CHECKPOINTS.md explains the choices. Importing this package
imports megatron.core; transformers is not needed (only safetensors).
"""

from .hf_config import hf_config_from_model_config, model_config_from_hf, moe_layer_pattern, read_hf_config
from .hf_qwen3 import (
    hf_to_megatron_state_dict,
    iter_full_megatron_state,
    iter_hf_state,
    load_full_state_dict,
    load_hf_checkpoint,
    megatron_state_dict_to_hf,
    save_hf_checkpoint,
)
from .qwen3_weights import Qwen3WeightMap, parse_megatron_name, qwen3_megatron_names
from .safetensors_io import HFTensorSource, copy_non_weight_files, write_hf_checkpoint
from .sharding import Placement, parameter_placements

__all__ = [
    "HFTensorSource", "Placement", "copy_non_weight_files", "Qwen3WeightMap", "hf_config_from_model_config", "hf_to_megatron_state_dict",
    "iter_full_megatron_state", "iter_hf_state", "load_full_state_dict", "load_hf_checkpoint",
    "megatron_state_dict_to_hf", "model_config_from_hf", "moe_layer_pattern", "parameter_placements",
    "parse_megatron_name", "qwen3_megatron_names", "read_hf_config", "save_hf_checkpoint", "write_hf_checkpoint",
]
