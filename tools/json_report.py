"""The JSON summary that the two-rank tools (gpu_cp_check.py, gpu_cp_attention_cost.py) report."""

from __future__ import annotations

import json
from typing import Optional


def write_json_report(report: dict, path: Optional[str], echo: bool = True) -> None:
    """Print `report` as indented JSON (echo) and write it to `path` (when given), one trailing newline."""
    text = json.dumps(report, indent=2)
    if echo:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
