"""tools/compare_backends.py: the ours / FLASH table of tools/flash_compare.sh, read from pass tables
written by tools/bench_kernel.py's own row format (so a change of that format breaks this test)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_kernel  # noqa: E402
from compare_backends import main, read_pass, read_passes, table  # noqa: E402

SHAPES = [(28, 4096, 2048), (16, 65536, 1024)]


def _write(path, rows):
    path.write_text("# header the parser must skip\n\n" + bench_kernel.markdown(rows) + "\n")


def _fb(fwd, bwd):
    return dict(fwd=fwd, bwd=bwd, fb=fwd + bwd, peak=3.3, notes=[])


def _fo(fwd):
    return dict(fwd=fwd, bwd=None, fb=None, peak=3.3, notes=[])


@pytest.fixture
def out(tmp_path):
    # two passes each; ours: fwd 8 / 10, bwd 20 / 22 on shape 0; FLASH: fwd 9 / 9, bwd 25 / 25
    for p, (of, ob) in enumerate([(8.0, 20.0), (10.0, 22.0)], 1):
        _write(tmp_path / f"fb{p}.md", [bench_kernel.row_for(SHAPES[0], "cuda", _fb(of, ob)),
                                        bench_kernel.row_for(SHAPES[0], "flex-flash", _fb(9.0, 25.0)),
                                        bench_kernel.row_for(SHAPES[1], "cuda", _fb(70.0, 200.0)),
                                        bench_kernel.row_for(SHAPES[1], "flex-flash", _fb(80.0, 210.0))])
        _write(tmp_path / f"fo{p}.md", [bench_kernel.row_for(SHAPES[0], "cuda", _fo(of)),
                                        bench_kernel.row_for(SHAPES[0], "flex-flash", _fo(9.0)),
                                        bench_kernel.row_for(SHAPES[1], "cuda", _fo(70.0)),
                                        bench_kernel.row_for(SHAPES[1], "flex-flash", _fo(80.0))])
    return tmp_path


def test_reads_bench_kernel_rows(out):
    rows = read_pass((out / "fb1.md").read_text())
    assert rows[SHAPES[0] + ("cuda",)][:3] == [8.0, 20.0, 28.0]
    fo = read_pass((out / "fo1.md").read_text())
    assert fo[SHAPES[0] + ("flex-flash",)][:3] == [9.0, None, None]  # forward only: no bwd columns


def test_ratios_are_sums_over_passes(out):
    text = table(read_passes(str(out), "fb"), read_passes(str(out), "fo"))
    line = next(l for l in text.splitlines() if l.startswith(f"| {SHAPES[0]}"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "28.00; 32.00" and cells[2] == "34.00; 34.00"
    assert cells[3] == f"{60 / 68:.3f}"  # fwd+bwd: (28 + 32) / (34 + 34)
    assert cells[4] == f"{42 / 50:.3f}"  # bwd: (20 + 22) / (25 + 25)
    assert cells[7] == f"{18 / 18:.3f}"  # fwd only: (8 + 10) / (9 + 9)


def test_forward_only_table_and_missing_pass(out, capsys):
    (out / "fo3.md").write_text(bench_kernel.markdown([bench_kernel.row_for(SHAPES[0], "cuda", _fo(8.5)),
                                                       bench_kernel.row_for(SHAPES[0], "flex-flash", _fo(8.5))]))
    assert main([str(out), "--fwd"]) == 0
    text = capsys.readouterr().out
    assert "fwd+bwd" not in text  # --fwd ignores the fbN.md tables
    assert f"| {SHAPES[0]} | 8.00; 10.00; 8.50 | 9.00; 9.00; 8.50 | {26.5 / 26.5:.3f}; {8.5 / 9.0:.3f} |" in text
    assert f"| {SHAPES[1]} | missing in some pass |" in text  # absent from pass 3


def test_no_tables_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no fbN.md"):
        main([str(tmp_path)])
