"""How the two-rank tools (gpu_cp_check.py, gpu_cp_attention_cost.py) report and finish: rank 0
prints its JSON summary and writes it to --out, then every rank leaves the process group."""

from __future__ import annotations

import json
from typing import Optional

import torch.distributed as dist


def write_json_report(report: dict, path: Optional[str], echo: bool = True) -> None:
    """Print `report` as indented JSON (echo) and write it to `path` (when given), one trailing newline."""
    text = json.dumps(report, indent=2)
    if echo:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def report_and_leave(report: dict, path: Optional[str]) -> None:
    """Rank 0 reports (write_json_report); then all ranks leave the process group together."""
    if dist.get_rank() == 0:
        write_json_report(report, path)
    dist.barrier()
    dist.destroy_process_group()
