"""The NeMo-RL plug-in against NeMo-RL's data contract and the replicated path.

Batches follow NeMo-RL's BatchedDataDict: input_ids [B, S] right-padded (prompt then response),
input_lengths, token_mask (1 on generated tokens; multi-turn tool spans 0), sample_mask (with
zeros), advantages [B, S] (a row scalar expanded), prev / generation / reference logprobs [B, S].
Groups have different prompt and response lengths; rows are consecutive copies of
num_generations_per_prompt, or carry an explicit prompt_id in shuffled order.

The reference is NeMo-RL's own path: the STOCK Megatron GPTModel run on the [B, S] rows directly
(causal + padding mask), logprobs = log_softmax(logits[:, :-1] / T) gathered at input_ids[:, 1:],
and ClippedPGLossFn's formula per row (tests/test_loss.py's replicated_loss). The DualKV side is
a copy of that stock model converted in place (to_dualkv_model, as the worker extension does)
and driven by DualKVPolicyRunner through Megatron's schedule. float64, tiny Qwen3, CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_cpu import CudaPlacementOnCpu, cuda_runtime_as_cpu, gloo_world_of_one, model_parallel
from test_loss import replicated_loss

from megatron_dualkv.integrations.nemo_rl import (
    ClippedPGAdapter,
    DualKVPolicyRunner,
    DualKVSettings,
    NemoRLBatchError,
    convert_batch,
    group_aligned_order,
    inverse_order,
    plan_micro_batches,
    to_dualkv_model,
)
from megatron_dualkv.megatron import DualKVGPTModel, build_replicated_model, copy_weights, qwen3_config

F64 = torch.float64
VOCAB = 128
TEMPERATURE = 0.7

# (prompt length, [(response length, generated-token spans masked out as tool output), ...])
SAME_N = [
    (5, [(4, []), (1, []), (7, [(2, 4)])]),
    (3, [(2, []), (8, [(1, 3), (5, 6)]), (3, [])]),
    (9, [(3, []), (2, []), (2, [])]),
    (2, [(6, [(3, 5)]), (1, []), (4, [])]),
]
VARIABLE_N = [
    (4, [(5, []), (2, []), (3, [(1, 2)]), (1, [])]),
    (7, [(3, [])]),
    (2, [(6, [(2, 4)]), (4, [])]),
    (5, [(2, []), (2, []), (3, [])]),
]


def build_batch(groups, *, seed: int, explicit_ids: bool = False, shuffle: bool = False, extra_pad: int = 3):
    """A NeMo-RL-style batch (logprob keys are filled in later, from the model)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for gi, (p, responses) in enumerate(groups):
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        for r, spans in responses:
            mask = [1] * r
            for a, b in spans:
                mask[a:b] = [0] * (b - a)
            rows.append((prompt + torch.randint(1, VOCAB, (r,), generator=g).tolist(), [0] * p + mask, gi))
    if shuffle:
        rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    B, S = len(rows), max(len(t) for t, _, _ in rows) + extra_pad
    ids = torch.zeros(B, S, dtype=torch.long)
    token_mask = torch.zeros(B, S)
    for b, (t, m, _) in enumerate(rows):
        ids[b, :len(t)] = torch.tensor(t)
        token_mask[b, :len(m)] = torch.tensor(m, dtype=torch.float32)
    sample_mask = torch.ones(B)
    sample_mask[1] = 0.0
    data = {
        "input_ids": ids,
        "input_lengths": torch.tensor([len(t) for t, _, _ in rows]),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": torch.randn(B, generator=g, dtype=F64)[:, None].expand(B, S).clone(),
    }
    if explicit_ids:
        data["prompt_id"] = torch.tensor([100 + 7 * gi for _, _, gi in rows])
    return data


# --------------------------------------------------------------------------------------------
# Conversion (no model)
# --------------------------------------------------------------------------------------------


def test_consecutive_copies_become_groups_with_the_generated_boundary_as_prompt_end():
    data = build_batch(SAME_N, seed=1)
    batch = convert_batch(data, num_generations_per_prompt=3)
    assert batch.rows == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11))
    for rec, rows in zip(batch.records, batch.rows):
        for i, b in enumerate(rows):
            n = int(data["input_lengths"][b])
            first = int(data["token_mask"][b].nonzero()[0])
            assert rec.prompt == tuple(data["input_ids"][b, :first].tolist())
            # the response runs to the row's length, tool spans (token_mask 0) included
            assert rec.responses[i] == tuple(data["input_ids"][b, first:n].tolist())
    assert [len(r.prompt) for r in batch.records] == [5, 3, 9, 2]
    assert batch.records[1].response_lengths == (2, 8, 3)


def test_explicit_ids_group_shuffled_rows_of_variable_group_sizes():
    data = build_batch(VARIABLE_N, seed=2, explicit_ids=True, shuffle=True)
    batch = convert_batch(data)  # prompt_id present: num_generations_per_prompt not needed
    assert sorted(len(r) for r in batch.rows) == [1, 2, 3, 4]
    assert sorted(i for rows in batch.rows for i in rows) == list(range(data["input_ids"].shape[0]))
    for rows in batch.rows:
        assert len({int(data["prompt_id"][b]) for b in rows}) == 1


def test_packing_keeps_groups_whole_when_they_fit_and_splits_with_the_prompt_otherwise():
    data = build_batch(SAME_N, seed=3)
    batch = convert_batch(data, num_generations_per_prompt=3)
    # packed sizes P + sum(R): 17, 16, 16, 13 tokens; a budget of 14 splits all but the last group
    mbs = plan_micro_batches(batch, max_tokens=14)
    names = [g.name for mb in mbs for g in mb.groups]
    assert "rows 9..11" in names
    assert not {"rows 0..2", "rows 3..5", "rows 6..8"} & set(names)
    for mb in mbs:
        assert mb.layout.num_tokens <= 14
        for grp, (rec, _) in zip(mb.groups, [mb.response_source[sum(len(g.responses) for g in mb.groups[:k])]
                                             for k in range(len(mb.groups))]):
            assert grp.prompt == batch.records[rec].prompt  # every piece carries the whole prompt
    covered = sorted(batch.rows[r][i] for mb in mbs for r, i in mb.response_source)
    assert covered == list(range(12))


def test_group_aligned_order_gives_dp_shards_of_whole_balanced_groups():
    # 8 groups of 3, packed sizes from 5 to 47 tokens, heaviest first (contiguous shards: unbalanced)
    spec = [(p, [(r, []), (r, []), (r + 1, [])]) for p, r in [(9, 12), (8, 11), (7, 10), (6, 8), (4, 3), (3, 2),
                                                                (2, 1), (1, 1)]]
    shuffled = build_batch(spec, seed=20, explicit_ids=True, shuffle=True)
    data = build_batch(spec, seed=20, explicit_ids=True)
    def work(rows, d=data):  # packed tokens of the groups in these rows
        return sum(len(r.prompt) + sum(r.response_lengths) for r in convert_batch({k: v[rows] for k, v in d.items()}).records)

    for gbs in (24, 12):  # one global batch, or two (each permuted inside itself)
        order = group_aligned_order(data, dp_size=2, global_batch_size=gbs)
        assert sorted(order) == list(range(24))
        perm = torch.tensor(order)
        reordered = {k: v[perm] for k, v in data.items()}
        for start in range(0, 24, gbs):
            assert set(order[start:start + gbs]) == set(range(start, start + gbs))
            halves = [list(range(start + h * gbs // 2, start + (h + 1) * gbs // 2)) for h in range(2)]
            loads = []
            for rows in halves:  # whole groups: consecutive copies of N = 3, verified
                shard = {k: v[rows] for k, v in reordered.items() if k != "prompt_id"}
                assert len({int(i) for i in reordered["prompt_id"][rows]}) == gbs // 6
                assert convert_batch(shard, num_generations_per_prompt=3).num_groups == gbs // 6
                loads.append(work(perm[rows]))
            assert abs(loads[0] - loads[1]) <= 47
        assert [order[j] for j in inverse_order(order)] == list(range(24))
    one = group_aligned_order(shuffled, dp_size=2)  # rows of a group anywhere in the batch
    loads = [work(torch.tensor(one[:12]), shuffled), work(torch.tensor(one[12:]), shuffled)]
    assert sum(loads) == 192 and abs(loads[0] - loads[1]) <= 6  # groups in order: 157 vs 35 packed tokens
    with pytest.raises(NemoRLBatchError, match=r"prompt_id=\d+ has rows in global batches 0 and 1"):
        group_aligned_order(shuffled, dp_size=2, global_batch_size=12)
    with pytest.raises(NemoRLBatchError, match="8 groups cannot be dealt evenly to 3"):
        group_aligned_order(data, dp_size=3, global_batch_size=24)
    with pytest.raises(NemoRLBatchError, match="groups of different sizes"):
        group_aligned_order(build_batch(VARIABLE_N, seed=21, explicit_ids=True), dp_size=1)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_prompts_differing_inside_a_claimed_group_name_the_rows():
    data = build_batch(SAME_N, seed=4)
    data["input_ids"][4, 1] = (data["input_ids"][3, 1] + 1) % VOCAB
    with pytest.raises(NemoRLBatchError, match=r"rows \[3, 4, 5\] .*row 4 differs from row 3 at prompt token 1"):
        convert_batch(data, num_generations_per_prompt=3)
    data = build_batch(VARIABLE_N, seed=4, explicit_ids=True)
    data["input_ids"][2, 0] += 1
    with pytest.raises(NemoRLBatchError, match=r"prompt_id=100: rows \[0, 1, 2, 3\].*row 2 differs from row 0"):
        convert_batch(data)


def test_generated_boundary_mismatch_and_non_consecutive_rows_are_errors():
    data = build_batch(SAME_N, seed=5)
    data["token_mask"][7, 9] = 0.0  # row 7's response starts one token later: another prompt
    with pytest.raises(NemoRLBatchError, match=r"rows \[6, 7, 8\].*row 7's first generated token .* column 10 "
                                               r"and row 6's at column 9"):
        convert_batch(data, num_generations_per_prompt=3)
    # copies interleaved (repeat instead of repeat_interleave): rows 0..2 are not one prompt
    data = build_batch(SAME_N, seed=5)
    order = torch.tensor([0, 3, 6, 1, 4, 7, 2, 5, 8, 9, 10, 11])
    data = {k: v[order] for k, v in data.items()}
    with pytest.raises(NemoRLBatchError, match=r"rows \[0, 1, 2\] are claimed to share one prompt"):
        convert_batch(data, num_generations_per_prompt=3)
    with pytest.raises(NemoRLBatchError, match=r"12 rows are not a whole number of groups of "
                                               r"num_generations_per_prompt=5.*rows \[10, 11\]"):
        convert_batch(build_batch(SAME_N, seed=5), num_generations_per_prompt=5)
    with pytest.raises(NemoRLBatchError, match="no group identity"):
        convert_batch(build_batch(SAME_N, seed=5))


def test_malformed_rows_are_errors_naming_them():
    base = build_batch(SAME_N, seed=6)
    S = base["input_ids"].shape[1]
    data = dict(base, input_lengths=base["input_lengths"].clone())
    data["input_lengths"][5] = S + 2
    with pytest.raises(NemoRLBatchError, match=rf"rows \[5\] have lengths \[{S + 2}\] outside \[2, S={S}\]"):
        convert_batch(data, num_generations_per_prompt=3)
    data = dict(base, token_mask=base["token_mask"].clone())
    data["token_mask"][2, S - 1] = 1.0
    with pytest.raises(NemoRLBatchError, match=r"rows \[2\] mark tokens at or after input_lengths"):
        convert_batch(data, num_generations_per_prompt=3)
    data = dict(base, token_mask=base["token_mask"].clone())
    data["token_mask"][[6, 7, 8]] = 0.0  # a group of rows without a generated token is not packed
    assert convert_batch(data, num_generations_per_prompt=3).rows == ((0, 1, 2), (3, 4, 5), (9, 10, 11))
    data["token_mask"][:] = 0.0
    with pytest.raises(NemoRLBatchError, match="none of the 12 rows marks a generated token"):
        convert_batch(data, num_generations_per_prompt=3)
    data = dict(base, token_mask=base["token_mask"].clone())
    data["token_mask"][0, 0] = 1.0
    with pytest.raises(NemoRLBatchError, match=r"rows \[0\] mark token 0 as generated"):
        convert_batch(data, num_generations_per_prompt=3)
    batch = convert_batch(dict(base, advantages=base["advantages"].clone()), num_generations_per_prompt=3)
    batch.data["advantages"][4, 6] += 1.0  # a generated token of row 4
    with pytest.raises(NemoRLBatchError, match="advantages: row 4 holds different values"):
        batch.row_values("advantages")


def test_loss_options_map_and_unsupported_ones_are_refused():
    a = ClippedPGAdapter.from_config(dict(ratio_clip_min=0.1, ratio_clip_max=0.28, ratio_clip_c=3.0,
                                          reference_policy_kl_penalty=0.05, kl_input_clamp_value=None,
                                          use_importance_sampling_correction=True, token_level_loss=False,
                                          truncated_importance_sampling_ratio=None, disable_ppo_ratio=False))
    c = a.config
    assert (c.clip_low, c.clip_high, c.dual_clip, c.kl_beta, c.kl_input_clamp, c.kl_output_clamp) == \
        (0.1, 0.28, 3.0, 0.05, None, 10.0)
    assert c.importance_correction and not c.on_policy_kl_approximation and c.aggregation == "sequence"
    assert ClippedPGAdapter.from_config({}).config.kl_beta == 0.01  # NeMo-RL's default beta
    assert ClippedPGAdapter.from_config(dict(use_kl_in_reward=True)).config.kl_beta == 0.0
    for bad, match in [
        (dict(disable_ppo_ratio=True), "disable_ppo_ratio"),
        (dict(sequence_level_importance_ratios=True, token_level_loss=False), "sequence_level_importance_ratios"),
        (dict(truncated_importance_sampling_ratio=2.0, use_importance_sampling_correction=True), "truncated"),
        (dict(reference_policy_kl_type="k2"), "k2"),
        (dict(force_on_policy_ratio=True, use_importance_sampling_correction=True), "force_on_policy_ratio"),
        (dict(some_new_option=1.5), "some_new_option"),
    ]:
        with pytest.raises(ValueError, match=match):
            ClippedPGAdapter.from_config(bad)
    with pytest.raises(ValueError, match="unknown key"):
        DualKVSettings.from_dict({"max_tokens_per_microbatch": 64, "max_token": 3})

    # a constructed loss function: its attributes, token/sequence level from its loss_type
    class ClippedPGLossFn:  # the attribute names of NeMo-RL's class
        ratio_clip_min, ratio_clip_max, ratio_clip_c = 0.2, 0.28, None
        reference_policy_kl_penalty, reference_policy_kl_type = 0.0, "k3"
        kl_input_clamp_value, kl_output_clamp_value = 20.0, 10.0
        use_on_policy_kl_approximation, use_importance_sampling_correction = False, True
        disable_ppo_ratio, force_on_policy_ratio, sequence_level_importance_ratios = False, False, False
        truncated_importance_sampling_ratio = None
        loss_type = "LossType.SEQUENCE_LEVEL"

    c = ClippedPGAdapter.from_loss_fn(ClippedPGLossFn()).config
    assert (c.clip_high, c.kl_beta, c.importance_correction, c.aggregation) == (0.28, 0.0, True, "sequence")
    with pytest.raises(ValueError, match="ClippedPGLossFn only, got NLLLoss"):
        ClippedPGAdapter.from_loss_fn(type("NLLLoss", (), {})())


# --------------------------------------------------------------------------------------------
# Against the stock model on the [B, S] rows
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    """(stock GPTModel, its converted copy), tiny Qwen3 in float64, on a world-size-1 gloo group."""
    # CudaPlacementOnCpu: Megatron's schedule allocates its token counter with device="cuda"
    with gloo_world_of_one(), cuda_runtime_as_cpu(), CudaPlacementOnCpu(), model_parallel(tp=1) as pgs:
        cfg = qwen3_config("tiny", use_cpu_initialization=True, params_dtype=F64, vocab_size=VOCAB)
        torch.manual_seed(11)
        base, dualkv = (build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False).double()
                        for _ in range(2))
        with torch.no_grad():  # norms away from 1 so their gradient paths matter
            for name, p in base.named_parameters():
                if "layernorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        copy_weights(base, dualkv)
        assert to_dualkv_model(dualkv) is dualkv
        yield base, dualkv


def stock_logprobs(base, data) -> torch.Tensor:
    """NeMo-RL's convention from the stock model on the rows: [B, S], column 0 = 0."""
    ids = data["input_ids"]
    B, S = ids.shape
    pad = torch.arange(S)[None] >= data["input_lengths"][:, None]
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    logits = base(ids, torch.arange(S).expand(B, S), causal, padding_mask=pad)
    out = torch.zeros(B, S, dtype=F64)
    out[:, 1:] = torch.log_softmax(logits[:, :-1].double() / TEMPERATURE, -1).gather(2, ids[:, 1:, None]).squeeze(2)
    return out


def response_span(data) -> torch.Tensor:
    generated = data["token_mask"] != 0
    first = generated.int().argmax(1)
    cols = torch.arange(data["input_ids"].shape[1])[None]
    return (cols >= first[:, None]) & (cols < data["input_lengths"][:, None]) & generated.any(1)[:, None]


def with_logprob_keys(data, curr, seed):
    """prev / generation / reference logprobs near the current policy (every clip binds somewhere),
    0 outside [1, length) like NeMo-RL's."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.arange(curr.shape[1])[None] < data["input_lengths"][:, None]
    valid[:, 0] = False
    noisy = lambda s: torch.where(valid, curr + s * torch.randn(curr.shape, generator=g, dtype=F64), 0.0)
    return dict(data, prev_logprobs=noisy(0.8), generation_logprobs=noisy(0.8), reference_policy_logprobs=noisy(0.5))


@pytest.mark.parametrize("explicit_ids", [False, True])
def test_logprobs_equal_the_stock_model_on_the_rows(models, explicit_ids):
    base, dualkv = models
    assert isinstance(dualkv, DualKVGPTModel)
    data = (build_batch(VARIABLE_N, seed=7, explicit_ids=True, shuffle=True) if explicit_ids
            else build_batch(SAME_N, seed=7))
    data["token_mask"][4] = 0.0  # a row without a generated token (a truncated sample): logprobs 0
    # a small budget: several micro-batches, and the largest group split into sub-groups
    runner = DualKVPolicyRunner(dualkv, DualKVSettings(max_tokens_per_microbatch=14, num_generations_per_prompt=3),
                                temperature=TEMPERATURE)
    _, mbs, _ = runner.prepare(data)
    assert len(mbs) > 2 and any("[responses" in g.name for mb in mbs for g in mb.groups)
    got = runner.get_logprobs(data)
    with torch.no_grad():
        want = stock_logprobs(base, data)
    span = response_span(data)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got[span].double(), want[span], rtol=1e-6, atol=1e-6)  # float32 output
    assert (got[~span] == 0).all()  # column 0, the prompt, padding, the row without a response
    assert not span[4].any() and span.sum() > 25


@pytest.mark.parametrize("token_level", [True, False])
def test_loss_gradients_and_metrics_equal_clipped_pg_on_the_rows(models, token_level):
    """Loss and EVERY parameter gradient through the runner (Megatron's schedule, several
    micro-batches) equal ClippedPGLossFn's formula on the stock model's [B, S] logprobs."""
    base, dualkv = models
    data = build_batch(SAME_N, seed=8)
    data["token_mask"][5] = 0.0  # no generated token, sample_mask 1: counts in global_valid_seqs only
    with torch.no_grad():
        curr0 = stock_logprobs(base, data)
    data = with_logprob_keys(data, curr0, seed=9)
    loss_cfg = dict(ratio_clip_min=0.2, ratio_clip_max=0.28, ratio_clip_c=2.0, reference_policy_kl_penalty=0.1,
                    use_importance_sampling_correction=True, use_on_policy_kl_approximation=True,
                    token_level_loss=token_level)
    adapter = ClippedPGAdapter.from_config(loss_cfg)
    runner = DualKVPolicyRunner(dualkv, DualKVSettings(max_tokens_per_microbatch=24, num_generations_per_prompt=3),
                                temperature=TEMPERATURE)
    calls = []
    dualkv.zero_grad(set_to_none=True)
    out = runner.train(data, adapter, zero_grad=lambda: calls.append("zero"),
                       optimizer_step=lambda: calls.append("step") or {"grad_norm": 0.0})
    assert calls == ["zero", "step"] and len(out["micro_batch_stats"][0]) > 1

    base.zero_grad(set_to_none=True)
    rep = {k: data[k] for k in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "advantages")}
    rep.update(curr=stock_logprobs(base, data), token_mask=data["token_mask"].double(),
               sample_mask=data["sample_mask"].double())
    mask = rep["token_mask"][:, 1:] * rep["sample_mask"][:, None]
    ref_loss, ref_metrics = replicated_loss(
        rep, dict(eps_low=0.2, eps_high=0.28, c=2.0, beta=0.1, on_policy_kl=True, token_level=token_level,
                  **{"is": True}), mask.sum(), rep["sample_mask"].sum())
    ref_loss.backward()

    m = out["metrics"][0]
    assert out["loss"][0].item() == pytest.approx(ref_loss.item(), rel=1e-7)
    got, want = dict(dualkv.named_parameters()), dict(base.named_parameters())
    # NeMo-RL adds 1e-8 to every normaliser (each row's token count too, sequence-level), DualKV's
    # loss does not: ~1e-9 relative per term, so compare each gradient to 1e-7 of its own scale
    # (without the 1e-8 the two agree to float64 rounding; checked once by hand)
    for name, p in want.items():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-7, atol=1e-7 * float(p.grad.abs().max()),
                                   msg=lambda s: f"{name}: {s}")
    assert any(p.grad.abs().max() > 0 for p in got.values())
    # ClippedPGLossFn's metrics, summed over micro-batches
    assert m["probs_ratio"] == pytest.approx(ref_metrics["ratio_mean"], rel=1e-7)
    assert (m["probs_ratio_min"], m["probs_ratio_max"]) == pytest.approx(
        (ref_metrics["ratio_min"], ref_metrics["ratio_max"]), rel=1e-9)
    assert m["probs_ratio_min"] < 0.8 and m["probs_ratio_max"] > 1.28  # the clips bind
    assert m["num_valid_samples"] == data["sample_mask"].sum().item()
    curr, prev, gen = rep["curr"][:, 1:].detach(), rep["prev_logprobs"][:, 1:], rep["generation_logprobs"][:, 1:]
    G = mask.sum()
    assert m["sampling_importance_ratio"] == pytest.approx(float((torch.exp(prev - gen) * mask).sum() / G), rel=1e-7)
    assert m["approx_entropy"] == pytest.approx(float(-(torch.exp(curr - gen) * curr * mask).sum() / G), rel=1e-7)
    x = prev - gen
    assert m["gen_kl_error"] == pytest.approx(float(((torch.exp(x) - x - 1) * mask).sum() / G), rel=1e-7)


def test_train_steps_over_local_batches_and_bad_batches_fail_before_any_work(models):
    base, dualkv = models
    data = build_batch(SAME_N, seed=10)
    with torch.no_grad():
        data = with_logprob_keys(data, stock_logprobs(base, data), seed=11)
    runner = DualKVPolicyRunner(dualkv, DualKVSettings(max_tokens_per_microbatch=32, num_generations_per_prompt=3),
                                temperature=TEMPERATURE)
    adapter = ClippedPGAdapter.from_config(dict(reference_policy_kl_penalty=0.0))
    steps = []
    out = runner.train(data, adapter, local_batch_size=6, zero_grad=lambda: steps.append("zero"),
                       optimizer_step=lambda: steps.append("step"))
    assert steps == ["zero", "step", "zero", "step"] and out["loss"].shape == (2,)
    # each local batch is normalised by its own token count (NeMo-RL's global batch semantics)
    halves = [runner.train({k: v[i:i + 6] for k, v in data.items()}, adapter, eval_mode=True)["loss"][0]
              for i in (0, 6)]
    torch.testing.assert_close(out["loss"], torch.stack(halves), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="not a whole number of local batches"):
        runner.train(data, adapter, local_batch_size=5)
    bad = dict(data, input_ids=data["input_ids"].clone())
    bad["input_ids"][10, 0] += 1
    with pytest.raises(NemoRLBatchError, match=r"rows \[9, 10, 11\]"):
        runner.get_logprobs(bad)


def test_moe_model_converted_in_place_matches_the_stock_model(models):
    """to_dualkv_model swaps the router too: a tiny MoE (top-2 of 4 experts) gives the stock
    model's logprobs on the rows after conversion."""
    from megatron_dualkv.megatron import DualKVTopKRouter

    base, _ = models
    cfg = qwen3_config("tiny-moe", use_cpu_initialization=True, params_dtype=F64, vocab_size=VOCAB,
                       moe_aux_loss_coeff=0.0)
    pgs = base.pg_collection
    torch.manual_seed(12)
    stock, moe = (build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False).double() for _ in range(2))
    copy_weights(stock, moe)
    to_dualkv_model(moe)
    routers = [m for m in moe.modules() if isinstance(m, DualKVTopKRouter)]
    assert len(routers) == 2 and moe._dualkv_routers == routers
    assert moe.state_dict().keys() == stock.state_dict().keys()
    data = build_batch(VARIABLE_N, seed=13, explicit_ids=True, shuffle=True)
    runner = DualKVPolicyRunner(moe, DualKVSettings(max_tokens_per_microbatch=32), temperature=TEMPERATURE)
    got = runner.get_logprobs(data)
    with torch.no_grad():
        want = stock_logprobs(stock, data)
    span = response_span(data)
    # Megatron's router softmax runs in float32 even in a float64 model
    torch.testing.assert_close(got[span].double(), want[span], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="expected a Megatron GPTModel"):
        to_dualkv_model(torch.nn.Linear(2, 2))


def test_conversion_keeps_a_core_attentions_extra_state_key(models):
    """Transformer Engine's core attention has `_extra_state` in the state_dict; NeMo-RL loads the
    reference weights into the policy with strict=True, so the converted model keeps the key."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class WithExtraState(DotProductAttention):  # what TE's attention adds to the state_dict
        def get_extra_state(self):
            return torch.tensor([3.0])

        def set_extra_state(self, state):
            pass

    base, _ = models
    cfg = qwen3_config("tiny", use_cpu_initialization=True, params_dtype=F64, vocab_size=VOCAB)
    model = build_replicated_model(cfg, pg_collection=base.pg_collection, use_transformer_engine=False)
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.__class__ = WithExtraState
    before = model.state_dict()
    assert any(k.endswith("core_attention._extra_state") for k in before)
    to_dualkv_model(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert torch.equal(after["decoder.layers.0.self_attention.core_attention._extra_state"], torch.tensor([3.0]))
    model.load_state_dict(before, strict=True)


# --------------------------------------------------------------------------------------------
# The worker extension's glue, on a stand-in for the host worker (NeMo-RL is not installable)
# --------------------------------------------------------------------------------------------


class HostWorker:
    """The attributes of NeMo-RL's Megatron worker that DualKVWorkerMixin uses, and its two
    methods (recording that they ran): what the extension defers to when DualKV is off."""

    def __init__(self, cfg, model, optimizer, scheduler):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.host_calls = []

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None):
        self.host_calls.append("train")
        return {"host": True}

    def get_logprobs(self, *, data, micro_batch_size=None):
        self.host_calls.append("get_logprobs")
        return {"host": True}


class MegatronLikeOptimizer:
    """torch SGD behind Megatron's optimizer interface: step() -> (ok, grad_norm, num_zeros)."""

    def __init__(self, params, lr):
        self.params = list(params)
        self.sgd = torch.optim.SGD(self.params, lr=lr)

    def zero_grad(self):
        self.sgd.zero_grad(set_to_none=True)

    def step(self):
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.params if p.grad is not None))
        self.sgd.step()
        return True, float(norm), None


def test_worker_mixin_trains_and_scores_through_dualkv_and_defers_when_off(models, monkeypatch):
    import sys
    import types

    from megatron_dualkv.integrations.nemo_rl import worker

    base, dualkv = models
    data = build_batch(SAME_N, seed=14)
    with torch.no_grad():
        data = with_logprob_keys(data, stock_logprobs(base, data), seed=15)
    loss_cfg = dict(reference_policy_kl_penalty=0.05, ratio_clip_max=0.28)
    section = dict(enabled=True, max_tokens_per_microbatch=24, num_generations_per_prompt=3)
    runner = DualKVPolicyRunner(dualkv, DualKVSettings.from_dict(section), temperature=TEMPERATURE)
    dualkv.zero_grad(set_to_none=True)
    runner.train(data, ClippedPGAdapter.from_config(loss_cfg))
    grads = {n: p.grad.clone() for n, p in dualkv.named_parameters()}
    saved = {n: p.detach().clone() for n, p in dualkv.named_parameters()}
    steps = []
    scheduler = types.SimpleNamespace(step=lambda increment: steps.append(increment))

    class Worker(worker.DualKVWorkerMixin, HostWorker):
        pass

    cfg = {"dualkv": section, "train_global_batch_size": 12, "generation": {"temperature": TEMPERATURE}}
    w = Worker(cfg, dualkv, MegatronLikeOptimizer(dualkv.parameters(), lr=0.5), scheduler)
    try:
        lp = w.get_logprobs(data=data)["logprobs"]
        torch.testing.assert_close(lp, runner.get_logprobs(data), rtol=0, atol=0)
        out = w.train(data, loss_cfg)
        assert steps == [12] and out["global_loss"].shape == (1,) and out["grad_norm"].shape == (1,)
        mb = out["all_mb_metrics"]  # NeMo-RL's per-micro-batch lists, this rank's shares
        assert sum(mb["loss"]) == pytest.approx(out["global_loss"].item(), rel=1e-12)
        assert len(set(map(len, mb.values()))) == 1 and len(mb["loss"]) > 1
        assert set(mb["global_valid_toks"]) == {float((data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum())}
        assert set(mb["grad_norm"]) == {out["grad_norm"].item()}
        for n, p in dualkv.named_parameters():  # one SGD step on the DualKV gradients
            torch.testing.assert_close(p.detach(), saved[n] - 0.5 * grads[n], rtol=1e-12, atol=1e-15)
        assert w.host_calls == []
    finally:
        with torch.no_grad():
            for n, p in dualkv.named_parameters():
                p.copy_(saved[n])
    with pytest.raises(ValueError, match="top_k=20"):
        Worker({"dualkv": section, "generation": {"top_k": 20}}, dualkv, None, None).get_logprobs(data=data)
    off = Worker({"dualkv": {"enabled": False}}, dualkv, None, None)
    assert off.train(data, loss_cfg) == {"host": True} and off.get_logprobs(data=data) == {"host": True}
    assert off.host_calls == ["train", "get_logprobs"]

    # the lazily built worker class subclasses NeMo-RL's worker (stand-in modules here) as a Ray actor
    fake = "nemo_rl.models.policy.workers.megatron_policy_worker"
    for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.policy", "nemo_rl.models.policy.workers", fake):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[fake].MegatronPolicyWorkerImpl = HostWorker
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(remote=lambda cls: ("actor", cls)))
    monkeypatch.setattr(worker, "_CACHE", {})
    kind, cls = worker.DualKVMegatronPolicyWorker
    assert kind == "actor" and cls.__mro__[1:3] == (worker.DualKVWorkerMixin, HostWorker)
    with pytest.raises(AttributeError):
        worker.SomethingElse


# --------------------------------------------------------------------------------------------
# Two data-parallel ranks
# --------------------------------------------------------------------------------------------

DP_LOSS = dict(ratio_clip_max=0.28, ratio_clip_c=3.0, reference_policy_kl_penalty=0.05,
               use_importance_sampling_correction=True)


def dp_rank_task(weights: dict, data: dict) -> list[dict]:
    """One DP rank: its contiguous half of the batch (whole groups, as NeMo-RL's Policy shards
    it), normalisers and metrics all-reduced over the DP group; local gradients back."""
    from megatron.core import parallel_state

    with model_parallel(tp=1) as pgs:
        cfg = qwen3_config("tiny", use_cpu_initialization=True, params_dtype=F64, vocab_size=VOCAB)
        model = to_dualkv_model(build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False).double())
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
        rank, half = dist.get_rank(), data["input_ids"].shape[0] // 2
        shard = {k: v[rank * half:(rank + 1) * half] for k, v in data.items()}
        runner = DualKVPolicyRunner(model, DualKVSettings(max_tokens_per_microbatch=24, num_generations_per_prompt=3),
                                    temperature=TEMPERATURE, dp_group=parallel_state.get_data_parallel_group())
        results = []
        for token_level in (True, False):
            model.zero_grad(set_to_none=True)
            out = runner.train(shard, ClippedPGAdapter.from_config(dict(DP_LOSS, token_level_loss=token_level)))
            results.append({"metrics": out["metrics"][0], "grads": {n: p.grad for n, p in model.named_parameters()},
                            "counts": runner.global_counts(convert_batch(shard, num_generations_per_prompt=3))})
        return results


@pytest.fixture(scope="module")
def gloo():
    """Two spawned gloo ranks, shared by the multi-process tests of this file (one start)."""
    from megatron_cpu import GlooWorkers

    with GlooWorkers(2, timeout_s=120) as workers:
        yield workers


def test_two_dp_ranks_sum_to_the_single_rank_step(models, gloo):
    """Normalisers all-reduced over DP: the ranks' gradients sum to the one-rank gradient of
    the whole batch (what DDP's sum then gives), and the all-reduced metrics equal its metrics."""
    base, dualkv = models
    data = build_batch(SAME_N, seed=16)
    with torch.no_grad():
        data = with_logprob_keys(data, stock_logprobs(base, data), seed=17)
    runner = DualKVPolicyRunner(dualkv, DualKVSettings(max_tokens_per_microbatch=24, num_generations_per_prompt=3),
                                temperature=TEMPERATURE)
    weights = {n: p.detach().clone() for n, p in dualkv.named_parameters()}
    ranks = gloo.run(dp_rank_task, weights, data)
    want = (float((data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()), float(data["sample_mask"].sum()))
    for i, token_level in enumerate((True, False)):
        dualkv.zero_grad(set_to_none=True)
        full = runner.train(data, ClippedPGAdapter.from_config(dict(DP_LOSS, token_level_loss=token_level)))
        full = full["metrics"][0]
        out = [ranks[0][i], ranks[1][i]]
        assert out[0]["counts"] == out[1]["counts"] == want
        for n, p in dualkv.named_parameters():
            torch.testing.assert_close(out[0]["grads"][n] + out[1]["grads"][n], p.grad, rtol=1e-9, atol=1e-14,
                                       msg=lambda s: f"{n} (token_level={token_level}): {s}")
        for r in range(2):
            assert out[r]["metrics"].keys() == full.keys()
            for k, v in full.items():
                assert out[r]["metrics"][k] == pytest.approx(v, rel=1e-9, abs=1e-14), (token_level, k)


def test_runner_through_megatron_ddp_gives_the_bare_model_gradients(models):
    """NeMo-RL's policy is wrapped in Megatron's DistributedDataParallel: layout= passes through
    its forward, gradients land in the DDP buffers (main_grad) and equal the bare model's."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    base, _ = models
    cfg = qwen3_config("tiny", use_cpu_initialization=True, params_dtype=torch.float32, vocab_size=VOCAB)
    bare, wrapped = (to_dualkv_model(build_replicated_model(cfg, pg_collection=base.pg_collection,
                                                            use_transformer_engine=False)) for _ in range(2))
    copy_weights(bare, wrapped)
    ddp = DistributedDataParallel(cfg.transformer, DistributedDataParallelConfig(use_distributed_optimizer=False),
                                  wrapped, pg_collection=base.pg_collection)
    data = build_batch(SAME_N, seed=18)
    with torch.no_grad():
        lp = DualKVPolicyRunner(bare, DualKVSettings(max_tokens_per_microbatch=24, num_generations_per_prompt=3),
                                temperature=TEMPERATURE).get_logprobs(data).double()
    data = with_logprob_keys(data, lp, seed=19)
    adapter = ClippedPGAdapter.from_config(dict(ratio_clip_max=0.28, reference_policy_kl_penalty=0.05))
    settings = DualKVSettings(max_tokens_per_microbatch=24, num_generations_per_prompt=3)
    want = DualKVPolicyRunner(bare, settings, temperature=TEMPERATURE).train(data, adapter)
    got = DualKVPolicyRunner(ddp, settings, temperature=TEMPERATURE).train(data, adapter, zero_grad=ddp.zero_grad_buffer)
    assert got["loss"].item() == pytest.approx(want["loss"].item(), rel=1e-6)
    grads = dict(bare.named_parameters())
    for n, p in wrapped.named_parameters():
        torch.testing.assert_close(p.main_grad, grads[n].grad, rtol=1e-5, atol=1e-7, msg=lambda s: f"{n}: {s}")


def tp_rank_task(data: dict) -> dict:
    """TP=2 with sequence parallelism: the runner's logprobs and loss against the stock model
    under the same TP (replicated rows, vocab-parallel logprobs), same weights on each rank."""
    from megatron_dualkv.megatron import replicated_logprobs

    with model_parallel(tp=2) as pgs:
        cfg = qwen3_config("tiny", use_cpu_initialization=True, params_dtype=F64, vocab_size=VOCAB,
                           tensor_model_parallel_size=2, sequence_parallel=True)
        torch.manual_seed(21)
        stock, model = (build_replicated_model(cfg, pg_collection=pgs, use_transformer_engine=False).double()
                        for _ in range(2))
        copy_weights(stock, model)
        to_dualkv_model(model)
        runner = DualKVPolicyRunner(model, DualKVSettings(max_tokens_per_microbatch=24, num_generations_per_prompt=3),
                                    temperature=TEMPERATURE)
        got = runner.get_logprobs(data)
        batch, mbs, indices = runner.prepare(data)
        with torch.no_grad():
            want = batch.to_sequences([(index, replicated_logprobs(stock, mb.layout, temperature=TEMPERATURE).logprobs)
                                       for mb, index in zip(mbs, indices)], dtype=F64)
        return {"pad": runner.pad_to_multiple, "sizes": [mb.layout.num_tokens for mb in mbs], "got": got, "want": want}


def test_tensor_parallel_with_sequence_parallelism_pads_and_matches_the_stock_model(gloo):
    data = build_batch(SAME_N, seed=22)
    out = gloo.run(tp_rank_task, data)
    for r in out:
        assert r["pad"] == 2 and all(n % 2 == 0 for n in r["sizes"])
        span = response_span(data)
        torch.testing.assert_close(r["got"][span].double(), r["want"][span], rtol=1e-6, atol=1e-6)
        assert (r["got"][~span] == 0).all()
    torch.testing.assert_close(out[0]["got"], out[1]["got"], rtol=0, atol=0)
