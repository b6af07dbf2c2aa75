"""tools/bench_kernel.py on the CPU. Interleaved timing (--interleave): the backends of a shape take
turns run by run, each round in its own order, warm-up rounds untimed, and each backend's
medians from its own runs only, all on the same inputs (the GPU calls replaced by recorders). Backend settings in brackets
(cuda[VAR=VALUE;...]): parsed, held around each run only, bad ones named."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_kernel  # noqa: E402
from fake_events import StampedEvent  # noqa: E402


class _FakePacked:
    """Runs take `ms` (forward) and 2 x `ms` (backward) plus the run's index, and log their order."""

    def __init__(self, name, ms, log):
        self.name, self.ms, self.log, self.notes, self.peak = name, ms, log, [f"{name} note"], None

    def run(self, fwd_only):
        self.log.append(self.name)
        k = len(self.log)
        return [StampedEvent(0.0), StampedEvent(self.ms + k), StampedEvent(3 * self.ms + k)]


@pytest.fixture
def fake_gpu(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2 ** 30)
    ms = {"cuda": 10.0, "flex-flash": 20.0}
    shared = ("layout", torch.empty(2 ** 27), torch.empty(0), torch.empty(0), torch.empty(0))  # 0.5 GiB of inputs
    monkeypatch.setattr(bench_kernel, "packed_inputs", lambda shape: shared)

    def prepare(name, shape, state, fwd_only=False, data=None):
        assert data is shared, "every backend of the shape gets the same inputs"
        if name == "flex-triton":
            raise bench_kernel.Skip("not here")
        return _FakePacked(name, ms[name], log)

    monkeypatch.setattr(bench_kernel, "prepare_packed", prepare)
    return log


@pytest.mark.parametrize("fwd_only", [True, False])
def test_backends_take_turns_and_warm_up_is_not_timed(fake_gpu, fwd_only):
    res = bench_kernel.run_interleaved(["cuda", "flex-flash", "flex-triton"], (2, 64, 32), 2, 9, {}, fwd_only)
    assert res["flex-triton"] == {"status": "n/a", "why": "not here"}
    # one run each for the peak, then 11 rounds, each running both once, in orders that vary
    assert fake_gpu[:2] == ["cuda", "flex-flash"] and len(fake_gpu) == 2 + 2 * 11
    rounds = [tuple(fake_gpu[i:i + 2]) for i in range(2, len(fake_gpu), 2)]
    assert all(sorted(r) == ["cuda", "flex-flash"] for r in rounds) and len(set(rounds)) == 2
    # medians over the 9 timed rounds only: run k of the log (from 1) takes ms + k, and round i
    # holds runs 3 + 2 i and 4 + 2 i
    for name, ms in (("cuda", 10.0), ("flex-flash", 20.0)):
        k = sorted(3 + 2 * i + r.index(name) for i, r in enumerate(rounds) if i >= 2)[4]
        assert res[name]["fwd"] == ms + k
        if fwd_only:
            assert res[name]["bwd"] is None and res[name]["fb"] is None
        else:
            assert res[name]["bwd"] == 2 * ms and res[name]["fb"] == 3 * ms + k
    assert res["cuda"]["peak"] == 1.5 and res["cuda"]["notes"] == ["cuda note", "interleaved"]  # inputs once


@pytest.mark.parametrize("n, reps", [(2, 25), (2, 15), (3, 9), (3, 10), (1, 5)])
def test_timed_rounds_put_every_backend_in_every_position_equally_often(n, reps):
    names = [f"b{i}" for i in range(n)]
    orders = bench_kernel.round_orders(names, 3, reps)
    assert len(orders) == 3 + reps and all(sorted(o) == names for o in orders)
    timed = orders[3:]
    for pos in range(n):
        counts = [sum(o[pos] == name for o in timed) for name in names]
        # whole blocks balance exactly; a last partial block adds at most one to a count
        assert max(counts) - min(counts) <= (1 if reps % n else 0), (pos, counts)
    assert n == 1 or len({tuple(o) for o in timed}) > 1  # not one fixed order


def test_backend_settings_in_brackets():
    assert bench_kernel.backend_env("flex-flash") == ("flex-flash", {})
    assert bench_kernel.backend_env("cuda[dq=tma]") == ("cuda", {"MEGATRON_DUALKV_WS_DQ": "tma"})
    assert bench_kernel.backend_env("cuda[MEGATRON_DUALKV_WS_FWD_TILE=176; MEGATRON_DUALKV_WS_FWD_TAIL=full]") == (
        "cuda", {"MEGATRON_DUALKV_WS_FWD_TILE": "176", "MEGATRON_DUALKV_WS_FWD_TAIL": "full"})
    for bad, why in [("flex-flash[X=1]", "for cuda only"), ("cuda[X=1", "for cuda only"), ("cuda[X]", "not VAR=VALUE"),
                     ("cuda[=1]", "not VAR=VALUE")]:
        with pytest.raises(ValueError, match=why):
            bench_kernel.backend_env(bad)
        with pytest.raises(SystemExit, match="--backends"):  # named before any GPU is looked for
            bench_kernel.main(["--backends", bad])


def test_settings_hold_around_every_run_only(monkeypatch):
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", "128")
    seen = []
    p = bench_kernel.Packed(lambda: seen.append(os.environ["MEGATRON_DUALKV_WS_FWD_TILE"]), (), None, [],
                            {"MEGATRON_DUALKV_WS_FWD_TILE": "176"})
    monkeypatch.setattr(bench_kernel, "_one_run", lambda fwd, inputs, dout, fwd_only: fwd())
    p.run(True)
    assert seen == ["176"] and os.environ["MEGATRON_DUALKV_WS_FWD_TILE"] == "128"


def test_a_failure_while_the_rounds_run_is_each_backends_row(fake_gpu, monkeypatch):
    run = _FakePacked.run

    def run_until_oom(self, fwd_only):
        if len(self.log) >= 5:  # the peak runs and the first round pass, then memory runs out
            raise torch.OutOfMemoryError("fake")
        return run(self, fwd_only)

    monkeypatch.setattr(_FakePacked, "run", run_until_oom)
    res = bench_kernel.run_interleaved(["flex-triton", "cuda", "flex-flash"], (2, 64, 32), 1, 3, {}, True)
    assert list(res) == ["flex-triton", "cuda", "flex-flash"]  # the order asked for
    assert res["flex-triton"]["status"] == "n/a"
    assert res["cuda"] == res["flex-flash"] == {"status": "OOM", "why": "out of GPU memory"}


def test_spread_gives_unequal_responses_of_mean_r_and_flops_of_those_lengths(monkeypatch):
    lengths = bench_kernel.response_lengths(16, 8192, 0.9)
    assert len(lengths) == 16 and sum(lengths) == 16 * 8192
    assert min(lengths) < 8192 * 0.2 and max(lengths) > 8192 * 1.8
    assert lengths != sorted(lengths)  # shuffled: the longest responses are not all at the end
    assert lengths == bench_kernel.response_lengths(16, 8192, 0.9)  # the same for every backend
    assert bench_kernel.response_lengths(3, 5, 0) == [5, 5, 5]
    assert bench_kernel.response_lengths(1, 100, 0.5) == [100]
    assert min(bench_kernel.response_lengths(64, 2, 0.99)) == 1
    with pytest.raises(ValueError, match="spread"):
        bench_kernel.response_lengths(4, 100, 1.0)

    res = dict(fwd=1.0, bwd=2.0, fb=3.0, peak=1.0, notes=[])
    equal = bench_kernel.row_for((16, 1024, 8192), "cuda", res)
    monkeypatch.setattr(bench_kernel, "SPREAD", 0.9)
    spread = bench_kernel.row_for((16, 1024, 8192), "cuda", res)
    assert equal[3] == spread[3] == 1024 + 16 * 8192  # same tokens
    # causal work grows with the square of a response's length: unequal lengths do more of it
    assert int(spread[8]) > int(equal[8])
    with pytest.raises(bench_kernel.Skip, match="equal response lengths"):
        bench_kernel.run_replicated("sdpa-flash", (16, 1024, 8192), 1, 2, {})


def test_spread_out_of_range_is_named():
    with pytest.raises(SystemExit, match="--spread"):
        bench_kernel.main(["--spread", "1.5"])


def test_groups_pack_several_groups_with_their_own_orders(monkeypatch):
    res = dict(fwd=1.0, bwd=2.0, fb=3.0, peak=1.0, notes=[])
    one = bench_kernel.row_for((16, 512, 1024), "cuda", res)
    monkeypatch.setattr(bench_kernel, "GROUPS", 4)
    four = bench_kernel.row_for((16, 512, 1024), "cuda", res)
    assert four[3] == 4 * one[3] and int(four[8]) == pytest.approx(4 * int(one[8]), abs=4)
    monkeypatch.setattr(bench_kernel, "SPREAD", 0.5)
    groups = bench_kernel.micro_batch(16, 512, 1024)
    assert len(groups) == 4 and all(p == 512 and sum(ls) == 16 * 1024 for p, ls in groups)
    assert len({tuple(ls) for _, ls in groups}) == 4  # each group its own order
    with pytest.raises(bench_kernel.Skip, match="one group"):
        bench_kernel.run_replicated("sdpa-cudnn", (16, 512, 1024), 1, 2, {})
    with pytest.raises(SystemExit, match="--groups"):
        bench_kernel.main(["--groups", "0"])


def test_prompt_spread_gives_each_group_its_own_prompt_length(monkeypatch):
    monkeypatch.setattr(bench_kernel, "GROUPS", 8)
    monkeypatch.setattr(bench_kernel, "PROMPT_SPREAD", 0.5)
    prompts = [p for p, _ in bench_kernel.micro_batch(16, 512, 1024)]
    assert sum(prompts) == 8 * 512 and len(set(prompts)) == 8
    assert any(p % 128 for p in prompts)  # ragged prompts: a short last key tile
    monkeypatch.setattr(bench_kernel, "GROUPS", 1)
    assert bench_kernel.micro_batch(16, 512, 1024)[0][0] == 512
    with pytest.raises(SystemExit, match="--prompt-spread"):
        bench_kernel.main(["--prompt-spread", "-0.1"])


def test_hkv_must_divide_the_query_heads():
    with pytest.raises(SystemExit, match="--hkv must divide the 32 query heads"):
        bench_kernel.main(["--hkv", "5"])
    with pytest.raises(SystemExit, match="--hkv must divide the 4 query heads, got 8"):
        bench_kernel.main(["--hq", "4"])
    with pytest.raises(SystemExit, match="--hq must be at least 1"):
        bench_kernel.main(["--hq", "0", "--hkv", "1"])


def test_head_dim_is_one_the_kernels_take():
    with pytest.raises(SystemExit) as exc:
        bench_kernel.main(["--head-dim", "96"])
    assert exc.value.code == 2  # argparse's usage error, not the later "needs a CUDA GPU"


def test_cp_times_one_rank_of_the_balanced_partition(monkeypatch):
    """--cp W: a rank's rows are its chunks of the cost-balanced partition (every padded row on
    exactly one rank), its pairs what its rows attend (the ranks' pairs add up to the padded
    layout's), and the row's FLOPs count them; --cp 0 is named."""
    shape = (16, 500, 1024)
    parts = [bench_kernel.cp_rank_layout(shape, 2, rank, device="cpu") for rank in (0, 1)]
    seg = parts[0][0]
    rows = torch.cat([p[1] for p in parts]).sort().values
    assert torch.equal(rows, torch.arange(seg.num_tokens))
    whole = bench_kernel.row_for(shape, "cuda", dict(fwd=1.0, bwd=2.0, fb=3.0, peak=1.0, notes=[]))
    monkeypatch.setattr(bench_kernel, "CP", 2)
    monkeypatch.setattr(bench_kernel, "cp_rank_layout", lambda s, cp: parts[0])
    mine = bench_kernel.row_for(shape, "cuda", dict(fwd=1.0, bwd=2.0, fb=3.0, peak=1.0, notes=[]))
    assert mine[3] == f"{parts[0][1].numel()} / {seg.num_tokens}"
    from megatron_dualkv.cp.partition import key_counts

    assert sum(p[2] for p in parts) == int(key_counts(seg).sum())
    assert int(mine[8]) == pytest.approx(int(whole[8]) * parts[0][2] / (parts[0][2] + parts[1][2]), rel=0.02)
    with pytest.raises(SystemExit, match="--cp must be"):
        bench_kernel.main(["--cp", "0"])
