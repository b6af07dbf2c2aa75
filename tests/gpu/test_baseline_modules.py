"""GPU checks of the two no-TE modules (skipped without CUDA / sm_90): in bf16 on the GPU,
`GroupedGemmSequentialMLP` (`--moe-grouped-gemm`, torch's grouped GEMM) against Megatron's
SequentialMLP, and `SdpaDotProductAttention` (`--stock-attention sdpa`) against Megatron's
DotProductAttention. The truth is each Megatron module in float32 with the same weights; the new
module's bf16 error may not exceed SLACK x the Megatron module's own bf16 error (the CPU suite
checks exact equality in float32: tests/test_grouped_experts.py, tests/test_stock_sdpa_attention.py).

The comparisons are functions of (device, dtype) so that they can be run on the CPU as well
(`compare_experts("cpu", torch.bfloat16)`), which checks this file's own logic without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
gpu = pytest.mark.skipif(not _ok, reason="needs a CUDA GPU of sm_90 or later (torch's CUDA grouped GEMM: Hopper)")
SLACK = 1.5  # bf16 rounding of a different summation order: the same order of error, not more


@contextlib.contextmanager
def megatron_world():
    from megatron_cpu import cuda_rng_state_on_cpu, gloo_world_of_one, model_parallel

    with gloo_world_of_one(), cuda_rng_state_on_cpu(), model_parallel(tp=1) as collection:
        yield collection


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _run(fn, inputs, params, grad):
    """fn(*inputs) and the gradients of <fn, grad> with respect to the inputs and params."""
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, xs + list(params), grad.to(out.dtype))
    return [out.detach()] + list(grads)


def compare_experts(device: str, dtype: torch.dtype, tokens: int = 4096, experts: int = 16, fused: bool = True) -> dict:
    """Qwen3-30B-A3B expert sizes (hidden 2048, expert FFN 768, SwiGLU), `experts` local experts,
    `tokens` routed rows with uneven counts (one expert empty): relative errors of out, d(input),
    d(probs) and the expert weights, new and Megatron bf16 against Megatron float32."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_dualkv.megatron import qwen3_config
    from megatron_dualkv.megatron.grouped_experts import GroupedGemmSequentialMLP

    with megatron_world() as pgs:
        cfg = qwen3_config("30b-a3b", num_layers=1, use_cpu_initialization=True, params_dtype=torch.float32,
                           num_moe_experts=experts, moe_router_topk=2, bias_activation_fusion=fused).transformer
        spec = get_moe_module_spec(use_te=False, num_experts=experts).keywords["submodules"].experts
        torch.manual_seed(0)
        truth = spec(num_local_experts=experts, config=cfg, pg_collection=pgs).to(device)
        seq = spec(num_local_experts=experts, config=cfg, pg_collection=pgs)
        grouped = GroupedGemmSequentialMLP(num_local_experts=experts, config=cfg,
                                           submodules=spec.keywords["submodules"], pg_collection=pgs)
        for m in (seq, grouped):
            m.load_state_dict(truth.state_dict())
            m.to(device=device, dtype=dtype)
        g = torch.Generator().manual_seed(1)
        counts = torch.randint(1, 2 * tokens // experts, (experts,), generator=g)
        counts[3] = 0
        x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g).to(device)
        probs = torch.rand(x.shape[0], generator=g).to(device)
        grad = torch.randn(x.shape[0], cfg.hidden_size, generator=g).to(device)
        calls = []
        real = torch._grouped_mm
        torch._grouped_mm = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        try:
            # probabilities stay float32 (--moe-router-dtype fp32), the hidden rows are in dtype
            run = lambda m, dt: _run(lambda h, p: m(h, counts, p), [x.to(dt), probs],  # noqa: E731
                                     list(m.parameters()), grad)
            want, got_seq, got = run(truth, torch.float32), run(seq, dtype), run(grouped, dtype)
        finally:
            torch._grouped_mm = real
        names = ["out", "d_input", "d_probs"] + [n for n, _ in truth.named_parameters()]
        return {"grouped_calls": len(calls),
                "errors": {n: (_rel(a, w), _rel(b, w)) for n, a, b, w in zip(names, got, got_seq, want)}}


def compare_attention(device: str, dtype: torch.dtype, s: int = 2048, b: int = 2) -> dict:
    """Qwen3-8B attention heads (32 query heads, 8 KV groups, head dim 128), causal: relative errors
    of out, dq, dk, dv, SDPA and DotProductAttention in dtype against DotProductAttention float32."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dualkv.megatron import SdpaDotProductAttention, qwen3_config

    with megatron_world() as pgs:
        cfg = qwen3_config("8b", num_layers=1).transformer
        mk = lambda cls: cls(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)  # noqa: E731
        g = torch.Generator().manual_seed(2)
        q = torch.randn(s, b, 32, 128, generator=g).to(device)
        k = torch.randn(s, b, 8, 128, generator=g).to(device)
        v = torch.randn(s, b, 8, 128, generator=g).to(device)
        grad = torch.randn(s, b, 32 * 128, generator=g).to(device)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
        run = lambda cls, dt: _run(lambda *qkv: mk(cls)(*qkv, mask, attn_mask_type=AttnMaskType.causal),  # noqa: E731
                                   [t.to(dt) for t in (q, k, v)], [], grad)
        want = run(DotProductAttention, torch.float32)
        got, ref = run(SdpaDotProductAttention, dtype), run(DotProductAttention, dtype)
        return {n: (_rel(a, w), _rel(r, w)) for n, a, r, w in zip(("out", "dq", "dk", "dv"), got, ref, want)}


@gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused-weighted-swiglu", "unfused-swiglu"])
def test_grouped_experts_on_the_gpu_are_as_accurate_as_sequential_mlp(fused):
    res = compare_experts("cuda", torch.bfloat16, fused=fused)
    assert res["grouped_calls"] == 2, "the grouped path did not run on the GPU (it fell back)"
    for name, (new, megatron) in res["errors"].items():
        assert new <= SLACK * megatron + 1e-6, f"{name}: grouped {new:.2e} vs SequentialMLP {megatron:.2e}"


@gpu
def test_sdpa_attention_on_the_gpu_is_as_accurate_as_dot_product_attention():
    for name, (new, megatron) in compare_attention("cuda", torch.bfloat16).items():
        assert new <= SLACK * megatron + 1e-6, f"{name}: SDPA {new:.2e} vs DotProductAttention {megatron:.2e}"
