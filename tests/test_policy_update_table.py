"""tools/policy_update_table.py: the eight-GPU table's arithmetic (medians after the first iteration,
baseline MFU in the DualKV run's deduplicated FLOPs, peak memory, the cause of a failed run)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from policy_update_table import render, run_result  # noqa: E402


def _record(step, seconds, mfu, loss=0.5):
    return {"step": step, "loss": loss, "seconds": seconds, "tokens_per_s": 1000.0 / seconds,
            "packed_tokens_per_s": 200.0 / seconds, "useful_tflops": 989.0 * mfu, "mfu": mfu,
            "totals": {"micro_batches_per_rank": 3}}


def _write_run(logs, name, records, log_text, path="DualKV", baseline_of=None, rc="0"):
    with open(os.path.join(logs, name + ".jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with open(os.path.join(logs, name + ".log"), "w") as f:
        f.write(log_text)
    with open(os.path.join(logs, "runs.jsonl"), "a") as f:
        f.write(json.dumps({"name": name, "model": "8b", "layout": "TP4+SP DP2", "path": path,
                            "baseline_of": baseline_of, "command": f"torchrun ... {name} {path}"}) + "\n")
    with open(os.path.join(logs, "steps.tsv"), "a") as f:
        f.write(f"{name}\t{rc}\t60\t\n")


MEMORY_LINE = "[Rank {r}] (after 3 iterations) memory (MB) | allocated: 1000.0 | max allocated: {mb} | reserved: 1\n"


@pytest.fixture
def logs(tmp_path):
    d = str(tmp_path)
    # iteration 1 warms up (slow): it must not enter the medians
    _write_run(d, "dkv", [_record(1, 14.0, 0.13), _record(2, 4.0, 0.42), _record(3, 4.4, 0.40)],
               "DualKV attention backend: cuda on cuda:0\n" + MEMORY_LINE.format(r=0, mb=95744.0)
               + MEMORY_LINE.format(r=1, mb=94720.0))
    # the replicated batch runs at the same hardware rate but has 4.5x the work: its own "mfu" counts
    # the replicated FLOPs; the table must count the DualKV run's useful work instead
    _write_run(d, "rep", [_record(1, 30.0, 0.3), _record(2, 19.0, 0.43), _record(3, 18.8, 0.43, loss=0.5 + 3e-8)],
               "DualKV attention backend: cuda on cuda:0\n", path="replicated rollouts", baseline_of="dkv")
    _write_run(d, "oom", [], "[rank7]: Failed to CUDA calloc async 24 bytes\n"
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
               path="--no-dualkv", baseline_of="dkv", rc="1")
    return d


def test_medians_skip_the_first_iteration_and_peak_is_per_rank(logs):
    r = run_result(logs, "dkv")
    assert r["s"] == pytest.approx(4.2) and r["timed"] == 2 and r["iterations"] == 3
    assert r["mfu"] == pytest.approx(0.41)
    assert r["peak"] == {0: pytest.approx(93.5), 1: pytest.approx(92.5)}
    assert r["attention"] == "cuda"


def test_baseline_mfu_counts_the_dualkv_work_and_the_ratio_is_time_per_update(logs):
    md = render(logs)
    rep_row = next(l for l in md.splitlines() if l.startswith("| rep |"))
    # 0.41 x 4.2 / 18.9 = 9.1 %, not the 43 % its own records claim
    assert "| 9.1% |" in rep_row, rep_row
    assert "rep / dkv: 4.50x the time per policy update (18.90 vs 4.20 s/step)" in md
    assert "max abs difference 3.00e-08" in md  # the worst iteration's loss difference


def test_a_failed_run_names_its_cause_not_the_launcher(logs):
    md = render(logs)
    oom = next(l for l in md.splitlines() if l.startswith("| oom |"))
    assert "FAILED rc=1" in oom and "Failed to CUDA calloc" in oom, oom
    assert "torchrun ... oom" in md  # every run's exact command is in the table


def test_the_attention_column_names_the_baselines_core_attention(tmp_path):
    """From the stock model's own log line (not from the command), and a baseline without its DualKV
    run has no MFU rather than its own replicated-FLOP one."""
    d = str(tmp_path)
    _write_run(d, "unfused", [_record(1, 9.0, 0.1)], "stock GPTModel core attention: DotProductAttention\n",
               path="--no-dualkv", baseline_of="missing")
    _write_run(d, "sdpa", [_record(1, 5.0, 0.1)], "stock GPTModel core attention: SdpaDotProductAttention\n",
               path="--no-dualkv", baseline_of="missing")
    # another rank's warning written into the same log before the line's newline (seen in CI)
    _write_run(d, "sdpa_interleaved", [_record(1, 5.0, 0.1)],
               "stock GPTModel core attention: SdpaDotProductAttention/site-packages/megatron/core/tensor_parallel/"
               "layers.py:1060: UserWarning: ...\n", path="--no-dualkv", baseline_of="missing")
    rows = {l.split(" | ")[0][2:]: l for l in render(d).splitlines() if " | 8b | " in l}  # the runs table
    assert "torch SDPA" in rows["sdpa"] and "unfused (DotProductAttention)" in rows["unfused"], rows
    assert "torch SDPA (SdpaDotProductAttention)" in rows["sdpa_interleaved"], rows["sdpa_interleaved"]
    assert "| - |" in rows["sdpa"] and "10.0%" not in rows["sdpa"], rows["sdpa"]
