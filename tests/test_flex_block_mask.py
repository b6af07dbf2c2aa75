"""CPU checks of the FlexAttention backend's block mask and mask_mod (the GPU kernels are tested in
tests/gpu/test_flex_backend.py).

The block classification is compared with the dense token mask of the reference definition
(megatron_dualkv.ops.reference.allowed_mask), block by block; the mask_mod is checked through
eager flex_attention (unfused, dense: CPU-sized problems only) against the exact reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import flex_backend
from megatron_dualkv.ops.reference import allowed_mask, reference_attention

pytestmark = pytest.mark.skipif(flex_backend.flex_attention is None, reason="torch without FlexAttention")


def dense_block_classes(seg, block):
    t = seg.num_tokens
    idx = torch.arange(t)
    allowed = allowed_mask(seg, idx, idx)
    n = -(-t // block)
    full = torch.zeros(n, n, dtype=torch.bool)
    partial = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            tile = allowed[i * block:(i + 1) * block, j * block:(j + 1) * block]
            full[i, j] = bool(tile.all())
            partial[i, j] = bool(tile.any()) and not bool(tile.all())
    return full, partial


def test_block_classes_equal_dense_mask():
    rng = random.Random(3)
    for _ in range(12):
        groups = [(rng.randint(1, 300), [rng.randint(1, 150) for _ in range(rng.randint(1, 5))])
                  for _ in range(rng.randint(1, 3))]
        block = rng.choice([16, 32, 64])
        seg = SegmentTable.from_group_lengths(groups, pad=rng.choice([0, 7]))
        full, partial = flex_backend.block_classes(seg, block, block)
        want_full, want_partial = dense_block_classes(seg, block)
        assert torch.equal(full, want_full), (groups, block)
        assert torch.equal(partial, want_partial), (groups, block)


def test_block_classes_deeper_tree():
    # root -> child -> two grandchildren, plus a second child of the root
    seg = SegmentTable.from_host([0, 50, 90, 130, 170], [50, 40, 40, 40, 33], [-1, 0, 1, 1, 0])
    full, partial = flex_backend.block_classes(seg, 16, 16)
    want_full, want_partial = dense_block_classes(seg, 16)
    assert torch.equal(full, want_full) and torch.equal(partial, want_partial)


def test_padding_is_its_own_root_segment():
    seg = SegmentTable.from_group_lengths([(130, [1, 7])])
    padded = flex_backend.padded_segments(seg)
    assert padded.num_tokens == 256
    assert padded.host_parent[-1] == -1 and padded.host_length[-1] == 256 - 138
    assert flex_backend.padded_segments(padded) is padded


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3)])
def test_eager_flex_matches_reference(hq, hkv):
    seg = SegmentTable.from_group_lengths([(37, [5, 1, 60]), (130, [1, 90]), (3, [7])], pad=4)
    t = seg.num_tokens
    q = torch.randn(t, hq, 16, dtype=torch.float64)
    k = torch.randn(t, hkv, 16, dtype=torch.float64)
    v = torch.randn(t, hkv, 16, dtype=torch.float64)
    out = flex_backend.attention(q, k, v, seg, 0.3, compiled=False)
    ref, _ = reference_attention(q, k, v, seg, 0.3)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-12


def test_unavailable_on_cpu_says_why():
    ok, why = flex_backend.is_available(torch.empty(4, 2, 64))
    assert not ok and "CUDA" in why


@pytest.fixture
def hopper_with_flash(monkeypatch):
    """A Hopper GPU with flash-attn-4 installed, as far as the kernel choice can tell."""
    monkeypatch.setattr(flex_backend, "flash_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("MEGATRON_DUALKV_FLEX_KERNEL", raising=False)


def test_default_kernel_is_flash_only_where_flash_attn_4_runs(hopper_with_flash, monkeypatch):
    dev = torch.device("cuda", 0)
    assert flex_backend.default_kernel(dev, torch.bfloat16) == "FLASH"
    assert flex_backend.default_kernel(dev, torch.float16) == "FLASH"
    # flash-attn-4 rejects float32 inside its kernel launch: Triton takes it
    assert flex_backend.default_kernel(dev, torch.float32) == "TRITON"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert flex_backend.default_kernel(dev, torch.bfloat16) == "TRITON"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flex_backend, "flash_installed", lambda: False)
    assert flex_backend.default_kernel(dev, torch.bfloat16) == "TRITON"


def test_forced_kernel(hopper_with_flash, monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setenv("MEGATRON_DUALKV_FLEX_KERNEL", "TRITON")
    assert flex_backend.default_kernel(dev, torch.bfloat16) == "TRITON"
    monkeypatch.setenv("MEGATRON_DUALKV_FLEX_KERNEL", "flash")
    with pytest.raises(ValueError, match="must be TRITON or FLASH"):
        flex_backend.default_kernel(dev, torch.bfloat16)


def test_flash_on_float32_is_a_clear_error(hopper_with_flash, monkeypatch):
    seg = SegmentTable.from_group_lengths([(5, [3])])
    q, k, v = torch.randn(8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16)
    with pytest.raises(ValueError, match="FLASH kernel requested.*bf16 or fp16, not torch.float32"):
        flex_backend.attention(q, k, v, seg, 0.25, kernel="FLASH")
    monkeypatch.setenv("MEGATRON_DUALKV_FLEX_KERNEL", "FLASH")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        flex_backend.attention(q, k, v, seg, 0.25)
    with pytest.raises(ValueError, match="kernel must be"):
        flex_backend.attention(q, k, v, seg, 0.25, kernel="CUTE")
