"""`--no-dualkv --stock-attention sdpa`: the stock GPTModel with torch SDPA as its core attention
equals the DualKV model and the stock model with Megatron's unfused attention (single process, CPU;
right-padded rows of different lengths, GQA, dense and MoE)."""

from __future__ import annotations

import pytest
import torch

from test_megatron_model import FP32, VOCAB, _compare

from megatron_dualkv import build_layout
from megatron_dualkv.megatron import build_dualkv_model, build_replicated_model, copy_weights, qwen3_config
from megatron_dualkv.megatron.sdpa_attention import SdpaDotProductAttention
from megatron_dualkv.megatron.specs import STOCK_ATTENTIONS, get_replicated_decoder_block_spec


def _models(pgs, size):
    cfg = qwen3_config(size, use_cpu_initialization=True, params_dtype=torch.float32, vocab_size=VOCAB)
    torch.manual_seed(11)
    model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    unfused = build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    sdpa = build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False, stock_attention="sdpa")
    copy_weights(model, unfused)
    copy_weights(model, sdpa)
    return model, unfused, sdpa


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_sdpa_baseline_equals_dualkv_and_the_unfused_baseline(pgs, three_groups, size):
    model, unfused, sdpa = _models(pgs, size)
    cores = [m for m in sdpa.modules() if isinstance(m, SdpaDotProductAttention)]
    assert len(cores) == model.config.num_layers  # every layer's core attention swapped
    assert not any(isinstance(m, SdpaDotProductAttention) for m in unfused.modules())
    assert model.config.num_query_groups < model.config.num_attention_heads  # GQA
    layout = build_layout(three_groups(4, VOCAB), vocab_size=VOCAB, pad_to_multiple=8)
    # the rows differ in length (P + R_i from 3 to 9): right padding inside the replicated batch
    _, ref_sdpa = _compare(model, sdpa, layout, **FP32)
    model.zero_grad()
    _, ref_unfused = _compare(model, unfused, layout, **FP32)
    torch.testing.assert_close(ref_sdpa.logprobs, ref_unfused.logprobs, **FP32)


@pytest.mark.parametrize("layer_scaling", [False, True])
def test_sdpa_module_equals_dot_product_attention_with_gqa_and_layer_scaling(pgs, layer_scaling):
    """The module alone against Megatron's DotProductAttention (layer 3: apply_query_key_layer_scaling
    divides the scale by 3 and its softmax multiplies it back), forward and input gradients."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg = dataclasses.replace(qwen3_config("tiny").transformer, apply_query_key_layer_scaling=layer_scaling)
    ours = SdpaDotProductAttention(cfg, 3, AttnMaskType.causal, "self", pg_collection=pgs)
    ref = DotProductAttention(cfg, 3, AttnMaskType.causal, "self", pg_collection=pgs)
    g = torch.Generator().manual_seed(5)
    s, b, d = 9, 2, cfg.kv_channels
    q = torch.randn(s, b, cfg.num_attention_heads, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, cfg.num_query_groups, d, generator=g, requires_grad=True)  # GQA
    v = torch.randn(s, b, cfg.num_query_groups, d, generator=g, requires_grad=True)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    grad = torch.randn(s, b, cfg.num_attention_heads * d, generator=g)
    outs, grads = [], []
    for module in (ours, ref):
        out = module(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
        (gq, gk, gv) = torch.autograd.grad(out, (q, k, v), grad)
        outs.append(out)
        grads.append((gq, gk, gv))
    torch.testing.assert_close(outs[0], outs[1], **FP32)
    for a, r in zip(*grads):
        torch.testing.assert_close(a, r, **FP32)


def test_sdpa_refuses_what_it_does_not_compute():
    from megatron.core.transformer.enums import AttnMaskType

    cfg = qwen3_config("tiny").transformer
    with pytest.raises(ValueError, match="causal attention only"):
        SdpaDotProductAttention(cfg, 1, AttnMaskType.no_mask, "self")
    with pytest.raises(ValueError, match="causal attention only"):  # it would ignore the padding mask
        SdpaDotProductAttention(cfg, 1, AttnMaskType.padding_causal, "self")
    with pytest.raises(ValueError, match="no attention dropout"):
        SdpaDotProductAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    with pytest.raises(ValueError, match="stock_attention must be one of"):
        get_replicated_decoder_block_spec(cfg, use_transformer_engine=False, stock_attention="flash")


def test_training_arguments_offer_the_same_choices_and_refuse_sdpa_for_dualkv():
    from megatron_dualkv.training import args as targs

    assert targs.STOCK_ATTENTIONS == STOCK_ATTENTIONS
    parser = targs.add_dualkv_args(__import__("argparse").ArgumentParser())
    ns = parser.parse_args(["--stock-attention", "sdpa"])
    ns.pipeline_model_parallel_size = ns.context_parallel_size = ns.micro_batch_size = 1
    with pytest.raises(ValueError, match="--stock-attention sdpa chooses the core attention of the --no-dualkv"):
        targs.check_parallelism(ns)
    ns.no_dualkv = True
    targs.check_parallelism(ns)  # the baseline takes it
