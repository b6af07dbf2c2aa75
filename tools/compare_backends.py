"""Side-by-side table of two backends from tools/bench_kernel.py's pass tables (`--out` files):
ours ("cuda") against FlexAttention's FLASH backend ("flex-flash") by default.

    python tools/compare_backends.py OUT_DIR          # fbN.md (fwd+bwd) and foN.md (forward only)
    python tools/compare_backends.py OUT_DIR --fwd    # foN.md only

Ratios are ours / theirs from the sums over the passes (below 1: ours faster); TF/s are the
passes' means. Used by tools/flash_compare.sh on the GPU machine, whose call returns at most 8
files: the table goes to stdout."""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics

# | N | P | R | T packed | backend | fwd ms | bwd ms | fwd+bwd ms | fwd TF/s | bwd TF/s | fwd+bwd TF/s |
ROW = re.compile(r"^\| (\d+) \| (\d+) \| (\d+) \| \d+ \| (\S+) \| ([\d.]+) \| ([\d.]*) \| ([\d.]*) "
                 r"\| (\d+) \| (\d*) \| (\d*) \|", re.M)
FWD, BWD, FB, FWD_TF, BWD_TF, FB_TF = range(6)


def read_pass(text: str) -> dict:
    """{(N, P, R, backend): [fwd, bwd, fwd+bwd ms, fwd, bwd, fwd+bwd TF/s]} (None where the
    forward-only table leaves a column empty); rows with a status instead of times are skipped."""
    return {(int(m[1]), int(m[2]), int(m[3]), m[4]): [float(x) if x else None for x in m.groups()[4:]]
            for m in ROW.finditer(text)}


def read_passes(out: str, prefix: str) -> list:
    paths = glob.glob(os.path.join(out, f"{prefix}[0-9]*.md"))
    paths.sort(key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[-1]))  # fo10 after fo9
    return [read_pass(open(p).read()) for p in paths]


def _runs(passes, shape, backend):
    runs = [p.get(shape + (backend,)) for p in passes]
    return None if not runs or None in runs else runs


def _ratio(a, b, col):
    return sum(r[col] for r in a) / sum(r[col] for r in b)


def _mean(runs, col):
    return statistics.mean(r[col] for r in runs)


def _ms(runs, col):
    return "; ".join(f"{r[col]:.2f}" for r in runs)


def _shapes(passes, ours):
    seen = []
    for p in passes:
        for key in p:
            if key[3] == ours and key[:3] not in seen:
                seen.append(key[:3])
    return seen


def table(fb: list, fo: list, ours: str = "cuda", theirs: str = "flex-flash") -> str:
    """fwd+bwd passes fb and forward-only passes fo (fb empty: the forward-only table)."""
    lines = []
    if fb:
        lines += [f"| (N, P, R) | fwd+bwd ms {ours} | {theirs} | fwd+bwd {ours}/{theirs} | bwd {ours}/{theirs} | "
                  f"fwd-only ms {ours} | {theirs} | fwd {ours}/{theirs} | {ours} fwd / fwd+bwd TF/s | "
                  f"{theirs} fwd / fwd+bwd TF/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for shape in _shapes(fb, ours):
            c, f = _runs(fb, shape, ours), _runs(fb, shape, theirs)
            oc, of = _runs(fo, shape, ours), _runs(fo, shape, theirs)
            if None in (c, f, oc, of):
                lines.append(f"| {shape} | missing in some pass |")
                continue
            lines.append(
                f"| {shape} | {_ms(c, FB)} | {_ms(f, FB)} | {_ratio(c, f, FB):.3f} | {_ratio(c, f, BWD):.3f} | "
                f"{_ms(oc, FWD)} | {_ms(of, FWD)} | {_ratio(oc, of, FWD):.3f} | "
                f"{_mean(oc, FWD_TF):.0f} / {_mean(c, FB_TF):.0f} | {_mean(of, FWD_TF):.0f} / {_mean(f, FB_TF):.0f} |")
    else:
        lines += [f"| (N, P, R) | fwd ms {ours} | {theirs} | {ours}/{theirs} (sums; medians) |", "|---|---|---|---|"]
        for shape in _shapes(fo, ours):
            oc, of = _runs(fo, shape, ours), _runs(fo, shape, theirs)
            if None in (oc, of):
                lines.append(f"| {shape} | missing in some pass |")
                continue
            med = statistics.median(r[FWD] for r in oc) / statistics.median(r[FWD] for r in of)
            lines.append(f"| {shape} | {_ms(oc, FWD)} | {_ms(of, FWD)} | {_ratio(oc, of, FWD):.3f}; {med:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder with bench_kernel.py's fbN.md / foN.md tables")
    ap.add_argument("--fwd", action="store_true", help="forward-only passes (foN.md) only")
    ap.add_argument("--ours", default="cuda")
    ap.add_argument("--theirs", default="flex-flash")
    args = ap.parse_args(argv)
    fb = [] if args.fwd else read_passes(args.out, "fb")
    fo = read_passes(args.out, "fo")
    if not (fb or fo):
        raise SystemExit(f"no fbN.md / foN.md tables in {args.out}")
    print(table(fb, fo, args.ours, args.theirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
