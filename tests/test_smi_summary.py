"""tools/smi_summary.py: the clock/power summary of an nvidia-smi sample log (busy samples only,
malformed lines skipped, throttle reasons named)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from smi_summary import main, parse, summary, throttle_text  # noqa: E402

LOG = """345, 73.35, 40, 0x0000000000000001
1500, 640.10, 65, 0x0000000000000004
1600, 660.90, 67, 0x0000000000000004
[N/A], [N/A], 66, 0x0000000000000000
1800, 500.00, 66, 0x0000000000000000
1700, 6
"""


def test_parse_skips_malformed_lines():
    rows = parse(LOG.splitlines())
    assert [r[0] for r in rows] == [345.0, 1500.0, 1600.0, 1800.0]
    assert rows[1] == (1500.0, 640.1, 65.0, 4)


def test_summary_averages_busy_samples_only():
    text = summary(parse(LOG.splitlines()), busy_w=400)
    assert "3 busy samples" in text
    assert "SM clock 1633 MHz (min 1500)" in text  # (1500 + 1600 + 1800) / 3; the idle 345 left out
    assert "power 600 W" in text and "max 67 C" in text
    assert "sw power cap 67 %" in text and "none 33 %" in text


def test_summary_default_threshold_is_relative_to_the_peak():
    text = summary(parse(LOG.splitlines()))  # 80 % of 660.9 W: the 640 and 660 W samples
    assert "2 busy samples" in text and "SM clock 1550 MHz" in text


def test_summary_without_busy_samples():
    assert summary(parse(LOG.splitlines()), busy_w=700) == "clock/power: no sample above 700 W (4 samples)"
    assert summary([]) == "clock/power: no sample above 0 W (0 samples)"


def test_throttle_text():
    assert throttle_text(0) == "none"
    assert throttle_text(0x4) == "sw power cap"
    assert throttle_text(0x44) == "sw power cap+hw thermal"
    assert throttle_text(0x10000) == "0x10000"


def test_main_prints_the_summary(tmp_path, capsys):
    log = tmp_path / "smi.csv"
    log.write_text(LOG)
    main([str(log), "--busy-w", "550"])
    assert capsys.readouterr().out.startswith("clock/power over 2 busy samples: SM clock 1550 MHz")
