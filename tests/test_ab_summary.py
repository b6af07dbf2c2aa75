"""tools/ab_summary.py: the before/after table of `gpu_session_check.sh ab`, read from pass tables in
tools/bench_kernel.py's own row format (so a change of that format breaks this test)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_kernel  # noqa: E402
from ab_summary import main  # noqa: E402

SHAPES = [(28, 16384, 2048), (16, 65536, 1024)]


def _write(out, name, p, times, fwd_only):
    rows = [bench_kernel.row_for(s, "cuda", dict(fwd=f, bwd=None if fwd_only else 2 * f,
                                                 fb=None if fwd_only else 3 * f, peak=1.0, notes=[]))
            for s, f in zip(SHAPES, times)]
    (out / f"bench_{name}_{p}.md").write_text("- a header line\n\n" + bench_kernel.markdown(rows) + "\n")


@pytest.mark.parametrize("fwd_only", [True, False])
def test_medians_and_ratios_to_the_first_name(tmp_path, capsys, fwd_only):
    # old: 10, 12, 11 on shape 0 (median 11); new: 9, 30, 9.9 (median 9.9, an outlier pass ignored)
    for p, (a, b) in enumerate([(10.0, 9.0), (12.0, 30.0), (11.0, 9.9)], 1):
        _write(tmp_path, "old", p, [a, 100.0], fwd_only)
        _write(tmp_path, "new", p, [b, 95.0], fwd_only)
    assert main([str(tmp_path), "--names", "old,new"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("fwd ms" if fwd_only else "fb ms")
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| (")}
    assert rows["| (28, 16384, 2048)"].endswith("| 0.9000 |")
    cells = "| 10.00 12.00 11.00 | 9.00 30.00 9.90 |" if fwd_only else "| 30.00 36.00 33.00 | 27.00 90.00 29.70 |"
    assert cells in rows["| (28, 16384, 2048)"]
    assert rows["| (16, 65536, 1024)"].endswith("| 0.9500 |")
    # the base is the first name given, not the sorted first
    assert main([str(tmp_path), "--names", "new,old", "--col", "fwd"]) == 0
    assert "| 1.1111 |" in capsys.readouterr().out


def test_names_without_tables_and_empty_folders_are_named(tmp_path):
    with pytest.raises(SystemExit, match="no bench_NAME_PASS.md"):
        main([str(tmp_path)])
    _write(tmp_path, "old", 1, [1.0, 2.0], True)
    with pytest.raises(SystemExit, match=r"no tables for \['tail'\]"):
        main([str(tmp_path), "--names", "old,tail"])
