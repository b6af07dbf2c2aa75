#!/usr/bin/env python
"""Convert Hugging Face Qwen3 / Qwen3-MoE checkpoints to a Megatron state dict file and back.

    # HF directory (config.json + safetensors) -> full (TP=1, EP=1) Megatron state dict file
    python tools/convert_hf_checkpoint.py import /path/to/Qwen3-8B qwen3-8b.mcore.pt [--dtype bfloat16]
    # Megatron state dict file -> HF directory (config.json + safetensors shards)
    python tools/convert_hf_checkpoint.py export qwen3-8b.mcore.pt /path/to/out [--dtype bfloat16] \
        [--copy-files-from /path/to/Qwen3-8B]      # tokenizer etc. for inference engines

The .pt file holds {"format", "hf_config", "state_dict"}: the parameter names of
`build_dualkv_model(model_config_from_hf(hf_config))` (local spec), so `model.load_state_dict(sd,
strict=False)` loads it at TP=1 and `megatron_dualkv.checkpoint.load_full_state_dict(model, sd)`
shards it for any TP/EP split. `export` also accepts a plain `model.state_dict()` file or a
Megatron legacy checkpoint ({"model": state_dict}) of a TP=1/EP=1/PP=1 model, with --hf-config.
Training code should rather call load_hf_checkpoint / save_hf_checkpoint on the live model (no
intermediate file, any parallel split); this tool is for offline conversion. Runs on a CPU and
holds the whole model in memory once.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

# run from a checkout without installing the package (python tools/<this>.py)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FORMAT = "megatron_dualkv/full-state-dict/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name):
    return None if name is None else DTYPES[name]


def cmd_import(args) -> None:
    from megatron_dualkv.checkpoint import hf_to_megatron_state_dict, model_config_from_hf, read_hf_config

    hf_config = read_hf_config(args.hf_dir)
    cfg = model_config_from_hf(hf_config)
    sd = hf_to_megatron_state_dict(args.hf_dir, cfg, dtype=_dtype(args.dtype))
    torch.save({"format": FORMAT, "hf_config": hf_config, "state_dict": sd}, args.out)
    n = sum(t.numel() for t in sd.values())
    print(f"wrote {args.out}: {len(sd)} tensors, {n / 1e6:.1f}M parameters ({cfg.transformer.num_layers} layers, "
          f"{'MoE ' + str(cfg.transformer.num_moe_experts) + ' experts' if cfg.transformer.num_moe_experts else 'dense'})")


def _load_megatron_file(path: str, hf_config_path):
    from megatron_dualkv.checkpoint import read_hf_config

    obj = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return obj["state_dict"], obj["hf_config"] if hf_config_path is None else read_hf_config(hf_config_path)
    sd = obj["model"] if isinstance(obj, dict) and isinstance(obj.get("model"), dict) else obj
    if hf_config_path is None:
        raise SystemExit(f"{path} carries no HF config: pass --hf-config (a config.json or a HF directory)")
    return sd, read_hf_config(hf_config_path)


def cmd_export(args) -> None:
    from megatron_dualkv.checkpoint import (
        copy_non_weight_files,
        hf_config_from_model_config,
        megatron_state_dict_to_hf,
        model_config_from_hf,
        write_hf_checkpoint,
    )

    sd, hf_config = _load_megatron_file(args.megatron_file, args.hf_config)
    cfg = model_config_from_hf(hf_config)
    tensors = megatron_state_dict_to_hf(sd, cfg, dtype=_dtype(args.dtype))
    dtype = _dtype(args.dtype) or next(iter(tensors.values())).dtype
    files = write_hf_checkpoint(args.out_dir, hf_config_from_model_config(cfg, dtype), tensors.items(),
                                max_shard_bytes=int(args.max_shard_mb * 2**20))
    if args.copy_files_from:
        files += copy_non_weight_files(args.copy_files_from, args.out_dir)
    print(f"wrote {args.out_dir}: {', '.join(files)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> Megatron state dict file")
    imp.add_argument("hf_dir")
    imp.add_argument("out", help="output .pt file")
    imp.add_argument("--dtype", choices=sorted(DTYPES), help="cast tensors (default: as stored)")
    imp.set_defaults(run=cmd_import)
    exp = sub.add_parser("export", help="Megatron state dict file -> HF directory")
    exp.add_argument("megatron_file")
    exp.add_argument("out_dir")
    exp.add_argument("--hf-config", help="config.json (or HF dir) when the file does not carry one")
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="cast tensors (default: as stored)")
    exp.add_argument("--copy-files-from", metavar="HF_DIR",
                     help="copy tokenizer / generation config files from this HF directory")
    exp.add_argument("--max-shard-mb", type=float, default=5 * 1024, help="safetensors shard size (default 5 GiB)")
    exp.set_defaults(run=cmd_export)
    args = parser.parse_args(argv)
    if args.command == "import" and not os.path.isdir(args.hf_dir):
        parser.error(f"{args.hf_dir} is not a directory")
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
