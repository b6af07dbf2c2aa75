"""HF Qwen3 / Qwen3-MoE checkpoints in and out of the DualKV Megatron model, against transformers.

Tiny random models are built from transformers' own config classes (no downloads), with weights
scaled up so that logits are far from uniform and MoE routing is decisive, and saved with
save_pretrained. The DualKV model imports the checkpoint and runs packed micro-batches of several
groups (different P and R_i, R_i = 1); its logprobs must equal transformers' forward on each
[prompt | response] sequence separately (float32 rounding). Config fields are chosen so that a
wrong mapping shows: head_dim != hidden / heads, GQA, rope_theta and rms_norm_eps far from the
defaults, tied and untied embeddings, norm_topk_prob both ways, a dense layer among MoE layers.
Export must give back the checkpoint's tensors bit for bit; TP=2, EP=2 and expert-TP=2 imports
(two gloo processes) give the same logprobs and the same exported checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megatron_cpu import GlooWorkers, cuda_runtime_as_cpu, gloo_world_of_one, model_parallel

from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_dualkv import Group, build_layout
from megatron_dualkv.checkpoint import (
    hf_config_from_model_config,
    hf_to_megatron_state_dict,
    iter_hf_state,
    load_full_state_dict,
    load_hf_checkpoint,
    megatron_state_dict_to_hf,
    model_config_from_hf,
    save_hf_checkpoint,
)
from megatron_dualkv.megatron import build_dualkv_model, qwen3_config

VOCAB = 256
# float32, different op order (fused qkv, packed attention): agreement to rounding
RTOL, ATOL = 2e-6, 2e-5  # logprobs are O(1..30): atol dominates, ~1e-6 relative

DENSE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=0.05, rope_theta=300.0, max_position_embeddings=128,
)
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           mlp_only_layers=[0], router_aux_loss_coef=0.02)


# ------------------------------------------------------------------------------------------------
# transformers side
# ------------------------------------------------------------------------------------------------


def make_hf_model(moe: bool, seed: int = 0, **overrides):
    """A random HF Qwen3 (or Qwen3-MoE) with weights large enough to make every mapping matter."""
    values = {**(MOE if moe else DENSE), **overrides}
    config = Qwen3MoeConfig(**values) if moe else Qwen3Config(**values)
    config._attn_implementation = "eager"
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.7 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[-1] ** 0.5))
    return model.eval()


def save_hf(model, path) -> str:
    model.save_pretrained(path)
    return str(path)


@torch.no_grad()
def transformers_logprobs(model, groups: list[Group]) -> torch.Tensor:
    """log p(response token) from transformers' forward on each [prompt | response] sequence,
    in the layout's edge order (groups in order, responses in order, tokens in order)."""
    out = []
    for group in groups:
        p = len(group.prompt)
        for response in group.responses:
            ids = torch.tensor(group.prompt + response)[None]
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            out.append(logprobs[p - 1:p - 1 + len(response)].gather(1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def assert_logprobs_equal(actual, expected, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, rtol=RTOL, atol=ATOL), f"{what}: max |logprob diff| {err:.3g}"


def assert_same_tensors(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(set(actual) ^ set(expected))[:6]}"
    for name, t in expected.items():
        assert actual[name].dtype == t.dtype and torch.equal(actual[name], t), f"{what}: {name} differs"


# ------------------------------------------------------------------------------------------------
# Megatron side (single process)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def own_moe_metrics_tracker():
    """Megatron's global MoE metrics tracker sizes its per-layer entries by the first model that
    records into it; give this module's models (1 or 2 layers) a tracker of their own."""
    from megatron.core.transformer.moe import moe_logging

    saved = moe_logging.get_moe_metrics_tracker()
    moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())
    yield
    moe_logging.set_moe_metrics_tracker(saved)


@pytest.fixture(scope="module")
def pgs():
    with gloo_world_of_one(), cuda_runtime_as_cpu(), model_parallel(tp=1) as collection:
        yield collection


def import_model(hf_dir: str, pgs, **overrides):
    cfg = model_config_from_hf(hf_dir, use_cpu_initialization=True, **overrides)
    model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    load_hf_checkpoint(model, hf_dir)
    return cfg, model


CASES = {
    "dense": (False, {}),
    "dense-tied": (False, {"tie_word_embeddings": True}),
    "moe-norm-topk": (True, {}),
    "moe-no-norm-topk-tied": (True, {"norm_topk_prob": False, "tie_word_embeddings": True, "mlp_only_layers": []}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_logprobs_equal_transformers_and_export_is_bitwise(case, pgs, tmp_path, three_groups):
    moe, overrides = CASES[case]
    hf_model = make_hf_model(moe, **overrides)
    hf_dir = save_hf(hf_model, tmp_path / "hf")
    cfg, model = import_model(hf_dir, pgs)
    groups = three_groups(1, VOCAB)
    layout = build_layout(groups, vocab_size=VOCAB)
    expected = transformers_logprobs(hf_model, groups)
    assert expected.std() > 1.0, "test model too close to uniform to tell mappings apart"
    with torch.no_grad():
        assert_logprobs_equal(model(layout=layout).logprobs, expected, case)

    # export: every tensor of the checkpoint back, bit for bit, and nothing else
    on_disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert_same_tensors(dict(iter_hf_state(model)), on_disk, f"{case} export")
    out = tmp_path / "export"
    save_hf_checkpoint(model, out, cfg)
    assert_same_tensors(load_file(out / "model.safetensors"), on_disk, f"{case} save_hf_checkpoint")
    # transformers reads the exported config back to the same model
    reloaded = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM).from_pretrained(out, attn_implementation="eager")
    assert_same_tensors(reloaded.state_dict(), hf_model.state_dict(), f"{case} reloaded by transformers")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(reloaded.config, field) == getattr(hf_model.config, field), field
    assert reloaded.config.rope_parameters["rope_theta"] == hf_model.config.rope_parameters["rope_theta"]
    if moe:
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "router_aux_loss_coef", "mlp_only_layers"):
            assert getattr(reloaded.config, field) == getattr(hf_model.config, field), field


def test_mappings_are_seen_by_the_comparison(pgs, tmp_path, three_groups):
    """Negative controls: a wrong norm_topk_prob mapping, RoPE base or norm epsilon changes the
    logprobs far beyond the tolerance, so the comparison above would catch them."""
    hf_model = make_hf_model(True)
    hf_dir = save_hf(hf_model, tmp_path / "hf")
    groups = three_groups(1, VOCAB)
    layout = build_layout(groups, vocab_size=VOCAB)
    expected = transformers_logprobs(hf_model, groups)
    for wrong in ({"moe_router_pre_softmax": True}, {"rotary_base": 10000}, {"layernorm_epsilon": 1e-6}):
        _, model = import_model(hf_dir, pgs, **wrong)
        with torch.no_grad():
            err = (model(layout=layout).logprobs - expected).abs().max().item()
        assert err > 100 * ATOL, f"{wrong}: logprobs still match (max diff {err:.3g})"


def test_transformers5_fused_experts_in_memory(pgs, tmp_path):
    """transformers 5 holds experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]); importing
    its in-memory state dict gives the same model as importing the saved checkpoint."""
    hf_model = make_hf_model(True)
    hf_dir = save_hf(hf_model, tmp_path / "hf")
    sd = hf_model.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    _, from_disk = import_model(hf_dir, pgs)
    cfg = model_config_from_hf(hf_model.config, use_cpu_initialization=True)
    from_memory = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    load_hf_checkpoint(from_memory, sd)
    assert_same_tensors(dict(from_memory.named_parameters()), dict(from_disk.named_parameters()), "fused import")


def test_offline_state_dict_matches_the_model(pgs, tmp_path):
    """hf_to_megatron_state_dict (no model) gives exactly the imported model's parameters, its
    names are the model's, and megatron_state_dict_to_hf inverts it bitwise."""
    hf_model = make_hf_model(True, tie_word_embeddings=True)
    hf_dir = save_hf(hf_model, tmp_path / "hf")
    cfg, model = import_model(hf_dir, pgs)
    full = hf_to_megatron_state_dict(hf_dir, cfg)
    assert_same_tensors(full, {n: p.detach() for n, p in model.named_parameters()}, "offline state dict")
    assert_same_tensors(megatron_state_dict_to_hf(full, cfg), load_file(os.path.join(hf_dir, "model.safetensors")),
                        "offline export")
    other = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    load_full_state_dict(other, model.state_dict())
    assert_same_tensors(dict(other.named_parameters()), dict(model.named_parameters()), "load_full_state_dict")


def test_convert_cli_round_trip(tmp_path):
    """tools/convert_hf_checkpoint.py: HF dir -> Megatron state dict file -> HF dir, bitwise; the
    file's state dict loads into a model with load_state_dict (strict)."""
    spec = importlib.util.spec_from_file_location(
        "convert_hf_checkpoint", os.path.join(os.path.dirname(__file__), "..", "tools", "convert_hf_checkpoint.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    hf_dir = save_hf(make_hf_model(True, norm_topk_prob=False), tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    cli.main(["import", hf_dir, str(tmp_path / "mcore.pt")])
    saved = torch.load(tmp_path / "mcore.pt", weights_only=True)
    assert saved["hf_config"]["norm_topk_prob"] is False
    cli.main(["export", str(tmp_path / "mcore.pt"), str(tmp_path / "back"), "--max-shard-mb", "0.05",
              "--copy-files-from", hf_dir])
    assert (tmp_path / "back" / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    assert not (tmp_path / "back" / "model.safetensors").exists()  # weights are the export's own shards
    back = {}
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        back.update(load_file(tmp_path / "back" / fname))
    assert len(set(index["weight_map"].values())) > 1, "expected a sharded export"
    assert_same_tensors(back, load_file(os.path.join(hf_dir, "model.safetensors")), "CLI round trip")


def test_router_aux_loss_normalisation(pgs, tmp_path, three_groups):
    """router_aux_loss_coef maps to moe_aux_loss_coeff unchanged (as Megatron-Bridge does), but the
    two losses are normalised differently: per MoE layer, transformers' load_balancing_loss_func
    (E * sum_i f_i P_i with f_i counting all top-k picks) equals top_k times Megatron's
    (f_i divided by T * top_k). Checked on one MoE layer and one sequence (docs/CHECKPOINTS.md)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    hf_model = make_hf_model(True, num_hidden_layers=1, mlp_only_layers=[])
    hf_dir = save_hf(hf_model, tmp_path / "hf")
    cfg, model = import_model(hf_dir, pgs)
    assert cfg.transformer.moe_aux_loss_coeff == hf_model.config.router_aux_loss_coef
    group = three_groups(1, VOCAB)[0]
    response = group.responses[0]
    with torch.no_grad():
        hf_aux = hf_model(torch.tensor(group.prompt + response)[None], output_router_logits=True).aux_loss
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    model(layout=build_layout([Group.of(group.prompt, [response])], vocab_size=VOCAB))  # N=1: plain sequence
    megatron_aux = tracker.metrics["load_balancing_loss"].values[0]
    k = hf_model.config.num_experts_per_tok
    assert torch.allclose(megatron_aux * k, hf_aux.float(), rtol=1e-5), (megatron_aux.item(), hf_aux.item())
    assert not torch.allclose(megatron_aux, hf_aux.float(), rtol=1e-2)


# ------------------------------------------------------------------------------------------------
# Config mapping
# ------------------------------------------------------------------------------------------------

# Qwen3-30B-A3B's config.json as published (transformers 4 format: top-level rope_theta, num_experts)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_maps_to_the_design_config():
    cfg = model_config_from_hf(QWEN3_30B_A3B)
    ref = qwen3_config("30b-a3b")
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "layernorm_epsilon", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "moe_aux_loss_coeff", "moe_router_pre_softmax", "moe_layer_freq", "qk_layernorm",
                  "gated_linear_unit", "add_bias_linear", "normalization"):
        assert getattr(cfg.transformer, field) == getattr(ref.transformer, field), field
    assert (cfg.vocab_size, cfg.rotary_base, cfg.share_embeddings_and_output_weights) == (151936, 1_000_000, False)
    back = hf_config_from_model_config(cfg, torch.bfloat16)
    for key, value in QWEN3_30B_A3B.items():
        if key in back:
            assert back[key] == value, key


@pytest.mark.parametrize("bad, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama"}, "model_type"),
])
def test_unsupported_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**QWEN3_30B_A3B, **bad})


def test_mismatched_checkpoint_is_refused(pgs, tmp_path):
    """A checkpoint that does not fit the model: the error names the tensor or parameter."""
    hf_dir = save_hf(make_hf_model(True), tmp_path / "hf")
    cfg = model_config_from_hf(hf_dir, use_cpu_initialization=True, num_moe_experts=2)
    model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"mlp\.experts\.[23]\."):
        load_hf_checkpoint(model, hf_dir)
    cfg = model_config_from_hf(hf_dir, use_cpu_initialization=True, moe_ffn_hidden_size=16)
    model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"local_experts\.0\.linear_fc1\.weight.*\(64, 64\).*\(32, 64\)"):
        load_hf_checkpoint(model, hf_dir)
    sd = dict(load_file(os.path.join(hf_dir, "model.safetensors")))
    del sd["model.layers.0.self_attn.k_norm.weight"]
    _, model = import_model(hf_dir, pgs)
    with pytest.raises(KeyError, match="k_norm"):
        load_hf_checkpoint(model, sd)


# ------------------------------------------------------------------------------------------------
# TP / EP / expert-TP: two gloo processes
# ------------------------------------------------------------------------------------------------

PARALLEL_CASES = [  # (checkpoint, tp, ep, etp); TP runs with sequence parallelism
    ("dense", 2, 1, None),
    ("dense-1kv", 2, 1, None),  # TP > query groups: the ranks split one group's [q q k v] rows
    ("dense-tied", 2, 1, None),
    ("moe", 1, 2, None),
    ("moe", 2, 2, 1),
    ("moe", 2, 1, 2),
]


def parallel_import_export(hf_dirs: dict, groups: list, out_root: str) -> dict:
    """Runs on every rank: import each case's checkpoint sharded, logprobs, save_hf_checkpoint."""
    results = {}
    for name, tp, ep, etp in PARALLEL_CASES:
        # sequence parallelism under TP: Megatron's MoE layer refuses TP without it in training mode
        with model_parallel(tp=tp, ep=ep, etp=etp) as pgs:
            cfg = model_config_from_hf(
                hf_dirs[name], use_cpu_initialization=True, tensor_model_parallel_size=tp,
                expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                **({} if etp is None else {"expert_tensor_parallel_size": etp}))
            model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False)
            load_hf_checkpoint(model, hf_dirs[name])
            with torch.no_grad():
                logprobs = model(layout=build_layout(groups, vocab_size=VOCAB, pad_to_multiple=tp)).logprobs
            out = os.path.join(out_root, f"{name}-tp{tp}-ep{ep}-etp{etp}")
            save_hf_checkpoint(model, out, cfg)
            results[(name, tp, ep, etp)] = {"logprobs": logprobs, "out": out,
                                            "local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}
    return results


@pytest.fixture(scope="module")
def workers():
    """Two gloo worker processes shared by the parallel tests (Megatron is imported once per worker)."""
    with GlooWorkers(2, timeout_s=240) as pool:
        yield pool


def test_tp_ep_import_and_export_match_transformers(workers, tmp_path, three_groups):
    models = {"dense": make_hf_model(False), "dense-tied": make_hf_model(False, tie_word_embeddings=True),
              "dense-1kv": make_hf_model(False, num_key_value_heads=1), "moe": make_hf_model(True)}
    hf_dirs = {name: save_hf(m, tmp_path / name) for name, m in models.items()}
    groups = three_groups(1, VOCAB)
    expected = {name: transformers_logprobs(m, groups) for name, m in models.items()}
    per_rank = workers.run(parallel_import_export, hf_dirs, groups, str(tmp_path / "out"))
    for case in PARALLEL_CASES:
        name, tp, ep, etp = case
        for rank, res in enumerate(per_rank):
            r = res[case]
            assert_logprobs_equal(r["logprobs"], expected[name], f"{case} rank {rank}")
        shapes = per_rank[0][case]["local_shapes"]
        if tp == 2:
            groups_kv = 1 if name == "dense-1kv" else 2
            rows = groups_kv * (4 // groups_kv + 2) * 32
            assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"][0] == rows // 2, f"{case}: qkv not split"
        if name == "moe":
            num_local = sum(1 for n in shapes if n.startswith("decoder.layers.1.mlp.experts.local_experts.")
                            and n.endswith("linear_fc1.weight"))
            assert num_local == 4 // ep, f"{case}: {num_local} local experts"
            fc1 = shapes["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
            assert fc1 == (2 * 32 // (etp or tp), 64), f"{case}: expert fc1 shard {fc1}"
        on_disk = load_file(os.path.join(hf_dirs[name], "model.safetensors"))
        assert_same_tensors(load_file(os.path.join(per_rank[0][case]["out"], "model.safetensors")), on_disk,
                            f"{case} export")


def pipeline_stage_import(hf_dir: str) -> dict:
    """Runs on each of 2 pipeline stages: import, return the stage's parameters by full name."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_dualkv.checkpoint import iter_full_megatron_state, parameter_placements

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, create_gloo_process_groups=False)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        stage = pgs.pp.rank()
        cfg = model_config_from_hf(hf_dir, use_cpu_initialization=True, pipeline_model_parallel_size=2,
                                   pipeline_dtype=torch.float32)
        model = build_dualkv_model(cfg, pg_collection=pgs, use_transformer_engine=False,
                                   pre_process=stage == 0, post_process=stage == 1)
        load_hf_checkpoint(model, hf_dir)
        places = parameter_placements(model)
        params = {places[n].full_name: p.detach().clone() for n, p in model.named_parameters()}
        try:
            next(iter_full_megatron_state(model))
            export_refused = False
        except ValueError:
            export_refused = True
        return {"params": params, "export_refused": export_refused}
    finally:
        ps.destroy_model_parallel()


def test_pipeline_stages_import_their_layers(workers, tmp_path):
    """PP=2 (tied embeddings): each stage holds exactly its layers' tensors under their global
    names, the last stage's output layer is the embedding; export under PP is refused."""
    hf_dir = save_hf(make_hf_model(True, tie_word_embeddings=True), tmp_path / "hf")
    cfg = model_config_from_hf(hf_dir)
    full = hf_to_megatron_state_dict(hf_dir, cfg)
    first, last = workers.run(pipeline_stage_import, hf_dir)
    assert first["export_refused"] and last["export_refused"]
    assert all(".layers.0." in n or n.startswith("embedding.") for n in first["params"]), sorted(first["params"])
    assert all(".layers.1." in n or n in ("decoder.final_layernorm.weight", "output_layer.weight")
               for n in last["params"]), sorted(last["params"])
    expected = dict(full, **{"output_layer.weight": full["embedding.word_embeddings.weight"]})
    merged = {**first["params"], **last["params"]}
    assert_same_tensors(merged, expected, "PP=2 stages")


def run_gpu_hf_check_tiny() -> tuple[int, str]:
    """Runs in a worker (a gloo world of one): tools/gpu_hf_check.py --tiny on the CPU."""
    import contextlib
    import io

    spec = importlib.util.spec_from_file_location(
        "gpu_hf_check", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "gpu_hf_check.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tool.main(["--tiny", "--device", "cpu"])
    return code, out.getvalue()


def test_gpu_hf_check_tool_runs_tiny_on_cpu(workers):
    """tools/gpu_hf_check.py --tiny (the CPU form of the GPU bf16 check) runs end to end and its
    float32 row equals transformers; its bf16 verdict depends on the CPU's bf16 arithmetic, so only
    its presence is checked here (the GPU run is the real check)."""
    (code, stdout), = workers.run(run_gpu_hf_check_tiny, world_size=1)
    assert code in (0, 1), stdout
    assert "| DualKV Megatron | bfloat16 |" in stdout and "| transformers | bfloat16 |" in stdout, stdout
    assert "DualKV float32 vs reference: OK" in stdout, stdout
    assert "DualKV bf16 error / transformers bf16 error" in stdout, stdout
