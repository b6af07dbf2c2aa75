#!/usr/bin/env python
"""Energy per call of packed attention backends, side by side (NVML's energy counter).

A card at its power limit runs every kernel at the power the limit allows, so there the time of a
call is its energy divided by that power: a kernel that takes fewer cycles but more joules is the
slower one (docs/PERF.md, twenty-first session). This tool measures both, per backend: blocks of
back-to-back calls (each block long enough for NVML's energy counter, --block-s), the backends
of a shape taking turns block by block on the same inputs, each in every position equally often
(bench_kernel.round_orders), as bench_kernel.py --interleave does run by run. Per backend and shape it prints the median over
rounds of ms per call, mJ per call, mean W and the SM clock sampled during its blocks, and the
ratios to the first backend.

  python tools/bench_energy.py --fwd-only --shapes 28x4096x2048 --backends cuda,flex-flash
  python tools/bench_energy.py --fwd-only --backends "cuda,cuda[MEGATRON_DUALKV_WS_FWD_TILE=176]"
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernel as bk  # noqa: E402

NVML_CLOCK_SM = 1


class Nvml:
    """The few NVML calls used here, through ctypes (no pynvml on the lent machine): the card's
    total energy since the driver loaded (mJ), its SM clock (MHz) and enforced power limit (W)."""

    def __init__(self, pci_bus_id: str, lib=None):
        self.lib = lib or ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(self.handle)),
                    f"nvmlDeviceGetHandleByPciBusId_v2({pci_bus_id})")

    @staticmethod
    def _check(rc, what):
        if rc != 0:
            raise RuntimeError(f"NVML: {what} returned {rc}")

    def energy_mj(self) -> int:
        e = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(e)),
                    "nvmlDeviceGetTotalEnergyConsumption")
        return e.value

    def sm_clock_mhz(self) -> int:
        c = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(c)),
                    "nvmlDeviceGetClockInfo")
        return c.value

    def power_limit_w(self) -> float:
        p = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetEnforcedPowerLimit(self.handle, ctypes.byref(p)),
                    "nvmlDeviceGetEnforcedPowerLimit")
        return p.value / 1000.0


class ClockSampler:
    """SM clock read every `period_s` on a thread while a block runs (the mean of the samples)."""

    def __init__(self, nvml: Nvml, period_s=0.01):
        self.nvml, self.period_s = nvml, period_s

    def __enter__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            self.samples.append(self.nvml.sm_clock_mhz())
            self._stop.wait(self.period_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mean(self):
        return statistics.fmean(self.samples) if self.samples else float("nan")


def measure_block(run, calls, nvml):
    """(ms per call, mJ per call, mean W, mean SM MHz) of `calls` back-to-back calls of run()."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ClockSampler(nvml) as clock:
        e0 = nvml.energy_mj()
        start.record()
        for _ in range(calls):
            run()
        end.record()
        torch.cuda.synchronize()
        e1 = nvml.energy_mj()
    ms = start.elapsed_time(end)
    if e1 <= e0:
        raise RuntimeError(f"NVML's energy counter did not advance over {ms:.0f} ms: raise --block-s")
    return ms / calls, (e1 - e0) / calls, (e1 - e0) / ms, clock.mean()


def calls_per_block(run, block_s, min_calls=3):
    """How many calls fill `block_s` seconds, from two timed calls after the first."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    run()
    run()
    end.record()
    torch.cuda.synchronize()
    per_call_s = start.elapsed_time(end) / 2e3
    return max(min_calls, math.ceil(block_s / per_call_s))


def compare_shape(names, shape, rounds, block_s, nvml, fwd_only, seed=0):
    """{name: {"ms", "mj", "w", "mhz", "calls"} or a status dict}: the backends' blocks in turn,
    every backend in every position equally often (bench_kernel.round_orders), medians over rounds."""
    data = bk.packed_inputs(shape)
    ready, out = {}, {}
    for name in names:
        res = bk.guarded(lambda: bk.prepare_packed(name, shape, {}, fwd_only, data))
        if isinstance(res, dict):
            out[name] = res
        else:
            ready[name] = res
    runs = {name: (lambda p=p: p.run(fwd_only)) for name, p in ready.items()}

    def blocks():
        calls = {name: calls_per_block(run, block_s) for name, run in runs.items()}
        samples = {name: [] for name in ready}
        for order in bk.round_orders(list(ready), 0, rounds, seed):
            for name in order:
                samples[name].append(measure_block(runs[name], calls[name], nvml))
        return {name: dict(zip(("ms", "mj", "w", "mhz"), (statistics.median(c) for c in zip(*rows))),
                           calls=calls[name]) for name, rows in samples.items()}

    measured = bk.guarded(blocks)  # a failure while the blocks run is every measured backend's row
    for name in ready:
        out[name] = measured if "status" in measured else measured[name]
    return {name: out[name] for name in names}


COLUMNS = ["N", "P", "R", "backend", "ms / call", "mJ / call", "W", "SM MHz", "calls / block",
           "ms ratio", "mJ ratio", "J per ms ratio"]


def rows_for(shape, results):
    """Table rows of one shape; ratios to the first backend that ran."""
    first = next((r for r in results.values() if "status" not in r), None)
    rows = []
    for name, r in results.items():
        if "status" in r:
            rows.append([*shape, name, r["status"], "", "", "", "", "", "", r.get("why", "")])
            continue
        rows.append([*shape, name, f"{r['ms']:.3f}", f"{r['mj']:.1f}", f"{r['w']:.0f}", f"{r['mhz']:.0f}",
                     r["calls"], f"{r['ms'] / first['ms']:.3f}", f"{r['mj'] / first['mj']:.3f}",
                     f"{r['w'] / first['w']:.3f}"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="comma-separated NxPxR (default: the 10 published shapes)")
    ap.add_argument("--backends", default="cuda,flex-flash", help="as bench_kernel.py's (packed backends only)")
    ap.add_argument("--fwd-only", action="store_true", help="forward calls only (default: forward and backward)")
    ap.add_argument("--rounds", type=int, default=6, help="blocks per backend and shape (default 6)")
    ap.add_argument("--block-s", type=float, default=0.5, help="seconds per block (default 0.5)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    shapes = bk.parse_shapes(args.shapes) if args.shapes else bk.ALL_SHAPES
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in names:
        try:
            base, _ = bk.backend_env(b)
        except ValueError as exc:
            raise SystemExit(f"--backends: {exc}")
        if base not in bk.ALL_BACKENDS or base.startswith("sdpa"):
            raise SystemExit(f"--backends: {b!r} is not a packed backend of bench_kernel.py")
    if args.rounds < 1 or args.block_s <= 0:
        raise SystemExit("--rounds must be >= 1 and --block-s > 0")
    if not torch.cuda.is_available():
        raise SystemExit("bench_energy.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    nvml = Nvml(pci_bus_id(props))
    header = [f"device: {props.name}; power limit {nvml.power_limit_w():.0f} W; torch {torch.__version__}",
              "command: python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
              f"{'forward' if args.fwd_only else 'forward+backward'} calls; blocks of ~{args.block_s} s, "
              f"{args.rounds} rounds, backends in balanced random orders; medians over rounds"]
    print("\n".join(header), flush=True)
    torch.manual_seed(0)
    rows = []
    for shape in shapes:
        results = compare_shape(names, shape, args.rounds, args.block_s, nvml, args.fwd_only)
        bk._release()
        shape_rows = rows_for(shape, results)
        rows += shape_rows
        for row in shape_rows:
            print("  " + " ".join(str(c) for c in row), flush=True)
        if args.out:
            bk.write_markdown(args.out, header, rows, COLUMNS)
    print()
    print(bk.markdown(rows, COLUMNS))
    return rows


def pci_bus_id(props):
    """The device's PCI bus id as NVML spells it (NVML numbers cards its own way, not CUDA's)."""
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


if __name__ == "__main__":
    main()
