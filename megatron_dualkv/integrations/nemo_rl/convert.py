"""Turn a stock Megatron GPTModel (as NeMo-RL's worker builds it) into a DualKVGPTModel in place.

    to_dualkv_model(model)   # model: GPTModel, or DDP / Float16Module around one

NeMo-RL builds its policy through megatron-bridge before any extension code runs, so the worker
extension converts the built model instead of building its own: every self-attention's core
attention is replaced by DualKVCoreAttention (it has no parameters), every TopKRouter becomes a
DualKVTopKRouter (same parameters, token-weighted aux losses) and the model's class becomes
DualKVGPTModel. Parameters, buffers, DDP buffers, optimizer state and state_dict keys are untouched:
a core attention that had extra state (Transformer Engine's `_extra_state`, FP8 metadata) hands it
to its replacement, which keeps and returns it, so NeMo-RL's strict load_state_dict of the
reference weights and checkpoints see the same keys. Afterwards the model runs DualKV micro-batches (`model(layout=...)`) only: its
attention needs a layout, so padded [B, S] forwards (e.g. Megatron generation) no longer work.
"""

from __future__ import annotations

from typing import Any, Optional

from ...megatron import DualKVCoreAttention, DualKVGPTModel, DualKVTopKRouter
from .runner import unwrap


class _DualKVCoreAttentionKeepingExtraState(DualKVCoreAttention):
    """DualKVCoreAttention that carries the replaced module's extra state (it does not use it)."""

    def get_extra_state(self):
        return self._kept_extra_state

    def set_extra_state(self, state) -> None:
        self._kept_extra_state = state


def _has_extra_state(module) -> bool:
    import torch

    return type(module).get_extra_state is not torch.nn.Module.get_extra_state


def to_dualkv_model(model: Any, *, replicate_moe_aux_loss: bool = True,
                    attention_backend: Optional[str] = None) -> Any:
    """Convert in place and return `model` (the same object, wrappers kept)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.router import TopKRouter

    inner = unwrap(model)
    if isinstance(inner, DualKVGPTModel):
        return model
    if type(inner) is not GPTModel:
        raise TypeError(f"can convert a stock GPTModel only, got the subclass {type(inner).__name__}")
    if getattr(inner, "mtp_process", False):
        raise ValueError("DualKV does not support multi-token prediction (the model has an MTP block)")
    if inner.position_embedding_type not in ("rope", "none"):
        raise ValueError(f"DualKV supports rope (or no) position embeddings, got {inner.position_embedding_type!r}")
    for name, m in inner.named_modules():
        if isinstance(m, TopKRouter) and type(m) not in (TopKRouter, DualKVTopKRouter):
            raise TypeError(f"{name}: router {type(m).__name__} is not a stock TopKRouter; cannot make it DualKV")
        if isinstance(m, SelfAttention) and type(m) is not SelfAttention:
            raise TypeError(f"{name}: attention {type(m).__name__} is not Megatron's SelfAttention")

    routers = []
    for m in list(inner.modules()):
        if isinstance(m, SelfAttention):
            old = m.core_attention
            keep = _has_extra_state(old)
            cls = _DualKVCoreAttentionKeepingExtraState if keep else DualKVCoreAttention
            m.core_attention = cls(
                config=m.config, layer_number=m.layer_number, attn_mask_type=m.attn_mask_type,
                attention_type=m.attention_type, softmax_scale=m.config.softmax_scale,
                pg_collection=m.pg_collection, backend=attention_backend,
            )
            if keep:
                m.core_attention.set_extra_state(old.get_extra_state())
        elif isinstance(m, TopKRouter):
            if type(m) is TopKRouter:
                m.__class__ = DualKVTopKRouter  # adds behaviour only; the one new attribute is set here
                m._layout = None
            routers.append(m)
    inner.__class__ = DualKVGPTModel
    inner.replicate_moe_aux_loss = replicate_moe_aux_loss
    inner._dualkv_routers = routers
    return model
