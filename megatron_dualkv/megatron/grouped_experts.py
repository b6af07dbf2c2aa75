"""MoE experts without Transformer Engine, computed by grouped GEMMs: `--moe-grouped-gemm` on the local spec.

Megatron's local spec always runs `SequentialMLP`: one fc1 and one fc2 GEMM per local expert in a
Python loop, small and serial (16 experts per layer at EP=8 for Qwen3-30B-A3B). With Transformer
Engine, `--moe-grouped-gemm` selects TE's grouped GEMMs; without it Megatron ignores the flag.
`GroupedGemmSequentialMLP` keeps SequentialMLP's modules, parameters, state-dict keys and
distributed checkpoint layout (so HF import/export, resume and the DDP buckets are unchanged) and
only replaces its forward: the local experts' fc1 weights stacked to [E, 2F, H] and fc2 weights
to [E, H, F], two `torch._grouped_mm` calls over the tokens grouped by expert (the dispatcher's
permuted order, `tokens_per_expert` rows each), the MLP's own activation and probability
weighting in between. Autograd takes the gradients back through the stack to every expert's weight;
the linears' forward pre-hooks run before their weights are read (Megatron DDP's overlapped
parameter all-gather waits there). The stacked weights are kept for backward: ~150 MB per layer
for Qwen3-30B-A3B at EP=8 in bf16 (one layer's expert weights again; planner.stacked_expert_bytes).

Where the grouped path does not apply (expert tensor parallelism, gradient accumulation fusion, hooks
other than forward pre-hooks on the linears, biases, FP8/FP4, a TE activation,
probabilities applied on the input, another activation; on CUDA anything but bf16 on sm_90+, on the
CPU float64) the SequentialMLP forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.moe.experts import SequentialMLP

try:  # Megatron's fused weighted SwiGLU (what MLP.forward runs under bias_activation_fusion)
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
except ImportError:  # pragma: no cover - older Megatron
    weighted_bias_swiglu_impl = None

_GROUPED_DTYPES = (torch.bfloat16, torch.float32)  # on the CPU (float64 is not offered)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward refuses
    expanded (stride-0) gradients such as the one of a plain `.sum()`."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def grouped_gemm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class GroupedGemmSequentialMLP(SequentialMLP):
    """SequentialMLP whose local experts run as two grouped GEMMs (see the module docstring)."""

    def _grouped_reason(self, hidden: Tensor) -> str | None:
        """Why the grouped path cannot run for this input (None: it can)."""
        cfg = self.config
        expert = self.local_experts[0]
        if not grouped_gemm_available():
            return "torch._grouped_mm is missing"
        if self.tp_group is not None and self.tp_group.size() > 1:
            return "expert tensor parallelism"
        if cfg.gradient_accumulation_fusion:  # its wgrad bypasses .grad; mixing both in one step would lose one
            return "gradient accumulation fusion"
        if any(m._forward_hooks or m._backward_hooks or m._backward_pre_hooks for m in self._expert_linears()):
            return "forward or backward hooks on the expert linears (e.g. Megatron-FSDP)"
        if cfg.add_bias_linear or cfg.fp8 or getattr(cfg, "fp4", None) or cfg.use_te_activation_func:
            return "biases, FP8/FP4 or a TE activation"
        if cfg.moe_apply_probs_on_input or not cfg.gated_linear_unit or expert.activation_func is not F.silu:
            return "not a SwiGLU expert with probabilities on the output"
        if getattr(cfg, "activation_func_clamp_value", None) is not None or getattr(cfg, "glu_linear_offset", 0.0):
            return "a clamped or offset GLU"
        if hidden.shape[0] == 0:  # an EP rank that received no token this micro-batch
            return "no tokens"
        if hidden.device.type == "cuda":  # torch's CUDA grouped GEMM: bf16 on Hopper and later
            if hidden.dtype != torch.bfloat16 or torch.cuda.get_device_capability(hidden.device) < (9, 0):
                return f"{hidden.dtype} on sm_{''.join(map(str, torch.cuda.get_device_capability(hidden.device)))}"
        elif hidden.device.type != "cpu" or hidden.dtype not in _GROUPED_DTYPES:
            return f"{hidden.dtype} on {hidden.device.type}"
        return None

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
        hidden = permuted_local_hidden_states
        if self._grouped_reason(hidden) is not None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert, device=hidden.device)
        if counts.numel() != self.num_local_experts:
            raise ValueError(f"tokens_per_expert has {counts.numel()} entries for {self.num_local_experts} local experts")
        total = int(counts.sum())  # a host sync, as SequentialMLP's split
        if total != hidden.shape[0]:
            raise ValueError(f"tokens_per_expert sums to {total}, but {hidden.shape[0]} rows were dispatched")
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of every expert's group
        # The linears' weights are read without calling the linears: run their forward pre-hooks, which
        # is where Megatron's DDP waits for an overlapped parameter all-gather (--overlap-param-gather)
        for linear in self._expert_linears():
            for hook in linear._forward_pre_hooks.values():
                hook(linear, (hidden,))
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2F, H]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, F]
        x = torch._grouped_mm(hidden, fc1.transpose(-2, -1), offs=offsets)   # [T, 2F]
        x = self._weighted_swiglu(_ContiguousGrad.apply(x), permuted_probs)
        out = torch._grouped_mm(x, fc2.transpose(-2, -1), offs=offsets)      # [T, H]
        return _ContiguousGrad.apply(out), None

    def _expert_linears(self):
        for e in self.local_experts:
            yield e.linear_fc1
            yield e.linear_fc2

    def _weighted_swiglu(self, x: Tensor, probs: Tensor) -> Tensor:
        """MLP.forward's activation for a SwiGLU expert with per-token probabilities, both of its
        branches (the fused kernel under bias_activation_fusion, else silu(gate) * up * prob)."""
        if self.config.bias_activation_fusion:
            if weighted_bias_swiglu_impl is None:
                raise RuntimeError("bias_activation_fusion needs megatron.core.fusions.fused_bias_swiglu")
            return weighted_bias_swiglu_impl(x, None, probs.unsqueeze(-1), self.config.activation_func_fp8_input_store)
        gate, up = torch.chunk(x, 2, dim=-1)
        y = self.config.activation_func(gate) * up
        return (y * probs.unsqueeze(-1)).to(y.dtype)
