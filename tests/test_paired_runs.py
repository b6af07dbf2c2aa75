"""tools/paired_runs.py: per-round ratios from interleaved bench logs, read from log lines printed by
tools/bench_kernel.py's own code (its --show-runs lines and its progress line), so a change of that
format breaks this test."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_kernel  # noqa: E402
from fake_events import StampedEvent  # noqa: E402
from paired_runs import main, pooled, read_log  # noqa: E402


def _log(shape, runs, fwd_only, monkeypatch):
    """bench_kernel's output for one interleaved shape: each backend's runs lines, then its result line."""
    monkeypatch.setattr(bench_kernel, "SHOW_RUNS", True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = {}
        for name, (fwd, bwd) in runs.items():
            marks = [[StampedEvent(0.0), StampedEvent(f), StampedEvent(f + b)] for f, b in zip(fwd, bwd)]
            f, b, fb = bench_kernel._medians(marks, fwd_only, f" {name}")
            results[name] = dict(fwd=f, bwd=b, fb=fb)
        for name, res in results.items():
            print(bench_kernel.result_line(1.5, shape, name, res))
    return out.getvalue()


@pytest.mark.parametrize("fwd_only", [True, False])
def test_rounds_pair_by_index_and_pool_over_logs(tmp_path, capsys, monkeypatch, fwd_only):
    # the clock swings: medians alone would call these level; per round cuda is 1 % faster in 3 of 4
    one = _log((28, 4096, 2048), {"cuda": ([9.9, 7.92, 8.91, 8.0], [20.0, 16.0, 18.0, 16.0]),
                                  "flex-flash": ([10.0, 8.0, 9.0, 7.9], [22.0, 16.0, 18.0, 17.6])}, fwd_only, monkeypatch)
    two = _log((16, 65536, 1024), {"cuda": ([100.0, 101.0], [200.0, 200.0]),
                                   "flex-flash": ([110.0, 101.0], [200.0, 210.0])}, fwd_only, monkeypatch)
    (tmp_path / "a.log").write_text("header line\n" + one + two)
    (tmp_path / "b.log").write_text(two)
    shapes = read_log(one + two)
    assert set(shapes) == {(28, 4096, 2048), (16, 65536, 1024)}
    pairs = pooled([shapes, read_log(two)], "cuda", "flex-flash")
    assert pairs[(16, 65536, 1024)]["fwd"] == [(100.0, 110.0), (101.0, 101.0)] * 2  # pooled over both logs
    assert main([str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 0
    rows = {r.split(" | ")[0]: r for r in capsys.readouterr().out.splitlines() if r.startswith("| (") and "N, P, R" not in r}
    assert rows["| (28, 4096, 2048)"].startswith("| (28, 4096, 2048) | 4 | ")
    assert "| 0.990; 3 of 4 |" in rows["| (28, 4096, 2048)"]  # fwd: 0.99, 0.99, 0.99, 1.0127
    if fwd_only:
        assert "bwd" not in rows["| (28, 4096, 2048)"].split(" | ", 2)[2] and rows["| (28, 4096, 2048)"].count(";") == 1
    else:  # fwd+bwd per round: 29.9/32, 23.92/24, 26.91/27, 24/25.5 -> median of the middle two
        assert rows["| (28, 4096, 2048)"].count(";") == 3
    assert list(rows) == ["| (28, 4096, 2048)", "| (16, 65536, 1024)"]


def test_missing_backends_and_unequal_rounds_are_named(tmp_path, monkeypatch):
    log = _log((2, 64, 32), {"cuda": ([1.0, 1.0], [2.0, 2.0])}, True, monkeypatch)
    (tmp_path / "a.log").write_text(log)
    with pytest.raises(SystemExit, match="--interleave --show-runs"):
        main([str(tmp_path / "a.log")])
    uneven = _log((2, 64, 32), {"cuda": ([1.0, 1.0], [2.0, 2.0]), "flex-flash": ([1.0], [2.0])}, True, monkeypatch)
    with pytest.raises(ValueError, match="not one interleaved measurement"):
        pooled([read_log(uneven)], "cuda", "flex-flash")
