"""tools/bench_energy.py on the CPU: NVML through ctypes (a fake library), blocks of calls per
backend taking turns in balanced random orders on the same inputs, energy and time per call
from the counter and the events, the ratios to the first backend, and the errors it names."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_energy  # noqa: E402
import bench_kernel  # noqa: E402


class FakeCard:
    """A GPU clock (ms) and energy counter (mJ) that calls advance; an NVML library reading them."""

    def __init__(self):
        self.ms, self.mj, self.mhz, self.bus = 0.0, 1_000_000, 1500, None

    # NVML entry points: 0 is NVML_SUCCESS; out-parameters arrive as ctypes.byref(...)
    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, handle):
        self.bus = bus
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, out):
        out._obj.value = int(self.mj)
        return 0

    def nvmlDeviceGetClockInfo(self, handle, kind, out):
        out._obj.value = self.mhz
        return 0

    def nvmlDeviceGetEnforcedPowerLimit(self, handle, out):
        out._obj.value = 700_000
        return 0


class FakeEvent:
    card = None

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = FakeEvent.card.ms

    def elapsed_time(self, other):
        return other.t - self.t


class FakePacked:
    """Each call takes `ms` and `mj` on the card; calls are logged by name."""

    def __init__(self, name, ms, mj, card, log):
        self.name, self.ms, self.mj, self.card, self.log = name, ms, mj, card, log

    def run(self, fwd_only):
        self.card.ms += self.ms
        self.card.mj += self.mj
        self.log.append(self.name)


@pytest.fixture
def card(monkeypatch):
    c = FakeCard()
    FakeEvent.card = c
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    shared = ("layout", None, None, None, None)
    monkeypatch.setattr(bench_kernel, "packed_inputs", lambda shape: shared)
    cost = {"cuda": (10.0, 6000.0), "flex-flash": (9.0, 6300.0)}
    c.log = []

    def prepare(name, shape, state, fwd_only=False, data=None):
        assert data is shared, "every backend of the shape gets the same inputs"
        if name == "flex-triton":
            raise bench_kernel.Skip("not here")
        return FakePacked(name, *cost[name], c, c.log)

    monkeypatch.setattr(bench_kernel, "prepare_packed", prepare)
    return c


def test_nvml_reads_through_ctypes(card):
    nvml = bench_energy.Nvml("00000000:19:00.0", lib=card)
    assert card.bus == b"00000000:19:00.0"
    assert nvml.energy_mj() == 1_000_000 and nvml.sm_clock_mhz() == 1500 and nvml.power_limit_w() == 700.0


def test_nvml_error_names_the_call(card):
    card.nvmlDeviceGetTotalEnergyConsumption = lambda handle, out: 3
    with pytest.raises(RuntimeError, match="nvmlDeviceGetTotalEnergyConsumption returned 3"):
        bench_energy.Nvml("00000000:19:00.0", lib=card).energy_mj()


def test_pci_bus_id_as_nvml_spells_it():
    props = type("P", (), {"pci_domain_id": 0, "pci_bus_id": 0x19, "pci_device_id": 0})()
    assert bench_energy.pci_bus_id(props) == "00000000:19:00.0"


def test_blocks_take_turns_and_give_energy_and_time_per_call(card):
    nvml = bench_energy.Nvml("00000000:19:00.0", lib=card)
    res = bench_energy.compare_shape(["cuda", "flex-flash", "flex-triton"], (2, 64, 32), 5, 0.1, nvml, True)
    assert res["flex-triton"] == {"status": "n/a", "why": "not here"}
    # block sizes from two timed calls (after one untimed): 0.1 s of 10 ms and 9 ms calls
    assert res["cuda"]["calls"] == 10 and res["flex-flash"]["calls"] == 12
    sizing = 2 * 3
    blocks = card.log[sizing:]
    assert len(blocks) == 5 * (10 + 12)
    # rounds in balanced random orders: not always the same backend first
    firsts, i = set(), 0
    for _ in range(5):
        firsts.add(blocks[i])
        i += 10 + 12
    assert firsts == {"cuda", "flex-flash"}
    assert res["cuda"]["ms"] == pytest.approx(10.0) and res["cuda"]["mj"] == pytest.approx(6000.0)
    assert res["flex-flash"]["ms"] == pytest.approx(9.0) and res["flex-flash"]["mj"] == pytest.approx(6300.0)
    assert res["cuda"]["w"] == pytest.approx(600.0) and res["flex-flash"]["w"] == pytest.approx(700.0)
    rows = bench_energy.rows_for((2, 64, 32), res)
    assert rows[0][-3:] == ["1.000", "1.000", "1.000"]
    assert rows[1][-3:] == ["0.900", "1.050", "1.167"]
    assert rows[2][4] == "n/a" and rows[2][-1] == "not here"


def test_a_failure_while_the_blocks_run_is_each_backends_row(card):
    card.nvmlDeviceGetTotalEnergyConsumption = lambda handle, out: setattr(out._obj, "value", 5) or 0
    nvml = bench_energy.Nvml("00000000:19:00.0", lib=card)
    res = bench_energy.compare_shape(["cuda", "flex-flash", "flex-triton"], (2, 64, 32), 2, 0.1, nvml, True)
    assert res["flex-triton"] == {"status": "n/a", "why": "not here"}
    for name in ("cuda", "flex-flash"):
        assert res[name]["status"] == "error" and "did not advance" in res[name]["why"]


def test_a_counter_that_does_not_move_is_named(card):
    card.nvmlDeviceGetTotalEnergyConsumption = lambda handle, out: setattr(out._obj, "value", 5) or 0
    nvml = bench_energy.Nvml("00000000:19:00.0", lib=card)
    with pytest.raises(RuntimeError, match="did not advance.*--block-s"):
        bench_energy.measure_block(lambda: None, 3, nvml)


@pytest.mark.parametrize("argv, why", [(["--backends", "sdpa-flash"], "not a packed backend"),
                                       (["--backends", "cuda[X]"], "not VAR=VALUE"),
                                       (["--rounds", "0"], "--rounds")])
def test_bad_arguments_are_named(argv, why, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_energy.main(argv)
    assert why in str(exc.value)
