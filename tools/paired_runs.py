"""Per-round ratios of two backends from interleaved bench logs: `tools/bench_kernel.py
--interleave --show-runs` prints every timed run, and run i of each backend belongs to round i,
taken back to back with the same clocks. The median of the per-round ratios is steadier than the
ratio of the medians when the card's clock swings during a measurement (docs/PERF.md, twentieth
session).

    python tools/paired_runs.py OUT/fo1.log OUT/fo2.log            # cuda / flex-flash
    python tools/paired_runs.py OUT/*.log --ours cuda --theirs 'cuda[MEGATRON_DUALKV_WS_FWD_TILE=176]'

Rounds of every log given are pooled per shape. Per shape and time (fwd, bwd, fwd+bwd = fwd + bwd
of the same run): the median ratio ours / theirs, and in how many rounds ours was faster."""
from __future__ import annotations

import argparse
import re
import statistics

RUNS = re.compile(r"^\s+runs (fwd|bwd) ms (\S+): ([\d. ]+)$")
SHAPE = re.compile(r"^\s+\[\s*[\d.]+s\] \((\d+), (\d+), (\d+)\) ")


def read_log(text: str) -> dict:
    """{(N, P, R): {backend: {"fwd": [ms...], "bwd": [ms...]}}}: the runs lines printed before a
    shape's result lines belong to that shape."""
    shapes, pending = {}, {}
    for line in text.splitlines():
        m = RUNS.match(line)
        if m:
            pending.setdefault(m[2], {})[m[1]] = [float(x) for x in m[3].split()]
            continue
        m = SHAPE.match(line)
        if m and pending:
            shapes.setdefault(tuple(int(x) for x in m.groups()), {}).update(pending)
            pending = {}
    return shapes


def pooled(logs: list, ours: str, theirs: str) -> dict:
    """{shape: {time: [(ours ms, theirs ms) per round]}} over all logs, rounds with both timed."""
    out: dict = {}
    for shapes in logs:
        for shape, runs in shapes.items():
            if ours not in runs or theirs not in runs:
                continue
            a, b = runs[ours], runs[theirs]
            if len(a["fwd"]) != len(b["fwd"]):
                raise ValueError(f"{shape}: {ours} has {len(a['fwd'])} runs, {theirs} {len(b['fwd'])}: "
                                 "not one interleaved measurement")
            pairs = out.setdefault(shape, {})
            pairs.setdefault("fwd", []).extend(zip(a["fwd"], b["fwd"]))
            if "bwd" in a and "bwd" in b:
                pairs.setdefault("bwd", []).extend(zip(a["bwd"], b["bwd"]))
                pairs.setdefault("fwd+bwd", []).extend(
                    zip([f + g for f, g in zip(a["fwd"], a["bwd"])], [f + g for f, g in zip(b["fwd"], b["bwd"])]))
    return out


def table(pairs: dict, ours: str, theirs: str) -> str:
    times = [t for t in ("fwd+bwd", "bwd", "fwd") if any(t in p for p in pairs.values())]
    lines = ["| (N, P, R) | rounds | " + " | ".join(f"{t} {ours} / {theirs} (median; {ours} faster in)" for t in times)
             + " |", "|---|---|" + "---|" * len(times)]
    for shape in sorted(pairs, key=lambda s: (-s[2], s[1], s[0])):  # bench_kernel's order: R = 2048 first
        cells = []
        for t in times:
            rounds = pairs[shape].get(t, [])
            if not rounds:
                cells.append("-")
                continue
            ratios = [a / b for a, b in rounds]
            cells.append(f"{statistics.median(ratios):.3f}; {sum(r < 1 for r in ratios)} of {len(ratios)}")
        lines.append(f"| {shape} | {len(pairs[shape]['fwd'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="bench_kernel.py --interleave --show-runs output")
    ap.add_argument("--ours", default="cuda")
    ap.add_argument("--theirs", default="flex-flash")
    args = ap.parse_args(argv)
    pairs = pooled([read_log(open(p).read()) for p in args.logs], args.ours, args.theirs)
    if not pairs:
        raise SystemExit(f"no shape with per-run times of both {args.ours!r} and {args.theirs!r} in {args.logs} "
                         "(run bench_kernel.py with --interleave --show-runs)")
    print(table(pairs, args.ours, args.theirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
