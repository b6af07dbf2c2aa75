"""Peak TFLOP/s of the devices: the denominator of MFU.

The FLOPs of a step (deduplicated or replicated) are counted by megatron_dualkv.model_shape.ModelShape
(useful_flops, replicated_flops), the same formulas as the memory planner's.

"Useful" FLOPs are those of the deduplicated problem (P + sum R tokens, DualKV pairs): MFU divides
them by the elapsed time and the peak of every device, so the replicated baseline (--no-dualkv),
which does more work for the same update, shows a lower MFU for the same result.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..model_shape import ModelShape  # noqa: F401  (re-exported: this module's name for it before model_shape.py)

# bf16 dense peak (TFLOP/s) of the GPUs we run on; --peak-tflops overrides
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "B200": 2250.0}


def peak_tflops(override: Optional[float] = None) -> Optional[float]:
    """Per-device peak TFLOP/s: the override, else a known GPU's bf16 dense peak, else None."""
    if override is not None:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
