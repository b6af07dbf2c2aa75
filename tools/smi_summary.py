"""Summarise an nvidia-smi sample log taken while a benchmark ran: mean SM clock, power and the
throttle reasons over the busy samples (power above a threshold, i.e. while kernels ran).

    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,noheader,nounits -lms 50 > smi.csv &   # ... run the benchmark, then kill it
    python tools/smi_summary.py smi.csv [--busy-w 400]   (default: 80 % of the highest power seen)

Why: on the H100 the backward runs at the software power cap (throttle reason 0x4, ~650 W), so
two builds can differ in time through their clock (energy per step) as much as through their
cycles; an A/B table needs the clock beside the milliseconds (docs/PERF.md, tenth session).
"""
import argparse
import collections
import sys

THROTTLE_NAMES = {0x1: "gpu idle", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal",
                  0x40: "hw thermal", 0x80: "hw power brake"}


def parse(lines):
    """(clock MHz, power W, temperature C, throttle mask) per well-formed sample line."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            rows.append((float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:
            continue  # "[N/A]", a header or a line cut off when the sampler was killed
    return rows


def throttle_text(mask):
    names = [name for bit, name in THROTTLE_NAMES.items() if mask & bit]
    return "+".join(names) if names else ("none" if mask == 0 else hex(mask))


def summary(rows, busy_w=None):
    if busy_w is None:  # short kernels with gaps between them never reach a fixed threshold
        busy_w = 0.8 * max((r[1] for r in rows), default=0.0)
    busy = [r for r in rows if r[1] > busy_w]
    if not busy:
        return f"clock/power: no sample above {busy_w:.0f} W ({len(rows)} samples)"
    n = len(busy)
    reasons = collections.Counter(throttle_text(r[3]) for r in busy).most_common(2)
    return (f"clock/power over {n} busy samples: SM clock {sum(r[0] for r in busy) / n:.0f} MHz "
            f"(min {min(r[0] for r in busy):.0f}), power {sum(r[1] for r in busy) / n:.0f} W, "
            f"max {max(r[2] for r in busy):.0f} C, throttle: "
            + ", ".join(f"{name} {100 * c / n:.0f} %" for name, c in reasons))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--busy-w", type=float, default=None,
                    help="samples above this power (W) count as busy (default: 80 %% of the highest)")
    args = ap.parse_args(argv)
    with open(args.log) as f:
        print(summary(parse(f), args.busy_w))


if __name__ == "__main__":
    sys.exit(main())
