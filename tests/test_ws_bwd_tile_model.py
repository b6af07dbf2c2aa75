"""The ws backward's tiling and masking, replayed in float64 on the host (csrc/ws_bwd_tile_model.py):
the kernel's kv items and query steps, its TMA boxes (a short key tile's box holding the next
segment's keys), its P^T mask, a prompt tail's keys loaded over a response tile's first rows and
summed over the tail's parts, and local queries, against the exact attention gradients. The
replay without the key-row mask must come out wrong, so the check is known to bite."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "csrc"))
import ws_bwd_tile_model as model  # noqa: E402


def test_the_kernels_tiling_is_exact(capsys):
    assert model.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("tails merged" in ln and ln.endswith("exact") for ln in lines) == 4
    assert sum("local queries" in ln and ln.endswith("exact") for ln in lines) == 4
    assert sum("key-row mask off" in ln and ln.endswith("WRONG") for ln in lines) == 4
