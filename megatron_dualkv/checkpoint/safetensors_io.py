"""Reading and writing Hugging Face safetensors checkpoints, one tensor at a time.

    src = HFTensorSource(hf_dir)              # model.safetensors or model.safetensors.index.json
    src = HFTensorSource(hf_model.state_dict())   # or tensors already in memory
    w = src.get("model.embed_tokens.weight")
    write_hf_checkpoint(out_dir, config_dict, named_tensors, max_shard_bytes=5 * 2**30)

Tensors are read lazily (safetensors memory-maps the files), so a rank reads only the tensors
it needs: under expert parallelism, only its own experts.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping, Optional, Union

from torch import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFTensorSource:
    """Named tensors of a HF checkpoint directory (safetensors, sharded or not) or a state dict."""

    def __init__(self, source: Union[str, os.PathLike, Mapping[str, Tensor]]):
        self._memory: Optional[Mapping[str, Tensor]] = None
        self._file_of: dict[str, str] = {}
        self._handles: dict = {}
        if isinstance(source, Mapping):
            self._memory = source
            self.description = "state dict"
            return
        path = os.fspath(source)
        self.description = path
        index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self._file_of = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors checkpoints are read)")

    def names(self) -> set[str]:
        return set(self._memory) if self._memory is not None else set(self._file_of)

    def has(self, name: str) -> bool:
        return name in (self._memory if self._memory is not None else self._file_of)

    def get(self, name: str) -> Tensor:
        if self._memory is not None:
            if name not in self._memory:
                raise KeyError(f"{self.description}: no tensor {name!r}")
            return self._memory[name]
        if name not in self._file_of:
            raise KeyError(f"{self.description}: no tensor {name!r}")
        fname = self._file_of[name]
        if fname not in self._handles:
            from safetensors import safe_open

            self._handles[fname] = safe_open(fname, framework="pt")
        return self._handles[fname].get_tensor(name)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def copy_non_weight_files(src_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike]) -> list[str]:
    """Copy the tokenizer, generation config and other small files of a HF checkpoint directory
    (everything but weights, weight indexes and config.json) so that inference engines can load
    the exported directory. Returns the copied names."""
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if (not os.path.isfile(path) or name == "config.json" or name.endswith(_WEIGHT_SUFFIXES)
                or name.endswith(".index.json")):
            continue
        shutil.copy2(path, os.path.join(out_dir, name))
        copied.append(name)
    return copied


def write_hf_checkpoint(
    out_dir: Union[str, os.PathLike],
    config: dict,
    tensors: Iterable[tuple[str, Tensor]],
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write config.json and the tensors as safetensors shards (an index when more than one).
    Tensors are consumed as they come; at most one shard is held in memory. Returns the file names."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    shards: list[dict[str, Tensor]] = [{}]
    size = total = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        part = shards.pop()
        if not part:
            return
        tmp = f"model-part-{len(files) + 1:05d}.safetensors"
        save_file(part, os.path.join(out_dir, tmp), metadata={"format": "pt"})
        files.append(tmp)
        weight_map.update({name: tmp for name in part})
        shards.append({})

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        if name in weight_map or name in shards[-1]:
            raise ValueError(f"tensor {name!r} written twice")
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        os.replace(os.path.join(out_dir, files[0]), os.path.join(out_dir, SINGLE_FILE))
        return ["config.json", SINGLE_FILE]
    # HF's shard naming: model-00001-of-0000N.safetensors
    final = {tmp: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, tmp in enumerate(files)}
    for tmp, name in final.items():
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, name))
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    return ["config.json", INDEX_FILE, *final.values()]

