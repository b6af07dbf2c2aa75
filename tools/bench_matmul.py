"""The card's own bf16 matmul rate, on a cool card and at steady state: the yardstick for the
attention TF/s of tools/bench_kernel.py.

    python tools/bench_matmul.py [--sizes 8192,16384] [--idle 5] [--sustain 15] --out mm.md
    python tools/bench_matmul.py --yardstick OUT_DIR     # mmN.md + fbN.md / foN.md, every backend

Why: issue 3's targets (680 forward, 620 fwd+bwd useful TF/s) were set beside "a bf16 matmul
776" on the H100 they were measured on. The lent H100 runs long kernels at its software power
cap (docs/PERF.md, tenth session), so its own matmul rate at steady state is the fair unit: the
yardstick prints each attention rate as a fraction of it, beside the targets as fractions of 776.

Modes, per size (M = N = K, bf16, torch.matmul = cuBLAS; a pool of random operand pairs used in
turn, so no call reads the previous call's operands from L2):
  - burst: after `--idle` seconds with nothing running, the first `--burst-reps` calls (the state
    a short benchmark starts in);
  - sustained: after `--sustain` seconds of back-to-back calls, `--reps` more (the state of a
    long attention benchmark).
Each call is timed by CUDA events (perf_counter on a CPU); the table gives the median and the
10th / 90th percentiles as TF/s."""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_backends import FB_TF, FWD_TF, read_passes  # noqa: E402

ISSUE_MATMUL = 776.0  # TF/s, the bf16 matmul rate quoted beside issue 3's targets
ISSUE_TARGETS = {"fwd": 680.0, "fwd+bwd": 620.0}

# | size | mode | calls | ms median | TF/s median | TF/s p10 | TF/s p90 |
_NUM = r"([\d.]+(?:e[-+]\d+)?)"
ROW = re.compile(rf"^\| (\d+) \| (burst|sustained) \| (\d+) \| {_NUM} \| {_NUM} \| {_NUM} \| {_NUM} \|", re.M)


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def timed_calls(calls: list, n: int, device: torch.device) -> list:
    """Milliseconds of n calls issued back to back (calls used in turn): CUDA events around each,
    one synchronisation at the end, so the GPU never waits for the host between calls;
    perf_counter per call on a CPU."""
    if device.type != "cuda":
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for i, (start, end) in enumerate(events):
        start.record()
        calls[i % len(calls)]()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def operand_pool(size: int, device: torch.device, dtype: torch.dtype, pairs: int) -> list:
    gen = torch.Generator(device=device).manual_seed(size)
    return [(torch.randn(size, size, device=device, dtype=dtype, generator=gen),
             torch.randn(size, size, device=device, dtype=dtype, generator=gen)) for _ in range(pairs)]


def percentile(xs: list, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(size: int, device: torch.device, dtype: torch.dtype, idle_s: float, burst_reps: int,
            sustain_s: float, reps: int, pairs: int = 4) -> list:
    """[(mode, [ms per call])] for the burst and the sustained mode of one size."""
    pool = operand_pool(size, device, dtype, pairs)
    out = torch.empty(size, size, device=device, dtype=dtype)
    calls = [lambda a=a, b=b: torch.matmul(a, b, out=out) for a, b in pool]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    calls[0]()  # cuBLAS picks and loads its kernel outside the timed calls
    sync()
    time.sleep(idle_s)
    burst = timed_calls(calls, burst_reps, device)
    t_end, i = time.perf_counter() + sustain_s, 0
    while time.perf_counter() < t_end:
        for _ in range(8):  # a few calls per clock read, so the queue stays full
            calls[i % pairs]()
            i += 1
        sync()
    sustained = timed_calls(calls, reps, device)
    return [("burst", burst), ("sustained", sustained)]


def table_rows(size: int, runs: list) -> list:
    f = gemm_flops(size, size, size)
    rows = []
    for mode, ms in runs:
        tf = [f / (t * 1e9) for t in ms]
        rows.append(f"| {size} | {mode} | {len(ms)} | {statistics.median(ms):.3f} | {statistics.median(tf):.4g} | "
                    f"{percentile(tf, 0.1):.4g} | {percentile(tf, 0.9):.4g} |")
    return rows


HEADER = ["| size | mode | calls | ms median | TF/s median | TF/s p10 | TF/s p90 |", "|---|---|---|---|---|---|---|"]


def read_matmul(text: str) -> dict:
    """{(size, mode): TF/s median} of one table written by this tool."""
    return {(int(m[1]), m[2]): float(m[5]) for m in ROW.finditer(text)}


def yardstick(out_dir: str) -> str:
    """Attention TF/s of the fbN / foN pass tables (every backend in them, means over the passes)
    as fractions of the sustained matmul rate of the mmN tables in out_dir (the mean over tables
    and sizes), beside issue 3's targets as fractions of the issue's 776."""
    mm = [read_matmul(open(os.path.join(out_dir, f)).read())
          for f in sorted(os.listdir(out_dir)) if re.fullmatch(r"mm\d+\.md", f)]
    sustained = [tf for t in mm for (size, mode), tf in t.items() if mode == "sustained"]
    if not sustained:
        raise SystemExit(f"no sustained matmul rows in {out_dir}/mmN.md")
    unit = statistics.mean(sustained)
    fb, fo = read_passes(out_dir, "fb"), read_passes(out_dir, "fo")
    lines = [f"sustained bf16 matmul on this card: {unit:.0f} TF/s (mean of {len(sustained)}); "
             f"issue 3: matmul {ISSUE_MATMUL:.0f}, targets fwd {ISSUE_TARGETS['fwd']:.0f} = "
             f"{ISSUE_TARGETS['fwd'] / ISSUE_MATMUL:.3f} and fwd+bwd {ISSUE_TARGETS['fwd+bwd']:.0f} = "
             f"{ISSUE_TARGETS['fwd+bwd'] / ISSUE_MATMUL:.3f} of it", "",
             "| (N, P, R) | backend | fwd TF/s | fwd / matmul | fwd+bwd TF/s | fwd+bwd / matmul |",
             "|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys(k for p in fb + fo for k in p))  # first-seen order
    for key in keys:
        fwd = [p[key][FWD_TF] for p in fo if key in p]
        both = [p[key][FB_TF] for p in fb if key in p]
        lines.append(f"| {key[:3]} | {key[3]} | {_rate_cells(fwd, unit)} | {_rate_cells(both, unit)} |")
    return "\n".join(lines)


def _rate_cells(tf: list, unit: float) -> str:
    """'mean TF/s | mean / unit' of the passes' rates, or two empty cells where there are none."""
    return f"{statistics.mean(tf):.0f} | {statistics.mean(tf) / unit:.3f}" if tf else " | "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8192,16384", help="square GEMM sizes, comma-separated")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds with nothing running before the burst")
    ap.add_argument("--burst-reps", type=int, default=10)
    ap.add_argument("--sustain", type=float, default=15.0, help="seconds of back-to-back calls before the sustained reps")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--yardstick", metavar="OUT_DIR", help="print the attention-over-matmul table of OUT_DIR and exit")
    args = ap.parse_args(argv)
    if args.yardstick:
        print(yardstick(args.yardstick))
        return 0
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be integers separated by commas, got {args.sizes!r}")
    if any(s <= 0 for s in sizes) or args.burst_reps < 1 or args.reps < 1:
        ap.error("sizes, --burst-reps and --reps must be positive")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lines = list(HEADER)
    for size in sizes:
        lines += table_rows(size, measure(size, device, dtype, args.idle, args.burst_reps, args.sustain, args.reps))
        print(lines[-2], lines[-1], sep="\n", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = f"matmul rate on {name} ({args.dtype})\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
