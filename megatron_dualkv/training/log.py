"""Per-step training log: loss, KL, clip fraction, tokens/s, dedup ratio, TFLOP/s and MFU.

    log = StepLog(shape, dp_group=..., world_size=..., peak_tflops=989, dualkv=True, sink=print)
    # the forward step calls log.begin_micro_batch(item) and log.add(metrics) per micro-batch;
    # whoever runs the optimizer calls log.end_step() after it (the CPU runner directly, the
    # pretrain() script through a torch optimizer step hook); a step not closed that way is closed
    # when the next one begins, or by log.close().

The metric sums of a step are all-reduced over the data-parallel group once, at its end (every
rank calls end_step at the same point). Step time runs from the step's first micro-batch to its
end; tokens/s counts the replicated-equivalent tokens of the step (sum over responses of P + R:
the same number for DualKV and --no-dualkv, so the two are directly comparable), TFLOP/s and MFU
count only the deduplicated FLOPs (model_shape.ModelShape.useful_flops) over every device.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .data import StepItem, StepTotals
from ..model_shape import ModelShape


@dataclass
class StepRecord:
    step: int  # 1-based, as Megatron counts iterations
    loss: float
    pg_loss: float
    kl: float
    clip_fraction: float
    ratio: float
    dedup_ratio: float
    seconds: float
    tokens_per_s: float  # replicated-equivalent tokens per second (all ranks)
    packed_tokens_per_s: float  # tokens the model actually processed per second
    useful_tflops: float  # deduplicated FLOPs / s / device
    mfu: Optional[float]
    grad_norm: Optional[float] = None
    totals: Optional[StepTotals] = field(default=None, repr=False)

    def to_json(self) -> str:
        d = asdict(self)
        d["totals"] = None if self.totals is None else asdict(self.totals)
        return json.dumps(d)

    def line(self) -> str:
        mfu = f"{100 * self.mfu:.1f}%" if self.mfu is not None else "n/a"
        gn = f" | grad norm {self.grad_norm:.3f}" if self.grad_norm is not None else ""
        return (f"step {self.step:4d} | loss {self.loss:+.5f} | kl {self.kl:.5f} | clip {self.clip_fraction:.4f} "
                f"| ratio {self.ratio:.4f} | {self.tokens_per_s:,.0f} tok/s | dedup {self.dedup_ratio:.2f}x "
                f"| {self.useful_tflops:.3g} TFLOP/s/dev | MFU {mfu}{gn}")


def step_sink(print_line: Optional[Callable[[str], None]], json_path: Optional[str] = None):
    """A StepLog sink printing each record's line and appending its JSON to json_path."""
    def sink(rec: StepRecord) -> None:
        if print_line is not None:
            print_line(rec.line())
        if json_path:
            with open(json_path, "a") as f:
                f.write(rec.to_json() + "\n")
    return sink


class StepLog:
    def __init__(self, shape: ModelShape, *, dp_group=None, world_size: int = 1, peak_tflops: Optional[float] = None,
                 dualkv: bool = True, sink: Optional[Callable[[StepRecord], None]] = None, sync: Optional[Callable] = None):
        self.shape = shape
        self.dp_group = dp_group  # a process group, or a callable returning it (resolved at the first step end)
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.dualkv = dualkv
        self.sink = sink
        self.sync = sync  # e.g. torch.cuda.synchronize, so that the step time covers the device work
        self.history: list[StepRecord] = []
        self._step: Optional[int] = None
        self._totals: Optional[StepTotals] = None
        self._sums: dict[str, torch.Tensor] = {}
        self._t0 = 0.0

    def begin_micro_batch(self, item: StepItem) -> None:
        if self._step is not None and item.step != self._step:
            self.end_step()
        if self._step is None:
            self._step, self._totals, self._sums = item.step, item.totals, {}
            self._t0 = time.perf_counter()

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for k, v in metrics.items():
            v = v.detach().to(torch.float64)
            self._sums[k] = self._sums[k] + v if k in self._sums else v.clone()

    def end_step(self, grad_norm: Optional[float] = None) -> Optional[StepRecord]:
        """Close the open step (no-op when none is open): reduce, time, record, print."""
        if self._step is None:
            return None
        keys = sorted(self._sums)
        if keys:
            flat = torch.stack([self._sums[k] for k in keys])  # [K, 2]
            group = self.dp_group() if callable(self.dp_group) else self.dp_group
            if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            vals = {k: flat[i].tolist() for i, k in enumerate(keys)}
        else:
            vals = {}
        if self.sync is not None:
            self.sync()
        seconds = max(time.perf_counter() - self._t0, 1e-9)
        t = self._totals
        mean = lambda k: vals[k][0] / vals[k][1] if k in vals and vals[k][1] > 0 else float("nan")
        useful = self.shape.useful_flops(t) / seconds / self.world_size / 1e12
        rec = StepRecord(
            step=self._step + 1, loss=mean("loss"), pg_loss=mean("pg_loss"), kl=mean("kl"),
            clip_fraction=mean("clip_fraction"), ratio=mean("ratio"), dedup_ratio=t.dedup_ratio, seconds=seconds,
            tokens_per_s=t.replicated_tokens / seconds,
            packed_tokens_per_s=(t.packed_tokens if self.dualkv else t.replicated_tokens) / seconds,
            useful_tflops=useful, mfu=useful / self.peak_tflops if self.peak_tflops else None,
            grad_norm=grad_norm, totals=t,
        )
        self.history.append(rec)
        self._step, self._totals, self._sums = None, None, {}
        if self.sink is not None:
            self.sink(rec)
        return rec

    close = end_step
