"""tools/cta_trace.py's arithmetic on stamps written by hand: every part, the gaps between CTAs on an
SM and the SMs' idle ends are shares of all SMs' time that add up to 1; blocks left unstamped are
left out; a buffer with no stamp at all names the --cta-trace build it needs."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import cta_trace  # noqa: E402


def stamp(sm, count, t, g0, g1):
    """One block's slots: smid | count << 32, clock64 at entry and at points 2..6, globaltimer."""
    return [sm | (count << 32), *t, g0, g1, 0]


def two_sms():
    # SM 0 at 1 cycle a ns runs CTA A (ns 0..100) and, after a gap of 10, CTA B (110..200); SM 1 (its
    # own clock64 offset, also 1 cycle a ns) runs CTA C from 0 to 150 ns, then idles to the span's end
    return torch.tensor([
        stamp(0, 7, [500, 510, 520, 580, 590, 600], 0, 100),
        stamp(0, 4, [610, 615, 625, 685, 690, 700], 110, 200),
        stamp(1, 1, [1000, 1010, 1020, 1100, 1110, 1150], 0, 150),
        [0] * cta_trace.SLOTS,  # a block that was not stamped
    ], dtype=torch.int64)


def test_backward_shares_add_up_and_match_the_stamps():
    res = cta_trace.shares(two_sms(), "bwd")
    whole = 400.0  # SM 0: 200 cycles from first start to last end; SM 1: 150, and 50 idle at the end
    assert res["CTAs"] == 3 and res["span ms"] == pytest.approx(200e-6)
    assert res["steps a CTA"] == pytest.approx(4.0)
    expected = {"to K/V in": 25, "step 0": 30, "steps 1..": 200, "last dQ + writes": 25, "epilogue": 60,
                "gaps between CTAs": 10, "idle at the ends": 50}
    for name, cycles in expected.items():
        assert res[name] == pytest.approx(cycles / whole), name
    assert sum(res[name] for name in expected) == pytest.approx(1.0)
    # loop units: steps 1.. of A (6 steps, 60 cycles) and B (3, 60); C has none. Fixed: 20, 15, 50
    assert res["cycles a loop unit"] == pytest.approx(10.0)
    assert res["fixed cycles a CTA"] == pytest.approx(20.0)


def test_forward_parts_and_its_loop_units():
    res = cta_trace.shares(two_sms(), "fwd")
    assert list(res)[3:8] == ["to Q in", "tile 0", "loop", "last P V + narrow", "epilogue"]
    assert res["loop"] == pytest.approx(200 / 400)
    # a forward CTA's loop is its key tiles but tile 0 and the last: A 5 (60 cycles), B 2 (60)
    assert res["cycles a loop unit"] == pytest.approx(12.0)
    line = cta_trace.row("(8, 512, 1024)", 1.5, res, "fwd")
    assert line.startswith("| (8, 512, 1024) | 1.50 | 0.00 | 3 | 4.00 | 6.2 % |")


def test_an_unstamped_buffer_names_the_build_it_needs():
    with pytest.raises(ValueError, match="--cta-trace"):
        cta_trace.shares(torch.zeros(4, cta_trace.SLOTS, dtype=torch.int64), "bwd")
