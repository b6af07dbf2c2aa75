"""GroupedGemmSequentialMLP (`--moe-grouped-gemm` without TE) equals Megatron's SequentialMLP: the
module alone (outputs and every gradient, an expert without tokens, both activation branches) and a
DualKV MoE model with grouped experts against the replicated batch through the stock model with
SequentialMLP experts (single process, CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from test_megatron_model import FP32, VOCAB, _compare

from megatron_dualkv import build_layout
from megatron_dualkv.megatron import build_dualkv_model, build_replicated_model, copy_weights, qwen3_config
from megatron_dualkv.megatron.grouped_experts import GroupedGemmSequentialMLP


@pytest.fixture
def count_grouped_mm(monkeypatch):
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


def _experts(pgs, fused: bool):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    cfg = qwen3_config("tiny-moe", use_cpu_initialization=True, params_dtype=torch.float32, vocab_size=VOCAB,
                       bias_activation_fusion=fused).transformer
    experts_spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts).keywords["submodules"].experts
    torch.manual_seed(3)
    seq = experts_spec(num_local_experts=cfg.num_moe_experts, config=cfg, pg_collection=pgs)
    grouped = GroupedGemmSequentialMLP(num_local_experts=cfg.num_moe_experts, config=cfg,
                                       submodules=experts_spec.keywords["submodules"], pg_collection=pgs)
    grouped.load_state_dict(seq.state_dict())
    return cfg, seq, grouped


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-swiglu", "fused-weighted-swiglu"])
def test_grouped_experts_equal_sequential_mlp(pgs, count_grouped_mm, fused):
    cfg, seq, grouped = _experts(pgs, fused)
    counts = torch.tensor([5, 0, 9, 3][: cfg.num_moe_experts])  # expert 1 gets no token
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    grad = torch.randn(x.shape[0], cfg.hidden_size, generator=g)
    results = []
    for module in (seq, grouped):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = module(xi, counts, pi)
        assert bias is None
        out.backward(grad)
        results.append((out.detach(), xi.grad, pi.grad, {n: p.grad.clone() for n, p in module.named_parameters()}))
    assert len(count_grouped_mm) == 2  # fc1 and fc2 through grouped GEMMs, not the fallback
    (o1, gx1, gp1, gw1), (o2, gx2, gp2, gw2) = results
    torch.testing.assert_close(o2, o1, **FP32)
    torch.testing.assert_close(gx2, gx1, **FP32)
    torch.testing.assert_close(gp2, gp1, **FP32)
    assert gw1.keys() == gw2.keys()
    for name in gw1:  # every expert's fc1 and fc2 gradient, the token-less expert's zeros included
        torch.testing.assert_close(gw2[name], gw1[name], **FP32, msg=lambda m: f"{name}: {m}")
    assert gw2["local_experts.1.linear_fc1.weight"].abs().max() == 0


def test_grouped_experts_fall_back_where_grouped_gemm_does_not_apply(pgs, count_grouped_mm):
    cfg, seq, grouped = _experts(pgs, False)
    counts = torch.tensor([2, 1, 0, 3][: cfg.num_moe_experts])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, dtype=torch.float64)  # no float64 grouped GEMM
    seq.double(), grouped.double()
    probs = torch.rand(x.shape[0], dtype=torch.float64)
    torch.testing.assert_close(grouped(x, counts, probs)[0], seq(x, counts, probs)[0], rtol=0, atol=0)
    assert count_grouped_mm == []
    empty = torch.zeros(0, cfg.hidden_size, dtype=torch.float64)  # a rank without tokens
    assert grouped(empty, torch.zeros_like(counts), torch.zeros(0, dtype=torch.float64))[0].shape == (0, cfg.hidden_size)
    with pytest.raises(ValueError, match="tokens_per_expert has 3 entries"):
        grouped(x.float(), counts[:3], probs.float())


def test_grouped_experts_run_the_linears_pre_hooks_and_check_the_counts(pgs, count_grouped_mm):
    """Megatron DDP waits for an overlapped parameter all-gather in each module's forward pre-hook: the
    grouped path reads the linears' weights without calling them, so it must run those hooks; any
    other hook (forward, backward) sends it to SequentialMLP's forward."""
    cfg, seq, grouped = _experts(pgs, False)
    counts = torch.tensor([2, 1, 0, 3][: cfg.num_moe_experts])
    x, probs = torch.randn(int(counts.sum()), cfg.hidden_size), torch.rand(int(counts.sum()))
    seen = []
    for j, e in enumerate(grouped.local_experts):
        e.linear_fc1.register_forward_pre_hook(lambda m, args, j=j: seen.append(("fc1", j)))
        e.linear_fc2.register_forward_pre_hook(lambda m, args, j=j: seen.append(("fc2", j)))
    grouped(x, counts, probs)
    assert len(count_grouped_mm) == 2
    assert sorted(seen) == sorted((f, j) for j in range(cfg.num_moe_experts) for f in ("fc1", "fc2"))
    grouped.local_experts[0].linear_fc1.register_forward_hook(lambda m, args, out: None)
    torch.testing.assert_close(grouped(x, counts, probs)[0], seq(x, counts, probs)[0], **FP32)
    assert len(count_grouped_mm) == 2  # fell back
    with pytest.raises(ValueError, match="sums to 5, but 6 rows"):
        _experts(pgs, False)[2](x, counts - torch.tensor([0, 0, 0, 1][: cfg.num_moe_experts]), probs)


def test_layer_and_block_specs_choose_grouped_experts_only_when_asked(pgs):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_dualkv.megatron import get_dualkv_layer_spec
    from megatron_dualkv.megatron.specs import get_replicated_decoder_block_spec

    experts = lambda spec: spec.submodules.mlp.keywords["submodules"].experts.func  # noqa: E731
    assert experts(get_dualkv_layer_spec(num_experts=4, use_transformer_engine=False)) is SequentialMLP
    assert experts(get_dualkv_layer_spec(num_experts=4, moe_grouped_gemm=True,
                                         use_transformer_engine=False)) is GroupedGemmSequentialMLP
    cfg = qwen3_config("tiny-moe", moe_grouped_gemm=True).transformer
    block = get_replicated_decoder_block_spec(cfg, use_transformer_engine=False)
    assert all(experts(s) is GroupedGemmSequentialMLP for s in block.layer_specs)


def test_dualkv_moe_with_grouped_experts_equals_the_replicated_batch(pgs, three_groups, count_grouped_mm):
    """DualKV + grouped experts against the replicated batch through the stock model with Megatron's
    own SequentialMLP: logprobs, entropy and every gradient (same parameter names)."""
    kw = dict(use_cpu_initialization=True, params_dtype=torch.float32, vocab_size=VOCAB)
    torch.manual_seed(7)
    model = build_dualkv_model(qwen3_config("tiny-moe", moe_grouped_gemm=True, **kw), pg_collection=pgs,
                               use_transformer_engine=False)
    base = build_replicated_model(qwen3_config("tiny-moe", **kw), pg_collection=pgs, use_transformer_engine=False)
    assert any(isinstance(m, GroupedGemmSequentialMLP) for m in model.modules())
    assert not any(isinstance(m, GroupedGemmSequentialMLP) for m in base.modules())
    copy_weights(model, base)
    layout = build_layout(three_groups(6, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    _compare(model, base, layout, **FP32)
    assert len(count_grouped_mm) >= 2 * model.config.num_layers


@pytest.mark.parametrize("fused,rel", [(True, 0.01), (False, 0.03)], ids=["fused-weighted-swiglu", "unfused-swiglu"])
def test_the_planner_counts_the_stacked_expert_weights(pgs, fused, rel):
    """The grouped module's saved tensors (parameters excluded) exceed SequentialMLP's by its stacked
    weights: planner.stacked_expert_bytes (Implementation(experts='stacked')), bf16."""
    from megatron_dualkv.model_shape import ModelShape
    from megatron_dualkv.planner import Implementation, Parallel, stacked_expert_bytes

    cfg, seq, grouped = _experts(pgs, fused)
    seq.bfloat16(), grouped.bfloat16()
    counts = torch.tensor([5, 0, 9, 3][: cfg.num_moe_experts])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(x.shape[0], requires_grad=True)

    def saved_bytes(module):
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x, counts, probs)
        return sum(storages.values())

    extra = saved_bytes(grouped) - saved_bytes(seq)
    shape = ModelShape.of(cfg, VOCAB)
    predicted = stacked_expert_bytes(shape, Parallel(), Implementation(experts="stacked"))
    assert predicted > 0 and stacked_expert_bytes(shape, Parallel(), Implementation()) == 0
    assert abs(extra - predicted) <= rel * predicted, (extra, predicted)
