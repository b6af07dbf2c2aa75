"""tools/gpu_policy_update.sh, the eight-GPU issue's device script, checked on the CPU (DRY_CPU=1: 4 gloo
ranks through tests/pretrain_on_cpu.py, a shrunken 30B-A3B-shaped MoE, TP=2 + SP, EP=4, full
recomputation): its four paths run, every step logs, the same rollouts give the same loss on every path,
the table it writes names each run with its exact command; and with --moe-grouped-gemm (grouped experts
without TE) pretrain() gives the same losses as with Megatron's SequentialMLP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 2
RUNS = ("q30b_dualkv", "q30b_reprollouts", "q30b_nodualkv_sdpa", "q30b_nodualkv")
TINY = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 4 "
        "--kv-channels 16 --vocab-size 256 --num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2")


def _run_script(tmp_path, name: str, extra: str = "", only: str = ""):
    logs, out = tmp_path / name / "logs", tmp_path / name / "out"
    env = dict(os.environ, DRY_CPU="1", MODEL="30b-a3b", NPROC="4", NGROUPS="2", N="4", P="64", R_MAX="32",
               R_MIN="8", VOCAB="256", TOKENS="256", ITERS=str(ITERS), BUDGET_S="400", LOGS=str(logs), OUT=str(out),
               ROLLOUT_DIR=str(tmp_path), ONLY=only,
               EXTRA=f"{TINY} {extra}", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               # the script calls python3: this interpreter's (the test environment's torch and megatron)
               PATH=os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", ""))),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_policy_update.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = dict(line.split("\t")[:2] for line in (logs / "steps.tsv").read_text().splitlines())
    losses = {}
    for run, rc in steps.items():
        assert rc == "0", (steps, proc.stdout[-3000:])
        recs = [json.loads(l) for l in (logs / f"{run}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == list(range(1, ITERS + 1)), run
        losses[run] = [r["loss"] for r in recs]
    return steps, losses, (out / "policy_update_table.md").read_text()


def test_the_device_script_runs_every_path_on_the_same_rollouts(tmp_path):
    steps, losses, table = _run_script(tmp_path, "sequential")
    assert list(steps) == list(RUNS)
    # one loss per iteration, the same on every path (fp32 on the CPU: rounding only)
    for name in RUNS[1:]:
        for a, b in zip(losses[RUNS[0]], losses[name]):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (name, losses)
    for name in RUNS:
        assert f"| {name} | 30b-a3b | TP2+SP DP2 EP4 ETP1" in table
    rows = {l.split(" | ")[0][2:]: l for l in table.splitlines() if " | 30b-a3b | " in l}
    # the stock models' own log lines: --stock-attention reached the model that ran
    assert "torch SDPA (SdpaDotProductAttention)" in rows["q30b_nodualkv_sdpa"], rows
    assert "unfused (DotProductAttention)" in rows["q30b_nodualkv"], rows
    assert "--expert-model-parallel-size 4" in table  # the exact commands are in it

    # --moe-grouped-gemm (no TE here: GroupedGemmSequentialMLP) through pretrain(): the same losses as
    # Megatron's SequentialMLP experts above
    steps, grouped, _ = _run_script(tmp_path, "grouped", "--moe-grouped-gemm", only="_(dualkv|reprollouts)$")
    assert list(steps) == ["q30b_dualkv", "q30b_reprollouts"]
    for name, values in grouped.items():
        for a, b in zip(losses[name], values, strict=True):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (name, losses[name], values)
