"""The training script under context parallelism: CP=2 equals CP=1, bad combinations refused.

examples/pretrain_grpo_dualkv.py's pretrain() path runs on CPU through tests/pretrain_on_cpu.py
(gloo); CP=2 runs on 2 ranks under torchrun, CP=1 on one, same arguments, seed and rollouts
(old and reference logprobs given, KL 0.05, so the loss depends on the weights).

What is compared, and why it tests the CP glue (providers, loss_func, token count, log):
- step 1: loss, KL, clip fraction, ratio (the forward, and the loss over logprobs gathered
  across CP ranks);
- step 2 trains on the same rollout batch (--updates-per-batch 2; old logprobs from the file)
  after one SGD step (--optimizer sgd: the update is lr x gradient, not Adam's ~sign), so its
  loss is L(w - lr g): a wrong gradient moves it (e.g. the micro-batch's token count reported
  by both CP ranks halves g, which moves step 2's loss by about half of step 1 -> step 2);
- Megatron's own "grad norm" in its iteration line (3 digits: all it prints);
- the step's totals (tokens, pairs) and FLOPs x time x devices in our step log: counted once
  per step, not once per CP rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

import pytest

from megatron_cpu import free_port
from test_training import off_policy_rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 0.5
# tiny chunks so that a micro-batch of a few hundred tokens splits into several chunks per rank
# (the default 128-row chunks would pad it to 2 x 8 x 128 rows)
JOB = ["--demo", "--kl-reference", "data", "--kl-beta", "0.05", "--updates-per-batch", "2", "--groups-per-step", "8",
       "--train-iters", "2", "--optimizer", "sgd", "--lr", str(LR), "--min-lr", str(LR),
       "--cp-chunks-per-rank", "2", "--cp-chunk-multiple", "16", "--log-interval", "1"]


def run_script(args: list[str], nproc: int, step_log) -> tuple[int, str, list[dict]]:
    # PYTHONPATH: this checkout's package, whatever the environment's editable install points at
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=pythonpath)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    proc = subprocess.run([*launcher, os.path.join(ROOT, "tests", "pretrain_on_cpu.py"), *args, "--step-log", str(step_log)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    records = [json.loads(line) for line in open(step_log)] if os.path.exists(step_log) else []
    return proc.returncode, out, records


def megatron_grad_norms(out: str) -> list[str]:
    return re.findall(r"iteration\s+\d+/\s*\d+ \|.*?grad norm: ([0-9.]+)", out)


@pytest.mark.parametrize("extra", [[], ["--model-size", "tiny-moe", "--cp-comm-type", "a2a"]],
                         ids=["dense-all_gather", "moe-a2a"])
def test_pretrain_cp2_equals_cp1(tmp_path, extra):
    rollouts = off_policy_rollouts(tmp_path / "rollouts.jsonl")
    job = JOB + ["--rollouts", rollouts] + extra
    results = {}
    for cp in (1, 2):
        rc, out, recs = run_script(job + ["--context-parallel-size", str(cp)], cp, tmp_path / f"cp{cp}.jsonl")
        # Megatron's own exits (sys.exit() without a code) hide failures behind status 0: read the log
        assert rc == 0 and "Traceback" not in out and "exiting ..." not in out, out[-4000:]
        assert f"context-parallel size: {cp}," in out, "Megatron did not run with the CP size asked for"
        assert [r["step"] for r in recs] == [1, 2], out[-3000:]
        results[cp] = (recs, megatron_grad_norms(out))

    (one, norms_one), (two, norms_two) = results[1], results[2]
    for a, b in zip(one, two, strict=True):
        for k in ("loss", "pg_loss", "kl", "clip_fraction", "ratio", "dedup_ratio"):
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (a["step"], k, a[k], b[k])
        assert b["totals"] == a["totals"], "the step's totals must be the same (counted once, not per CP rank)"
        # deduplicated FLOPs of the step, spread over all devices: equal step FLOPs
        assert b["useful_tflops"] * b["seconds"] * 2 == pytest.approx(a["useful_tflops"] * a["seconds"], rel=1e-9)
    # the test has power: the loss depends on the weights and step 2 moved it by far more than the tolerance
    assert one[0]["kl"] > 0 and one[0]["clip_fraction"] > 0
    moved = abs(one[0]["loss"] - one[1]["loss"])
    assert moved > 1e4 * 1e-6 * abs(one[1]["loss"]), (one[0]["loss"], one[1]["loss"])
    assert len(norms_one) == 2 and norms_one == norms_two and float(norms_one[0]) > 0, (norms_one, norms_two)


def test_no_dualkv_with_context_parallelism_is_refused_by_the_script(tmp_path):
    rc, out, recs = run_script(["--demo", "--no-dualkv", "--context-parallel-size", "2", "--train-iters", "1"], 2,
                               tmp_path / "refused.jsonl")
    assert rc != 0 and not recs
    assert "--no-dualkv does not support context parallelism" in out, out[-3000:]
    assert "Transformer Engine" in out


def _args(**kw):
    base = dict(pipeline_model_parallel_size=1, context_parallel_size=2, micro_batch_size=1, groups_per_step=2,
                updates_per_batch=1, no_dualkv=False, cp_comm_type=["all_gather"], hierarchical_context_parallel_sizes=None,
                hybrid_context_parallel=False, cp_chunks_per_rank=8, cp_chunk_multiple=128,
                tensor_model_parallel_size=1, sequence_parallel=False)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(no_dualkv=True), "--no-dualkv does not support context parallelism"),
    (dict(cp_comm_type=["p2p"]), r"--cp-comm-type p2p: .* \['p2p'\] exist only inside Transformer Engine"),
    (dict(cp_comm_type=["all_gather", "a2a+p2p"]), r"\['a2a\+p2p'\]"),
    (dict(hierarchical_context_parallel_sizes=[2, 1]), "hierarchical-context-parallel-sizes"),
    (dict(hybrid_context_parallel=True), "hybrid-context-parallel"),
    (dict(cp_chunk_multiple=0), "--cp-chunk-multiple must be >= 1"),
    (dict(cp_chunks_per_rank=0), "--cp-chunks-per-rank must be >= 1"),
])
def test_bad_context_parallel_combinations_are_refused_with_the_reason(kw, match):
    from megatron_dualkv.training.args import check_parallelism

    with pytest.raises(ValueError, match=match):
        check_parallelism(_args(**kw))
    check_parallelism(_args())
    check_parallelism(_args(cp_comm_type=["a2a"]))
    check_parallelism(_args(context_parallel_size=1, no_dualkv=True, cp_comm_type=["p2p"]))  # CP=1: nothing to check


def test_padding_and_chunk_rules_under_context_parallelism():
    from megatron_dualkv.training.args import cp_chunk_multiple, pad_to_multiple

    # the packer pads for TP under SP; under CP the model's partition pads (nothing for the packer)
    assert pad_to_multiple(_args(context_parallel_size=1, tensor_model_parallel_size=2, sequence_parallel=True)) == 2
    assert pad_to_multiple(_args(tensor_model_parallel_size=2, sequence_parallel=True)) == 1
    # every CP rank's rows split over TP under SP: the chunk multiple is made a multiple of tp
    assert cp_chunk_multiple(_args(cp_chunk_multiple=16, tensor_model_parallel_size=3, sequence_parallel=True)) == 48
    assert cp_chunk_multiple(_args(cp_chunk_multiple=16, tensor_model_parallel_size=3)) == 16


def test_script_arguments_for_context_parallelism():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_grpo_dualkv as script

    argv = script.build_argv(["--context-parallel-size", "3", "--max-tokens-per-micro-batch", "1000"])
    # Megatron asserts --seq-length % (2 * cp) == 0: the budget rounded down to a multiple of 6
    assert script._flag_value(argv, "--seq-length") == "996"
    # Megatron's default --cp-comm-type is TE's p2p ring: the script asks for DualKV's all-gather
    assert script._flag_value(argv, "--cp-comm-type") == "all_gather"
    argv = script.build_argv(["--demo", "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--seq-length", "64"])
    assert script._flag_value(argv, "--cp-comm-type") == "a2a" and script._flag_value(argv, "--seq-length") == "64"
    # a long-prompt micro-batch (P + N*R tokens) is longer than any position in it: Megatron's
    # max_position_embeddings >= seq_length check must not refuse it (the 8b preset has 40960)
    argv = script.build_argv(["--model-size", "8b", "--context-parallel-size", "4",
                              "--max-tokens-per-micro-batch", "65536"])
    assert script._flag_value(argv, "--seq-length") == "40960"
    assert script._flag_value(argv, "--max-tokens-per-micro-batch") == "65536"


def test_a_long_prompt_cp_launch_passes_megatron_validation():
    """Qwen3-8B on 8 GPUs, TP=2 + SP, CP=2, DP=2, one 64K-token micro-batch (N=16, P=32K, R=2K):
    the script's argv passes Megatron's parse_and_validate_args and our checks (no TE needed)."""
    from test_launch_scripts import world

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_grpo_dualkv as script

    argv = ["--model-size", "8b", "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--context-parallel-size", "2", "--max-tokens-per-micro-batch", "65536", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-6"]
    with world(8, "1"):
        args = script.parse_megatron_args(script.build_argv(argv), quiet=True)
    assert (args.tensor_model_parallel_size, args.context_parallel_size, args.data_parallel_size) == (2, 2, 2)
    assert args.cp_comm_type == ["all_gather"] and args.seq_length == 40960
    assert args.max_tokens_per_micro_batch == 65536
