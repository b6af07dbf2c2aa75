"""DualKV Megatron model == the replicated batch through stock Megatron (single process, CPU).

Every comparison builds a DualKVGPTModel and a stock GPTModel (local spec) with the same weights,
runs a packed micro-batch of several groups (different P and R_i, R_i = 1, padding, GQA) through
the first and the replicated batch ([prompt | response] rows, bshd, causal) through the second,
and compares logprobs, entropy, a scalar loss and EVERY parameter gradient. Negative controls
show that a wrong mask, wrong rotary positions or wrong loss edges would fail these comparisons.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_dualkv import Group, SegmentTable, build_layout
from megatron_dualkv.megatron import (
    DualKVCoreAttention,
    build_dualkv_model,
    build_replicated_model,
    copy_weights,
    megatron_softmax_scale,
    qwen3_config,
    replicated_logprobs,
    vocab_parallel_logprobs,
)

VOCAB = 256
FP32 = dict(rtol=2e-5, atol=2e-6)


def _pair(pgs, size="tiny", dtype=torch.float32, **overrides):
    cfg = qwen3_config(size, use_cpu_initialization=True, params_dtype=dtype, vocab_size=VOCAB, **overrides)
    torch.manual_seed(7)
    model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    base = build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    # perturb the norm weights so that a missing gradient path through them would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    copy_weights(model, base)
    if dtype == torch.float64:
        model.double(), base.double()
    return model, base


def _loss(out, weights):
    loss = (out.logprobs * weights[0]).sum()
    if out.entropy is not None:
        loss = loss + 0.3 * (out.entropy * weights[1]).sum()
    return loss


def _assert_grads_equal(model, base, rtol, atol):
    got = dict(model.named_parameters())
    want = dict(base.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert p.grad is not None, f"replicated model has no gradient for {name}"
        assert got[name].grad is not None, f"DualKV model has no gradient for {name}"
        torch.testing.assert_close(got[name].grad, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _compare(model, base, layout, *, rtol, atol, temperature=1.0, with_entropy=True):
    out = model(layout=layout, temperature=temperature, with_entropy=with_entropy)
    ref = replicated_logprobs(base, layout, temperature=temperature, with_entropy=with_entropy)
    assert out.logprobs.shape == (layout.num_edges,)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=rtol, atol=atol)
    if with_entropy:
        torch.testing.assert_close(out.entropy, ref.entropy, rtol=rtol, atol=atol)
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(2, layout.num_edges, generator=g)
    _loss(out, weights).backward()
    _loss(ref, weights).backward()
    _assert_grads_equal(model, base, rtol, atol)
    return out, ref


# ------------------------------------------------------------------------------------------------
# equality with the replicated batch
# ------------------------------------------------------------------------------------------------


def test_dense_logprobs_entropy_and_every_gradient_match_replicated(pgs, three_groups):
    model, base = _pair(pgs)
    assert model.config.num_query_groups < model.config.num_attention_heads  # GQA
    layout = build_layout(three_groups(0, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)  # with padding rows
    assert layout.num_tokens > layout.num_real_tokens
    _compare(model, base, layout, **FP32)


def test_temperature_divides_logits_first(pgs, three_groups):
    model, base = _pair(pgs)
    layout = build_layout(three_groups(1, VOCAB), vocab_size=VOCAB)
    out, ref = _compare(model, base, layout, temperature=0.7, **FP32)
    plain = model(layout=layout).logprobs
    assert not torch.allclose(plain, out.logprobs, rtol=1e-3, atol=1e-4)


def test_float64_matches_to_double_rounding(pgs, three_groups):
    model, base = _pair(pgs, dtype=torch.float64)
    layout = build_layout(three_groups(2, VOCAB), vocab_size=VOCAB, pad_to_multiple=4)
    out = model(layout=layout)
    ref = replicated_logprobs(base, layout)
    assert out.logprobs.dtype == torch.float64
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-12, atol=1e-12)
    w = torch.randn(layout.num_edges, dtype=torch.float64)
    (out.logprobs * w).sum().backward()
    (ref.logprobs * w).sum().backward()
    _assert_grads_equal(model, base, rtol=1e-10, atol=1e-12)


def _moe_metrics():
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    values = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
    tracker.clear()
    return values


def test_moe_aux_loss_logprobs_and_every_gradient_match_replicated(pgs, three_groups):
    model, base = _pair(pgs, "tiny-moe")
    assert model.config.moe_aux_loss_coeff > 0
    layout = build_layout(three_groups(4, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    _moe_metrics()
    out = model(layout=layout, with_entropy=True)
    got = _moe_metrics()
    ref = replicated_logprobs(base, layout, with_entropy=True)
    want = _moe_metrics()
    torch.testing.assert_close(out.logprobs, ref.logprobs, **FP32)
    assert set(want) >= {"load_balancing_loss"}
    for name in want:
        assert want[name].abs().sum() > 0
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    w = torch.randn(2, layout.num_edges)
    _loss(out, w).backward()
    _loss(ref, w).backward()
    _assert_grads_equal(model, base, **FP32)

    # the weighting is what makes them equal: unweighted, the load-balancing loss and the router
    # gradients differ by far more than the tolerances above
    router_grads = {n: p.grad.clone() for n, p in base.named_parameters() if "router" in n}
    model.zero_grad()
    model.replicate_moe_aux_loss = False
    _loss(model(layout=layout, with_entropy=True), w).backward()
    unweighted = _moe_metrics()["load_balancing_loss"]
    assert (unweighted - want["load_balancing_loss"]).abs().max() > 1e-4
    params = dict(model.named_parameters())
    assert any(not torch.allclose(params[n].grad, g, **FP32) for n, g in router_grads.items())


def test_moe_seq_and_global_aux_loss_and_z_loss_match_replicated(pgs, three_groups):
    model, base = _pair(
        pgs, "tiny-moe",
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 2e-2, 3e-2],
        moe_z_loss_coeff=1e-2,
    )
    layout = build_layout(three_groups(5, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    _moe_metrics()
    out = model(layout=layout)
    got = _moe_metrics()
    ref = replicated_logprobs(base, layout)
    want = _moe_metrics()
    assert {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"} <= set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    w = torch.randn(layout.num_edges)
    (out.logprobs * w).sum().backward()
    (ref.logprobs * w).sum().backward()
    _assert_grads_equal(model, base, **FP32)


def test_moe_expert_bias_counts_and_sigmoid_router_match_replicated(pgs):
    model, base = _pair(pgs, "tiny-moe", moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    # replicated rows of equal length (8): stock Megatron 0.19 cannot update expert-bias counts
    # with a padding mask (broadcast bug), so the baseline must need none; DualKV pads anyway
    g = torch.Generator().manual_seed(10)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    groups = [Group.of(ids(5), [ids(3), ids(3)]), Group.of(ids(2), [ids(6)]), Group.of(ids(7), [ids(1), ids(1)])]
    layout = build_layout(groups, vocab_size=VOCAB, pad_to_multiple=8)
    assert layout.num_tokens > layout.num_real_tokens
    out = model(layout=layout)
    ref = replicated_logprobs(base, layout)
    torch.testing.assert_close(out.logprobs, ref.logprobs, **FP32)
    routers = lambda m: [mod for mod in m.modules() if hasattr(mod, "local_tokens_per_expert")]
    counts = [r.local_tokens_per_expert.clone() for r in routers(model)]
    want = [r.local_tokens_per_expert.clone() for r in routers(base)]
    assert len(counts) == len(want) == 2
    for a, b in zip(counts, want):
        assert b.sum() == layout.replicated_num_tokens() * model.config.moe_router_topk
        torch.testing.assert_close(a, b)
    w = torch.randn(layout.num_edges)
    (out.logprobs * w).sum().backward()
    (ref.logprobs * w).sum().backward()
    _assert_grads_equal(model, base, **FP32)


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
    ],
    ids=["full", "selective"],
)
def test_activation_recomputation_keeps_equality(pgs, recompute, three_groups):
    """Recomputed layers read the layout (attention) and token weights (router) again in backward."""
    model, base = _pair(pgs, "tiny-moe", **recompute)
    layout = build_layout(three_groups(11, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    _compare(model, base, layout, **FP32)


# ------------------------------------------------------------------------------------------------
# the comparisons above would catch a wrong mask, wrong positions, wrong loss edges
# ------------------------------------------------------------------------------------------------


def _differs(a, b):
    return not torch.allclose(a, b, rtol=1e-3, atol=1e-4)


def test_wrong_rotary_positions_would_fail(pgs, three_groups):
    model, base = _pair(pgs)
    layout = build_layout(three_groups(6, VOCAB), vocab_size=VOCAB)
    ref = replicated_logprobs(base, layout).logprobs
    torch.testing.assert_close(model(layout=layout).logprobs, ref, **FP32)
    # packed offsets (what stock THD RoPE would use over one packed sequence) instead of P..P+R_i-1
    packed = dataclasses.replace(layout, position_ids=torch.arange(layout.num_tokens), _cache={})
    assert _differs(model(layout=packed).logprobs, ref)
    # responses off by one against their prompt (P+1..P+R_i); shifting every position alike would
    # change nothing, RoPE being relative
    is_response = layout.segments.parent.long()[layout.segments.token_segment_ids()] >= 0
    shifted = dataclasses.replace(layout, position_ids=layout.position_ids + is_response.long(), _cache={})
    assert _differs(model(layout=shifted).logprobs, ref)
    uniform = dataclasses.replace(layout, position_ids=layout.position_ids + 3, _cache={})
    torch.testing.assert_close(model(layout=uniform).logprobs, ref, **FP32)


def test_wrong_attention_mask_would_fail(pgs, three_groups):
    model, base = _pair(pgs)
    layout = build_layout(three_groups(7, VOCAB), vocab_size=VOCAB)
    ref = replicated_logprobs(base, layout).logprobs
    seg = layout.segments
    # responses that do not see their prompt
    orphan = SegmentTable.from_host(seg.host_start, seg.host_length, [-1] * seg.num_segments)
    assert _differs(model(layout=dataclasses.replace(layout, segments=orphan, _cache={})).logprobs, ref)
    # one causal sequence over the whole pack (responses see earlier responses)
    causal = SegmentTable.from_host([0], [seg.num_tokens], [-1])
    assert _differs(model(layout=dataclasses.replace(layout, segments=causal, _cache={})).logprobs, ref)


def test_wrong_loss_edges_would_fail(pgs, three_groups):
    model, base = _pair(pgs)
    layout = build_layout(three_groups(8, VOCAB), vocab_size=VOCAB)
    ref = replicated_logprobs(base, layout).logprobs
    # predict each token from its own row instead of the row before it
    own_row = dataclasses.replace(layout, source_rows=layout.target_rows, _cache={})
    assert _differs(model(layout=own_row).logprobs, ref)
    # first response tokens predicted from the response's first row instead of the last prompt row
    first = torch.tensor(layout.response_edge_offsets[:-1])
    src = layout.source_rows.clone()
    src[first] = layout.target_rows[first]
    assert _differs(model(layout=dataclasses.replace(layout, source_rows=src, _cache={})).logprobs[first], ref[first])


# ------------------------------------------------------------------------------------------------
# pieces
# ------------------------------------------------------------------------------------------------


def test_logits_only_at_loss_edges(pgs, three_groups):
    model, _ = _pair(pgs)
    layout = build_layout(three_groups(9, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    rows = []
    handle = model.output_layer.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    try:
        model(layout=layout)
    finally:
        handle.remove()
    # one output-layer call on E rows: the last prompt row once per response, never other prompt rows
    assert rows == [layout.num_edges]
    assert layout.num_edges == sum(layout.response_lengths) < layout.num_tokens


def test_vocab_parallel_logprobs_match_torch_in_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 5, 5, 1])
    lp, ent = vocab_parallel_logprobs(logits, targets, None, with_entropy=True)
    logp = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(lp, logp.gather(1, targets[:, None]).squeeze(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1), rtol=1e-12, atol=1e-12)
    assert lp.dtype == torch.float64
    assert vocab_parallel_logprobs(logits.detach().half(), targets)[0].dtype == torch.float32

    # the custom backward against autograd through torch's log_softmax
    w = torch.randn(2, 6, dtype=torch.float64, generator=g)
    (lp * w[0] + ent * w[1]).sum().backward()
    x = logits.detach().clone().requires_grad_(True)
    ref_lp = torch.log_softmax(x, -1).gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(torch.log_softmax(x, -1).exp() * torch.log_softmax(x, -1)).sum(-1)
    (ref_lp * w[0] + ref_ent * w[1]).sum().backward()
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-10, atol=1e-12)


def test_core_attention_without_layout_is_a_clear_error(pgs, three_groups):
    model, _ = _pair(pgs)
    layout = build_layout(three_groups(0, VOCAB), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="needs the micro-batch layout"):
        model(layout.input_ids[None], layout.position_ids[None], None)


def test_softmax_scale_is_megatrons(pgs):
    cfg = qwen3_config("tiny").transformer
    assert megatron_softmax_scale(cfg, None) == pytest.approx(1 / math.sqrt(cfg.kv_channels))
    assert megatron_softmax_scale(cfg, 0.25) == 0.25
    scaled = dataclasses.replace(cfg, apply_query_key_layer_scaling=True, fp16=True, params_dtype=torch.float16)
    attn = DualKVCoreAttention(scaled, layer_number=3, attn_mask_type=None, attention_type="self", softmax_scale=None)
    assert attn.softmax_scale == pytest.approx(1 / math.sqrt(cfg.kv_channels))  # layer scaling cancels
    with pytest.raises(ValueError, match="attention dropout"):
        DualKVCoreAttention(dataclasses.replace(cfg, attention_dropout=0.1), 1, None, "self")


def test_qwen3_configs():
    c8 = qwen3_config("8b")
    t = c8.transformer
    assert (t.num_layers, t.hidden_size, t.ffn_hidden_size, t.num_attention_heads, t.num_query_groups, t.kv_channels) == (36, 4096, 12288, 32, 8, 128)
    assert (c8.vocab_size, c8.rotary_base, c8.share_embeddings_and_output_weights) == (151936, 1_000_000, False)
    assert t.normalization == "RMSNorm" and t.layernorm_epsilon == 1e-6 and t.qk_layernorm and t.gated_linear_unit
    assert not t.add_bias_linear
    moe = qwen3_config("30b-a3b")
    m = moe.transformer
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == (48, 2048, 32, 4, 128)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_aux_loss_coeff) == (128, 8, 768, 1e-3)
    assert m.moe_token_dispatcher_type == "alltoall"
    assert qwen3_config("tiny", num_layers=3, vocab_size=512).vocab_size == 512
    with pytest.raises(ValueError, match="unknown size"):
        qwen3_config("70b")
    with pytest.raises(ValueError, match="unknown fields"):
        qwen3_config("tiny", not_a_field=1)


def test_specs_swap_only_core_attention_and_router(pgs):  # pgs: block specs ask the pipeline group
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_dualkv.megatron import DualKVTopKRouter, get_dualkv_decoder_block_spec, get_dualkv_layer_spec
    from megatron_dualkv.megatron.specs import get_replicated_decoder_block_spec

    dense = get_dualkv_layer_spec(qk_layernorm=True, normalization="RMSNorm", use_transformer_engine=False)
    assert dense.submodules.self_attention.submodules.core_attention is DualKVCoreAttention
    moe = get_dualkv_layer_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm", use_transformer_engine=False)
    assert moe.submodules.mlp.keywords["submodules"].router is DualKVTopKRouter
    cfg = qwen3_config("tiny-moe").transformer
    ours = get_dualkv_decoder_block_spec(cfg, use_transformer_engine=False)
    stock = get_replicated_decoder_block_spec(cfg, use_transformer_engine=False)
    for a, b in zip(ours.layer_specs, stock.layer_specs):
        sa, sb = a.submodules, b.submodules
        assert sa.self_attention.submodules.core_attention is DualKVCoreAttention
        assert sb.mlp.keywords["submodules"].router is TopKRouter
        assert sa.mlp.keywords["submodules"].router is DualKVTopKRouter
        assert sa.self_attention.submodules.q_layernorm is sb.self_attention.submodules.q_layernorm
        assert sa.input_layernorm is sb.input_layernorm and sa.pre_mlp_layernorm is sb.pre_mlp_layernorm
    from megatron_dualkv.megatron import transformer_engine_available

    if transformer_engine_available():  # the run-time choice picks TE, with our core attention
        te = get_dualkv_decoder_block_spec(cfg)
        assert all(s.submodules.self_attention.submodules.core_attention is DualKVCoreAttention for s in te.layer_specs)
    else:
        with pytest.raises(ValueError, match="Transformer Engine is not importable"):
            get_dualkv_layer_spec(use_transformer_engine=True)


def test_refusals_name_the_problem(pgs, three_groups):
    layout = build_layout(three_groups(0, VOCAB), vocab_size=VOCAB)
    model, _ = _pair(pgs, "tiny-moe", moe_expert_capacity_factor=1.0)
    with pytest.raises(ValueError, match="token dropping"):
        model(layout=layout)
    model, _ = _pair(pgs)
    with pytest.raises(ValueError, match="temperature"):
        model(layout=layout, temperature=0.0)
    with pytest.raises(ValueError, match=r"input_ids must be \[1, "):
        model(layout.input_ids[None, :-1], layout=layout)
    with pytest.raises(TypeError, match="builds labels itself"):
        model(layout=layout, labels=layout.input_ids[None])


def test_core_attention_hands_dense_tensors_to_the_kernels(pgs, monkeypatch, three_groups):
    """Megatron splits the fused QKV into strided views; the CUDA kernels take only dense
    [T, H, D] rows (found on the GPU: a training step failed with 'v is not contiguous')."""
    import megatron_dualkv.megatron.core_attention as ca

    seen = []
    real = ca.dualkv_attention

    def checking(q, k, v, *args, **kwargs):
        seen.append(tuple(t.is_contiguous() for t in (q, k, v)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(ca, "dualkv_attention", checking)
    model, _ = _pair(pgs)
    model(layout=build_layout(three_groups(0, VOCAB), vocab_size=VOCAB))
    assert seen and all(all(s) for s in seen), seen


@pytest.mark.parametrize("mode", [False, True])
def test_core_attention_follows_deterministic_mode(pgs, monkeypatch, three_groups, mode):
    """Megatron's config.deterministic_mode reaches the attention entry point of every layer (the
    cuda kernel's bitwise reproducible backward; found missing: nothing passed it on)."""
    import megatron_dualkv.megatron.core_attention as ca

    seen = []
    real = ca.dualkv_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ca, "dualkv_attention", recording)
    model, _ = _pair(pgs, deterministic_mode=mode)
    model(layout=build_layout(three_groups(0, VOCAB), vocab_size=VOCAB))
    assert len(seen) == model.config.num_layers and all(s is mode for s in seen), seen


def test_a_micro_batch_is_freed_without_the_garbage_collector(pgs, three_groups):
    """Nothing a forward/backward caches on a layout refers back to it: with the collector off
    (Megatron's --manual-gc), dropping the layout frees it and its cached device tensors at once.
    (The packed-sequence params, which hold the layout, were once cached on it: a cycle.)"""
    import gc
    import weakref

    model, _ = _pair(pgs)
    layout = build_layout(three_groups(0, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    gc.collect()
    gc.disable()
    try:
        out = model(layout=layout, with_entropy=True)
        _loss(out, torch.ones(2, layout.num_edges)).backward()
        ref = weakref.ref(layout)
        del layout, out
        assert ref() is None, f"the layout outlives its last reference: {gc.get_referrers(ref())}"
    finally:
        gc.enable()
