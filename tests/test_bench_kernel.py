"""tools/bench_kernel.py on the CPU. Interleaved timing (--interleave): the backends of a shape take
turns run by run, each round starting with the next one, warm-up rounds untimed, and each backend's
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


class _Event:
    def __init__(self, t):
        self.t = t

    def elapsed_time(self, other):
        return other.t - self.t


class _FakePacked:
    """Runs take `ms` (forward) and 2 x `ms` (backward) plus the run's index, and log their order."""

    def __init__(self, name, ms, log):
        self.name, self.ms, self.log, self.notes, self.peak = name, ms, log, [f"{name} note"], None

    def run(self, fwd_only):
        self.log.append(self.name)
        k = len(self.log)
        return [_Event(0.0), _Event(self.ms + k), _Event(3 * self.ms + k)]


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
    res = bench_kernel.run_interleaved(["cuda", "flex-flash", "flex-triton"], (2, 64, 32), 1, 3, {}, fwd_only)
    # one run each for the peak, then 4 rounds, each starting with the next backend
    assert fake_gpu == ["cuda", "flex-flash"] + ["cuda", "flex-flash", "flex-flash", "cuda"] * 2
    assert res["flex-triton"] == {"status": "n/a", "why": "not here"}
    # timed rounds 1..3: cuda ran as run 6, 7 and 10 of the log, flex-flash as 5, 8 and 9
    assert res["cuda"]["fwd"] == 10.0 + 7 and res["flex-flash"]["fwd"] == 20.0 + 8
    if fwd_only:
        assert res["cuda"]["bwd"] is None and res["cuda"]["fb"] is None
    else:
        assert res["cuda"]["bwd"] == 20.0 and res["cuda"]["fb"] == 30.0 + 7
    assert res["cuda"]["peak"] == 1.5 and res["cuda"]["notes"] == ["cuda note", "interleaved"]  # inputs once


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
