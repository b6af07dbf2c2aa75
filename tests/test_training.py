"""The training script's pieces on CPU: forward_step/loss_func, normalisation, resume, main job.

- PolicyForwardStep on a packed micro-batch == the same on the replicated batch (--no-dualkv):
  loss sum, count, metrics and every parameter gradient (dense and MoE with aux loss, float64).
- Megatron's per-token-loss path (DDP + forward_backward + finalize_model_grads) over a step
  packed into two micro-batches (plus an empty slot) gives the gradient of the global token
  mean, equal to one micro-batch holding everything and to policy_loss computed directly.
- The CPU runner's checkpoint (torch.save of model, optimizer, reference policy, old-logprob
  cache) resumes to exactly the losses of an uninterrupted run.
- The script's main job runs end to end (subprocess, 2 steps), writes a checkpoint, and gives the
  same step records as the same job through megatron.training.pretrain() on CPU.
- pretrain() saves Megatron checkpoints and resumes from them to the same next loss.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from megatron_dualkv.data import DEFAULT_ROLLOUTS, RolloutGroup, read_rollouts
from megatron_dualkv.layout import Group, build_layout
from megatron_dualkv.loss import PolicyLossConfig, policy_loss
from megatron_dualkv.packing import PackingConfig
from megatron_dualkv.training.args import check_parallelism
from megatron_dualkv.training.data import RolloutStepStream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512
F64 = torch.float64
LOSS = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_beta=0.1)


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gloo():
    from megatron_cpu import gloo_world_of_one

    with gloo_world_of_one():
        yield


def runtime(tp: int = 1):
    import contextlib

    from megatron_cpu import cuda_rng_state_on_cpu, megatron_cpu_shims, model_parallel

    stack = contextlib.ExitStack()
    stack.enter_context(megatron_cpu_shims())
    stack.enter_context(cuda_rng_state_on_cpu())
    pgs = stack.enter_context(model_parallel(tp=tp))
    return stack, pgs


def tiny_config(size: str, dtype=F64):
    from megatron.core.distributed import finalize_model_grads
    from megatron_dualkv.megatron import qwen3_config

    return qwen3_config(size, vocab_size=VOCAB, use_cpu_initialization=True, params_dtype=dtype,
                        calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads)


def build(cfg, dualkv: bool, pgs, seed: int):
    from megatron_dualkv.training.providers import build_policy_model

    torch.manual_seed(seed)
    model = build_policy_model(cfg, dualkv=dualkv, pg_collection=pgs, use_transformer_engine=False)
    return model.to(cfg.transformer.params_dtype)


def records_with_logprobs(model, records: list[RolloutGroup], seed: int) -> list[RolloutGroup]:
    """The records with old/reference logprobs near the model's own (ratios around 1, wide enough
    for every clip to bind) and a loss mask dropping some tokens."""
    groups = [Group.of(r.prompt, r.responses, name=r.group_id) for r in records]
    layout = build_layout(groups, vocab_size=VOCAB)
    with torch.no_grad():
        lp = model(layout=layout).logprobs.double()
    g = torch.Generator().manual_seed(seed)
    old = lp + 0.6 * torch.randn(lp.shape, generator=g, dtype=F64)
    ref = lp - 0.3 * torch.randn(lp.shape, generator=g, dtype=F64).abs()
    out, e = [], 0
    for i, r in enumerate(records):
        olds, refs, masks = [], [], []
        for j, resp in enumerate(r.responses):
            n = len(resp)
            olds.append(old[e:e + n].clamp(max=0).tolist())
            refs.append(ref[e:e + n].clamp(max=0).tolist())
            masks.append([0 if (t + i + j) % 5 == 0 else 1 for t in range(n)])
            e += n
        out.append(RolloutGroup(r.group_id, r.prompt, r.responses, rewards=r.rewards, advantages=r.advantages,
                                old_logprobs=olds, ref_logprobs=refs, loss_mask=masks))
    return out


def stream_of(records, max_tokens: int, micro_batches: int, **kw) -> RolloutStepStream:
    cfg = PackingConfig(max_tokens=max_tokens, dp_size=1, vocab_size=VOCAB, seed=5)
    return RolloutStepStream(records, groups_per_step=len(records), micro_batches_per_step=micro_batches,
                             packing=cfg, dp_rank=0, **kw)


def grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        assert g is not None, f"{n} has no gradient"
        out[n] = g.detach().clone()
    return out


def assert_grads_close(got: dict, want: dict, rtol: float, atol: float, what: str) -> None:
    """Elementwise to rtol, with atol relative to the largest entry of each gradient."""
    assert got.keys() == want.keys()
    for n in want:
        scale = float(want[n].abs().max())
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol * scale, msg=lambda s: f"{what}: {n}: {s}")
    assert any(g.abs().max() > 0 for g in want.values()), f"{what}: every gradient is zero"


# ------------------------------------------------------------------------------------------------
# forward_step + loss_func: DualKV == replicated
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_forward_step_and_loss_func_equal_the_replicated_batch(gloo, size):
    from megatron_dualkv.megatron import copy_weights
    from megatron_dualkv.training.step import PolicyForwardStep

    stack, pgs = runtime()
    with stack:
        cfg = tiny_config(size)
        model = build(cfg, True, pgs, seed=11)
        base = build(cfg, False, pgs, seed=12)
        copy_weights(model, base)
        records = records_with_logprobs(model, read_rollouts(DEFAULT_ROLLOUTS, vocab_size=VOCAB)[:5], seed=3)
        item = next(i for i in stream_of(records, 4096, 1).step_items(0) if i.micro_batch is not None)
        results = {}
        for name, net, dualkv in (("dualkv", model, True), ("replicated", base, False)):
            out, loss_func = PolicyForwardStep(LOSS, dualkv=dualkv)(iter([item]), net)
            loss_sum, count, metrics = loss_func(out)
            loss_sum.backward()
            results[name] = (loss_sum.detach(), count, metrics, grads(net))

    (ld, nd, md, gd), (lr, nr, mr, gr) = results["dualkv"], results["replicated"]
    mb = item.micro_batch
    assert int(nd) == int(nr) == int(mb.loss_mask.sum())  # valid loss tokens, masked ones excluded
    assert 0 < int(nd) < mb.layout.num_edges
    torch.testing.assert_close(ld, lr, rtol=1e-9, atol=0)
    assert md.keys() == mr.keys()
    for k in md:
        torch.testing.assert_close(md[k], mr[k], rtol=1e-6, atol=1e-9, msg=lambda s: f"metric {k}: {s}")
    assert md["clip_fraction"][0] > 0 and md["kl"][0] > 0, "the rollout must exercise clipping and the KL"
    assert md["dedup_ratio"][0] / md["dedup_ratio"][1] > 1.5
    # Megatron's router softmax is float32 even in a float64 model: MoE to float32 rounding
    tol = dict(rtol=1e-6, atol=1e-6) if "moe" in size else dict(rtol=1e-9, atol=1e-12)
    assert_grads_close(gd, gr, **tol, what=f"{size} DualKV vs replicated")


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_flop_model_counts_the_matrices_a_token_passes_through(gloo, size):
    """token_matmul_flops == 2 x the weights of every matrix a token multiplies (experts: top-k of
    them), read off the built model; a step adds the logits at the loss rows and the pairs."""
    from megatron_dualkv.flops import attention_flops
    from megatron_dualkv.model_shape import ModelShape
    from megatron_dualkv.training.data import StepTotals

    stack, pgs = runtime()
    with stack:
        cfg = tiny_config(size)
        model = build(cfg, True, pgs, seed=1)
        t = cfg.transformer
        per_token = 0.0
        for name, p in model.named_parameters():
            if p.dim() != 2 or "embedding" in name or "output_layer" in name:
                continue
            share = t.moe_router_topk / t.num_moe_experts if "local_experts" in name else 1.0
            per_token += 2.0 * p.numel() * share
        shape = ModelShape.of(t, cfg.vocab_size)
    assert shape.token_matmul_flops() == pytest.approx(per_token, rel=1e-12)
    totals = StepTotals(groups=1, responses=2, packed_tokens=10, replicated_tokens=16, loss_edges=4,
                        attention_pairs=40, replicated_attention_pairs=70, micro_batches_per_rank=1)
    want = 3 * (10 * per_token + 4 * 2 * t.hidden_size * cfg.vocab_size) + t.num_layers * attention_flops(
        40, t.num_attention_heads, t.kv_channels, backward=True)
    assert shape.useful_flops(totals) == pytest.approx(want, rel=1e-12)
    assert shape.replicated_flops(totals) > shape.useful_flops(totals)


# ------------------------------------------------------------------------------------------------
# Token-level normalisation through Megatron's schedule
# ------------------------------------------------------------------------------------------------

def test_two_micro_batches_plus_an_empty_slot_equal_one_micro_batch_and_the_global_token_mean(gloo):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_dualkv.megatron import copy_weights
    from megatron_dualkv.training.runner import build_ddp_and_optimizer
    from megatron_dualkv.training.step import PolicyForwardStep

    stack, pgs = runtime()
    with stack:
        cfg = tiny_config("tiny")
        base_model = build(cfg, True, pgs, seed=21)
        records = records_with_logprobs(base_model, read_rollouts(DEFAULT_ROLLOUTS, vocab_size=VOCAB)[:6], seed=4)
        one = stream_of(records, 4096, 2).step_items(0)  # 1 real micro-batch + 1 empty slot
        two = stream_of(records, 384, 4).step_items(0)  # the same groups split, in 4 slots
        assert sum(i.micro_batch is None for i in one) == 1
        assert sum(i.micro_batch is not None for i in two) >= 2, "the small budget must split the step"

        def step_grads(items):
            model = build(cfg, True, pgs, seed=99)
            copy_weights(base_model, model)
            ddp, _ = build_ddp_and_optimizer(model, cfg.transformer, pg_collection=pgs)
            ddp.zero_grad_buffer()
            losses = get_forward_backward_func()(
                forward_step_func=PolicyForwardStep(LOSS), data_iterator=iter(items), model=[ddp],
                num_microbatches=len(items), seq_length=0, micro_batch_size=1, forward_only=False,
                pg_collection=pgs)
            s = torch.stack([d["loss"] for d in losses]).sum(0)
            return s[0] / s[1], grads(model)

        loss_one, g_one = step_grads(one)
        loss_two, g_two = step_grads(two)

        # directly: the token mean over the whole step on one layout
        mb = next(i.micro_batch for i in one if i.micro_batch is not None)
        model = build(cfg, True, pgs, seed=98)
        copy_weights(base_model, model)
        loss, _ = policy_loss(model(layout=mb.layout).logprobs, mb.policy_batch(), mb.layout, LOSS)
        loss.backward()
        g_direct = grads(model)

    torch.testing.assert_close(loss_two.double(), loss_one.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss_one.double(), loss.detach(), rtol=1e-6, atol=0)
    # Megatron DDP accumulates main_grad in float32 (the model is float64): float32 rounding. A
    # wrong normaliser (per micro-batch, or a missing empty-slot count) is off by O(1).
    assert_grads_close(g_one, g_direct, rtol=1e-6, atol=1e-6, what="schedule (1 micro-batch) vs policy_loss")
    assert_grads_close(g_two, g_direct, rtol=1e-6, atol=1e-6, what="schedule (2 micro-batches) vs policy_loss")


# ------------------------------------------------------------------------------------------------
# Checkpoint and resume
# ------------------------------------------------------------------------------------------------

def test_resume_from_checkpoint_reproduces_the_next_losses_exactly(gloo, tmp_path):
    from megatron_dualkv.training.log import StepLog
    from megatron_dualkv.training.runner import build_ddp_and_optimizer, load_checkpoint, save_checkpoint, train_steps
    from megatron_dualkv.training.step import OldLogprobCache, PolicyForwardStep, ReferencePolicy
    from megatron_dualkv.model_shape import ModelShape

    records = read_rollouts(DEFAULT_ROLLOUTS, vocab_size=VOCAB)[:8]

    def run(seed: int, start: int, steps: int, load: str | None = None, save: str | None = None) -> list[float]:
        stack, pgs = runtime()
        with stack:
            cfg = tiny_config("tiny", torch.float32)
            model = build(cfg, True, pgs, seed=seed)
            reference = ReferencePolicy(build(cfg, True, pgs, seed=seed + 1), dualkv=True)
            reference.model.load_state_dict(model.state_dict())
            cache = OldLogprobCache()
            ddp, opt = build_ddp_and_optimizer(model, cfg.transformer, pg_collection=pgs, lr=1e-2)
            if load:
                done, extra = load_checkpoint(load, ddp, opt)
                assert done == start
                reference.model.load_state_dict(extra["reference"])
                cache.load_state_dict(extra["old_logprobs"])
            cfg_pack = PackingConfig(max_tokens=256, dp_size=1, vocab_size=VOCAB, seed=1)
            stream = RolloutStepStream(records, groups_per_step=4, micro_batches_per_step=4, packing=cfg_pack,
                                       dp_rank=0, updates_per_batch=2)
            log = StepLog(ModelShape.of(cfg.transformer, cfg.vocab_size))
            fs = PolicyForwardStep(LOSS, log=log, reference=reference, old_logprobs=cache)
            recs = train_steps(ddp, opt, fs, stream.iterate(start_step=start), num_steps=steps, num_microbatches=4,
                               log=log, pg_collection=pgs)
            if save:
                save_checkpoint(save, start + steps, ddp, opt,
                                {"reference": reference.model.state_dict(), "old_logprobs": cache.state_dict()})
            return [r.loss for r in recs]

    full = run(seed=3, start=0, steps=3)
    ckpt = str(tmp_path / "ckpt")
    first = run(seed=3, start=0, steps=1, save=ckpt)
    resumed = run(seed=77, start=1, steps=2, load=ckpt)  # other init: everything must come from the file
    assert first == full[:1]
    assert resumed == full[1:], f"resumed {resumed} != uninterrupted {full[1:]}"
    assert len(set(full)) == 3  # the steps differ (the test would not notice a stale model otherwise)


# ------------------------------------------------------------------------------------------------
# The main job, and errors
# ------------------------------------------------------------------------------------------------

def test_the_cpu_main_job_runs_end_to_end_and_matches_the_pretrain_path(tmp_path):
    """The default job (2 of its steps: the second is its off-policy update with KL to the initial
    policy) on the CPU runner, and the same job through pretrain() (tests/pretrain_on_cpu.py):
    the same step records."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MEGATRON_DUALKV_CPU_RUNNER="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    save = tmp_path / "ckpt"
    job = ["--demo", "--train-iters", "2", "--groups-per-step", "4"]
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "pretrain_grpo_dualkv.py"), *job,
         "--save", str(save), "--save-interval", "2", "--step-log", str(tmp_path / "cpu.jsonl")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.lstrip().startswith("step ") and "| loss" in l]
    assert [l.split("|")[0].split()[1] for l in lines] == ["1", "2"], proc.stdout[-3000:]
    for key in ("loss", "kl", "clip", "tok/s", "dedup", "MFU"):
        assert all(key in l for l in lines), (key, lines)
    assert (save / "rank00000.pt").exists()

    cpu = [json.loads(l) for l in open(tmp_path / "cpu.jsonl")]
    pre = _run_pretrain_on_cpu(job, tmp_path / "pretrain.jsonl", defaults=False)
    assert cpu[1]["kl"] > 0 and cpu[1]["clip_fraction"] > 0
    for a, b in zip(cpu, pre, strict=True):
        for k in ("loss", "kl", "clip_fraction", "ratio", "dedup_ratio"):
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (a["step"], k, a[k], b[k])


def off_policy_rollouts(path) -> str:
    """The first 12 shipped groups with old and reference logprobs near a random tiny model's
    (about -log 512), so that the loss depends on the weights (ratio and KL), not only on the data."""
    from megatron_dualkv.data import write_rollouts

    g = torch.Generator().manual_seed(8)
    out = []
    for r in read_rollouts(DEFAULT_ROLLOUTS, vocab_size=VOCAB)[:12]:
        lp = lambda: [(-6.2 + 0.3 * torch.randn(len(x), generator=g, dtype=F64)).clamp(max=0).tolist() for x in r.responses]
        out.append(RolloutGroup(r.group_id, r.prompt, r.responses, advantages=r.advantages,
                                old_logprobs=lp(), ref_logprobs=lp()))
    write_rollouts(out, str(path))
    return str(path)


def _run_pretrain_on_cpu(args: list[str], step_log, defaults: bool = True) -> list[dict]:
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_MAX_CONNECTIONS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    base = ["--demo", "--kl-reference", "data", "--kl-beta", "0.05", "--updates-per-batch", "1",
            "--groups-per-step", "4", "--train-iters", "3"] if defaults else []
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "pretrain_on_cpu.py"), *base, *args,
                           "--step-log", str(step_log)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    # Megatron's own exits (sys.exit() without a code) hide failures behind status 0: read the log
    assert proc.returncode == 0 and "Traceback" not in out and "exiting ..." not in out, out[-4000:]
    return [json.loads(l) for l in open(step_log)] if os.path.exists(step_log) else []


def test_pretrain_path_saves_megatron_checkpoints_and_resumes_to_the_same_losses(tmp_path):
    """The script's GPU path, megatron.training.pretrain(), run on a CPU (tests/pretrain_on_cpu.py):
    three iterations saving Megatron (torch_dist) checkpoints at 2 and 3; then a fresh process
    loads the one of iteration 2 (--load) and runs iteration 3, which must give the same loss.
    The rollouts carry old and reference logprobs: the loss depends on the weights (an on-policy
    loss without KL would not: -mean(advantage) whatever the model)."""
    rollouts = off_policy_rollouts(tmp_path / "rollouts.jsonl")
    ckpt = tmp_path / "ckpt"
    full = _run_pretrain_on_cpu(["--rollouts", rollouts, "--save", str(ckpt), "--save-interval", "2"],
                                tmp_path / "full.jsonl")
    assert [r["step"] for r in full] == [1, 2, 3], full
    assert (ckpt / "iter_0000002").is_dir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _run_pretrain_on_cpu(["--rollouts", rollouts, "--load", str(ckpt)], tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [3], resumed
    assert resumed[0]["loss"] == full[2]["loss"] and resumed[0]["kl"] == full[2]["kl"]
    assert full[2]["kl"] > 0 and full[2]["clip_fraction"] > 0



def test_flags_given_after_demo_win_and_the_preset_follows_the_last_model_size():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_grpo_dualkv as script

    argv = script.build_argv(["--demo", "--model-size", "tiny-moe", "--train-iters", "7"])
    assert argv[argv.index("--num-experts") + 1] == "4"  # the tiny-moe preset, not the demo's tiny
    assert script._flag_value(argv, "--train-iters") == "7"
    assert "--calculate-per-token-loss" in argv and script._flag_value(argv, "--dataloader-type") == "external"
    assert script.build_argv([]) == script.build_argv(["--demo"])


def test_rollout_batches_walk_seeded_epochs_without_repeating_a_group_in_a_batch():
    records = read_rollouts(DEFAULT_ROLLOUTS, vocab_size=VOCAB)[:5]
    stream = RolloutStepStream(records, groups_per_step=2, micro_batches_per_step=4,
                               packing=PackingConfig(max_tokens=4096, vocab_size=VOCAB), dp_rank=0, seed=3)
    ids = [[r.group_id for r in stream.batch_records(b)] for b in range(5)]
    assert all(len(set(b)) == 2 for b in ids)
    first_epoch = [g for b in ids[:2] for g in b] + ids[2][:1]  # batch 2 straddles epochs 0 and 1
    assert sorted(first_epoch) == sorted(r.group_id for r in records)
    assert ids == [[r.group_id for r in stream.batch_records(b)] for b in range(5)]  # deterministic
    other = RolloutStepStream(records, groups_per_step=2, micro_batches_per_step=4,
                              packing=PackingConfig(max_tokens=4096, vocab_size=VOCAB), dp_rank=0, seed=4)
    assert ids != [[r.group_id for r in other.batch_records(b)] for b in range(5)]
    # every update of a rollout batch sees the same micro-batches; empty slots come first
    s2 = RolloutStepStream(records, groups_per_step=2, micro_batches_per_step=4,
                           packing=PackingConfig(max_tokens=4096, vocab_size=VOCAB), dp_rank=0, updates_per_batch=2)
    a, b, c = s2.step_items(0), s2.step_items(1), s2.step_items(2)
    assert [(i.batch, i.update) for i in (a[0], b[0], c[0])] == [(0, 0), (0, 1), (1, 0)]
    assert [i.micro_batch is None for i in a] == [True, True, True, False]
    assert a[-1].micro_batch is b[-1].micro_batch and a[-1].micro_batch is not c[-1].micro_batch


def _args(**kw):
    base = dict(pipeline_model_parallel_size=1, context_parallel_size=1, micro_batch_size=1, groups_per_step=2,
                updates_per_batch=1)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(pipeline_model_parallel_size=2), "pipeline parallelism"),
    (dict(context_parallel_size=2, no_dualkv=True), "--no-dualkv does not support context parallelism"),
    (dict(micro_batch_size=2), "micro-batch-size must be 1"),
    (dict(groups_per_step=0), "groups-per-step"),
])
def test_unsupported_settings_are_refused_with_the_reason(kw, match):
    with pytest.raises(ValueError, match=match):
        check_parallelism(_args(**kw))
    check_parallelism(_args())


def test_a_step_that_needs_more_micro_batches_than_megatron_runs_is_an_error():
    records = read_rollouts(DEFAULT_ROLLOUTS, vocab_size=VOCAB)[:6]
    with pytest.raises(ValueError, match=r"rollout batch 0: its 6 groups need \d+ micro-batches .* at most 1"):
        stream_of(records, 256, 1).step_items(0)
    with pytest.raises(ValueError, match="cannot repeat a group"):
        RolloutStepStream(records, groups_per_step=7, micro_batches_per_step=1,
                          packing=PackingConfig(max_tokens=256), dp_rank=0)
