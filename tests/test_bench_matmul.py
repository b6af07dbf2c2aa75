"""tools/bench_matmul.py: the matmul table (TF/s from the timed calls) and the yardstick that divides
bench_kernel.py's attention rates by the card's sustained matmul rate, read from the tools' own
table formats (a change of either format breaks this test)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_kernel  # noqa: E402
import bench_matmul  # noqa: E402


def test_table_rows_give_tf_s_of_the_median_call():
    rows = bench_matmul.table_rows(1000, [("burst", [2.0, 4.0, 3.0]), ("sustained", [5.0] * 4)])
    parsed = bench_matmul.read_matmul("\n".join(bench_matmul.HEADER + rows))
    # 2 * 1000^3 FLOP in 3 ms (the burst's median) = 0.6667 TF/s; in 5 ms 0.4
    assert parsed == {(1000, "burst"): pytest.approx(2 / 3, rel=1e-3), (1000, "sustained"): pytest.approx(0.4)}
    assert "| 1000 | burst | 3 | 3.000 |" in rows[0]


def test_cpu_run_writes_a_table_it_can_read_back(tmp_path, capsys):
    out = tmp_path / "mm1.md"
    assert bench_matmul.main(["--device", "cpu", "--dtype", "float32", "--sizes", "64,96", "--idle", "0",
                              "--burst-reps", "2", "--sustain", "0.01", "--reps", "3", "--out", str(out)]) == 0
    got = bench_matmul.read_matmul(out.read_text())
    assert set(got) == {(64, "burst"), (64, "sustained"), (96, "burst"), (96, "sustained")}
    assert all(tf > 0 for tf in got.values())
    assert "| 96 | sustained | 3 |" in capsys.readouterr().out


def test_bad_sizes_are_named():
    with pytest.raises(SystemExit):
        bench_matmul.main(["--device", "cpu", "--sizes", "64,x"])
    with pytest.raises(SystemExit):
        bench_matmul.main(["--device", "cpu", "--sizes", "0"])


def _write_matmul(path, sustained: dict):
    rows = [r for size, tf in sustained.items()
            for r in bench_matmul.table_rows(size, [("burst", [1.0]), ("sustained", [2 * size ** 3 / (tf * 1e9)])])]
    path.write_text("header\n\n" + "\n".join(bench_matmul.HEADER + rows) + "\n")


def test_yardstick_divides_attention_by_the_sustained_matmul(tmp_path):
    _write_matmul(tmp_path / "mm1.md", {8192: 600.0})
    _write_matmul(tmp_path / "mm2.md", {8192: 700.0})  # mean 650
    shape = (28, 32768, 2048)
    fb = bench_kernel.row_for(shape, "cuda", dict(fwd=60.0, bwd=180.0, fb=240.0, peak=4.8, notes=[]))
    fo = bench_kernel.row_for(shape, "cuda", dict(fwd=59.0, bwd=None, fb=None, peak=4.8, notes=[]))
    flash_fb = bench_kernel.row_for(shape, "flex-flash", dict(fwd=61.0, bwd=190.0, fb=251.0, peak=6.2, notes=[]))
    (tmp_path / "fb1.md").write_text(bench_kernel.markdown([fb, flash_fb]) + "\n")
    (tmp_path / "fo1.md").write_text(bench_kernel.markdown([fo]) + "\n")
    text = bench_matmul.yardstick(str(tmp_path))
    assert "sustained bf16 matmul on this card: 650 TF/s (mean of 2)" in text
    assert "targets fwd 680 = 0.876 and fwd+bwd 620 = 0.799" in text
    fwd_tf = float(fo[bench_kernel.COLUMNS.index("fwd TF/s")])
    fb_tf = float(fb[bench_kernel.COLUMNS.index("fwd+bwd TF/s")])
    line = next(x for x in text.splitlines() if x.startswith(f"| {shape} |"))
    assert line == f"| {shape} | cuda | {fwd_tf:.0f} | {fwd_tf / 650:.3f} | {fb_tf:.0f} | {fb_tf / 650:.3f} |"
    # a backend with no forward-only row keeps its fwd+bwd cells and leaves the forward ones empty
    flash_tf = float(flash_fb[bench_kernel.COLUMNS.index("fwd+bwd TF/s")])
    assert f"| {shape} | flex-flash |  |  | {flash_tf:.0f} | {flash_tf / 650:.3f} |" in text.splitlines()


def test_yardstick_without_matmul_tables_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no sustained matmul rows"):
        bench_matmul.yardstick(str(tmp_path))
