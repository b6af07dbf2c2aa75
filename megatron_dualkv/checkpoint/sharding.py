"""Where each parameter of a live (TP/EP/PP-sharded) Megatron model sits in the full model.

    places = parameter_placements(model, pg_collection)   # local name -> Placement
    local = take_shard(full_tensor, places[name])         # import: full -> this rank's shard
    full = gather_full(local, places[name])               # export: collective over the TP group

Rules (megatron-core 0.19.2): a parameter flagged `tensor_model_parallel` is split evenly along
`partition_dim` over its tensor-parallel group (`pg_collection.tp`, or `expt_tp` for experts) in
rank order; a SwiGLU fc1 ([gate; up]) is split per half, so rank r holds [gate_r; up_r]
(megatron.core.transformer.mlp.apply_swiglu_sharded_factory). Expert parallelism gives EP rank r
the experts r*E/ep .. (r+1)*E/ep - 1 as local experts 0..E/ep-1 (MoELayer). Under pipeline
parallelism, layer names are renumbered from each layer's global `layer_number`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.)|(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


@dataclass(frozen=True)
class Placement:
    """One local parameter: its full name, how it is split over TP, which expert it is."""

    full_name: str
    dim: Optional[int]  # split dimension, None when the parameter is whole on this rank
    rank: int  # rank in the parameter's tensor-parallel group
    size: int  # size of that group
    gated: bool  # SwiGLU fc1: each half split separately
    group: object = None  # tensor-parallel group (tp or expt_tp)
    expert_local: Optional[int] = None  # local expert index (expert parameters only)
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    experts_per_rank: int = 0

    @property
    def is_expert(self) -> bool:
        return self.expert_local is not None


def _size(group) -> int:
    return group.size() if group is not None else 1


def _rank(group) -> int:
    return group.rank() if group is not None else 0


def parameter_placements(model: torch.nn.Module, pg_collection=None) -> dict[str, Placement]:
    """Placement of every parameter of `model` (a GPTModel / DualKVGPTModel, unwrapped)."""
    pgs = pg_collection if pg_collection is not None else model.pg_collection
    config = model.config
    tp_group = pgs.tp
    expt_tp_group = getattr(pgs, "expt_tp", None)
    ep_group = getattr(pgs, "ep", None)
    ep_size, ep_rank = _size(ep_group), _rank(ep_group)
    layers = list(model.decoder.layers) if hasattr(model, "decoder") else []
    out: dict[str, Placement] = {}
    for name, param in model.named_parameters():
        full = name
        m = _LOCAL_LAYER.match(name)
        if m:
            global_layer = layers[int(m.group(1))].layer_number - 1
            full = f"decoder.layers.{global_layer}." + name[m.end():]
        e = _LOCAL_EXPERT.search(full)
        expert_local = None
        if e:
            expert_local = int(e.group(2) if e.group(2) is not None else e.group(5))
            if config.num_moe_experts % ep_size:
                raise ValueError(f"{config.num_moe_experts} experts cannot be split over {ep_size} EP ranks")
            glob = ep_rank * (config.num_moe_experts // ep_size) + expert_local
            full = _with_expert(full, e, glob)
        group = expt_tp_group if expert_local is not None else tp_group
        size = _size(group)
        split = bool(getattr(param, "tensor_model_parallel", False)) and size > 1
        out[name] = Placement(
            full_name=full,
            dim=int(param.partition_dim) if split else None,
            rank=_rank(group),
            size=size,
            gated=split and bool(config.gated_linear_unit) and ".linear_fc1.weight" in full,
            group=group,
            expert_local=expert_local,
            ep_rank=ep_rank if expert_local is not None else 0,
            ep_size=ep_size if expert_local is not None else 1,
            ep_group=ep_group if expert_local is not None else None,
            experts_per_rank=(config.num_moe_experts // ep_size) if expert_local is not None else 0,
        )
    return out


def take_shard(full: Tensor, p: Placement) -> Tensor:
    """This rank's part of the full tensor."""
    if p.dim is None:
        return full
    if full.shape[p.dim] % (2 * p.size if p.gated else p.size):
        raise ValueError(f"{p.full_name}: dimension {p.dim} of size {full.shape[p.dim]} does not split over "
                         f"{p.size} tensor-parallel ranks{' (per SwiGLU half)' if p.gated else ''}")
    if p.gated:
        return torch.cat([half.chunk(p.size, p.dim)[p.rank] for half in full.chunk(2, p.dim)], p.dim)
    return full.chunk(p.size, p.dim)[p.rank]


def join_shards(parts: list[Tensor], p: Placement) -> Tensor:
    """Inverse of take_shard: the full tensor from the shards of all TP ranks (rank order)."""
    if p.dim is None:
        return parts[0]
    if p.gated:
        halves = [t.chunk(2, p.dim) for t in parts]
        return torch.cat([torch.cat([h[0] for h in halves], p.dim), torch.cat([h[1] for h in halves], p.dim)], p.dim)
    return torch.cat(parts, p.dim)


def _all_gather(t: Tensor, group) -> list[Tensor]:
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def gather_full(local: Tensor, p: Placement) -> Tensor:
    """The full tensor of a TP-split parameter (collective over its TP group; every rank must call)."""
    if p.dim is None:
        return local.detach()
    return join_shards(_all_gather(local, p.group), p)


def gather_experts(t: Tensor, p: Placement) -> list[tuple[str, Tensor]]:
    """(full name, tensor) of local expert `p.expert_local` of every EP rank (collective over the EP group)."""
    if not p.is_expert:
        raise ValueError(f"{p.full_name} is not an expert parameter")
    parts = _all_gather(t, p.ep_group) if p.ep_size > 1 else [t.detach()]
    return [(expert_name(p, r * p.experts_per_rank + p.expert_local), part) for r, part in enumerate(parts)]


def expert_name(p: Placement, global_expert: int) -> str:
    """p.full_name with its expert index replaced."""
    return _with_expert(p.full_name, _LOCAL_EXPERT.search(p.full_name), global_expert)


def _with_expert(name: str, e: re.Match, index: int) -> str:
    if e.group(1):
        return name[:e.start()] + f"{e.group(1)}{index}{e.group(3)}" + name[e.end():]
    return name[:e.start()] + f"{e.group(4)}{index}"
