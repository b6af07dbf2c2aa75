"""Backend adapter for the exact reference (any device; autograd does the backward)."""

from __future__ import annotations

from torch import Tensor

from ..layout import SegmentTable
from .reference import reference_attention


def is_available(q: Tensor) -> tuple[bool, str]:
    return True, ""


def attention(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: float) -> Tensor:
    return reference_attention(q, k, v, segments, softmax_scale)[0]
