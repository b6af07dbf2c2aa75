"""Sequence-parallel-capable torch norms for Megatron's local spec (no Transformer Engine, no apex).

Megatron's torch-norm fallback (`WrappedTorchNorm`) refuses sequence parallelism, although the only
thing a norm needs for it is what TE's norms do: flag its parameters `sequence_parallel`, so that
`finalize_model_grads` sums their partial gradients (each TP rank normalised a slice of the
tokens) over the TP group. `SequenceParallelTorchNorm` is that fallback with the flag; without
sequence parallelism it builds exactly what `WrappedTorchNorm` builds. `with_sequence_parallel_norms`
swaps it into a layer or block spec wherever the spec names `WrappedTorchNorm`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """torch LayerNorm / RMSNorm (per config.normalization) usable under sequence parallelism."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, *args, **kwargs)
        if config.normalization not in _NORMS:
            raise ValueError(f"sequence parallelism without Transformer Engine or apex supports normalization "
                             f"{sorted(_NORMS)}, got {config.normalization!r}")
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"{flag} is not supported by torch norms (install Transformer Engine)")
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True  # finalize_model_grads: sum the partial grads over TP
        return norm


def map_spec(spec, fn):
    """A copy of a spec (ModuleSpec, submodules dataclass, partial, list) with every module
    reference x in it replaced by fn(x); containers are rebuilt, nothing else is touched."""
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=map_spec(spec.module, fn), submodules=map_spec(spec.submodules, fn))
    if isinstance(spec, functools.partial):
        return functools.partial(map_spec(spec.func, fn), *spec.args,
                                 **{k: map_spec(v, fn) for k, v in spec.keywords.items()})
    if isinstance(spec, (list, tuple)):
        return type(spec)(map_spec(s, fn) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: map_spec(getattr(spec, f.name), fn)
                                            for f in dataclasses.fields(spec) if f.init})
    return fn(spec)


def with_sequence_parallel_norms(spec):
    """A copy of a spec with every `WrappedTorchNorm` replaced by `SequenceParallelTorchNorm`."""
    return map_spec(spec, lambda x: SequenceParallelTorchNorm if x is WrappedTorchNorm else x)
