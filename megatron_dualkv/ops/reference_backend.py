"""Backend adapter for the exact reference (any device; autograd does the backward)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..layout import SegmentTable
from .reference import reference_attention


def supports_q_rows(deterministic: bool = False) -> tuple[bool, str]:
    """Local queries against all keys (context parallelism): always taken."""
    return True, ""


def is_available(q: Tensor) -> tuple[bool, str]:
    return True, ""


def attention(q: Tensor, k: Tensor, v: Tensor, segments: SegmentTable, softmax_scale: float,
              q_rows: Optional[Tensor] = None) -> Tensor:
    return reference_attention(q, k, v, segments, softmax_scale, q_rows=q_rows)[0]
