"""Side-by-side table of the builds (or settings) of one `tools/gpu_session_check.sh ab` run, from
its pass tables bench_NAME_PASS.md (tools/bench_kernel.py's `--out` files, backend "cuda").

    python tools/ab_summary.py OUT_DIR            # fwd+bwd ms where timed, else forward ms
    python tools/ab_summary.py OUT_DIR --col fwd  # forward ms (fwd, bwd or fb)

Per shape: every name's ms per pass, then each name's median over the passes divided by the
first name's (the first in AB_LIBS order, or --base). Printed to stdout: a device call returns at
most 8 files."""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics

from compare_backends import BWD, FB, FWD, read_pass

COLS = {"fwd": FWD, "bwd": BWD, "fb": FB}
NAME = re.compile(r"^bench_(.+)_(\d+)\.md$")


def read_ab(out: str) -> dict:
    """{name: {pass: {(N, P, R, backend): row}}} from out's bench_NAME_PASS.md files."""
    runs: dict = {}
    for path in glob.glob(os.path.join(out, "bench_*_*.md")):
        m = NAME.match(os.path.basename(path))
        if m:
            runs.setdefault(m[1], {})[int(m[2])] = read_pass(open(path).read())
    return runs


def table(runs: dict, names: list, col: int, backend: str = "cuda") -> str:
    base = names[0]
    head = " | ".join(f"{n} ms per pass" for n in names)
    ratios = " | ".join(f"{n} / {base} (medians)" for n in names[1:])
    lines = [f"| (N, P, R) | {head} | {ratios} |", "|---" * (2 * len(names)) + "|"]  # shape, names, ratios
    shapes = sorted({k[:3] for passes in runs.values() for p in passes.values() for k in p if k[3] == backend})
    for shape in shapes:
        ms = {n: [runs[n][p][shape + (backend,)][col] for p in sorted(runs.get(n, {}))
                  if runs[n][p].get(shape + (backend,)) and runs[n][p][shape + (backend,)][col] is not None]
              for n in names}
        cells = [" ".join(f"{x:.2f}" for x in ms[n]) or "-" for n in names]
        med = {n: statistics.median(v) for n, v in ms.items() if v}
        rs = [f"{med[n] / med[base]:.4f}" if n in med and base in med else "-" for n in names[1:]]
        lines.append(f"| {shape} | " + " | ".join(cells + rs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder with gpu_session_check.sh ab's bench_NAME_PASS.md tables")
    ap.add_argument("--col", choices=sorted(COLS), help="time column (default: fb, or fwd when forward-only)")
    ap.add_argument("--names", help="comma-separated names in column order (default: sorted; the first is the base)")
    args = ap.parse_args(argv)
    runs = read_ab(args.out)
    if not runs:
        raise SystemExit(f"no bench_NAME_PASS.md tables in {args.out}")
    names = args.names.split(",") if args.names else sorted(runs)
    missing = [n for n in names if n not in runs]
    if missing:
        raise SystemExit(f"--names: no tables for {missing} in {args.out} (found {sorted(runs)})")
    col = args.col
    if col is None:  # forward-only runs leave fwd+bwd empty
        any_fb = any(r[FB] is not None for n in names for p in runs[n].values() for r in p.values())
        col = "fb" if any_fb else "fwd"
    print(f"{col} ms, backend cuda, " + ", ".join(f"{n}: {len(runs[n])} passes" for n in names))
    print(table(runs, names, COLS[col]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
