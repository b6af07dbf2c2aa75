"""One forward + backward of the DualKV CUDA backend on one published shape, for a profiler.

    ncu --clock-control none -k regex:dkdv_ws --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        python csrc/profile_ws.py 16 32768 2048

Runs twice (the first run warms up: loads the extension, builds the work lists), so
`--launch-skip 1` profiles the second launch of the chosen kernel. bf16, Hq=32, Hkv=8, d=128.
"""
import sys

import torch

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import cuda_backend


def main() -> None:
    n, p, r = (int(x) for x in sys.argv[1:4])
    seg = SegmentTable.from_group_lengths([(p, [r] * n)], device="cuda")
    t = seg.num_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(t, h, 128, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(32).requires_grad_(), mk(8).requires_grad_(), mk(8).requires_grad_(), mk(32)
    for _ in range(2):
        cuda_backend.attention(q, k, v, seg, 128 ** -0.5).backward(do)
    torch.cuda.synchronize()
    print(f"profiled (N, P, R) = ({n}, {p}, {r}), T = {t}")


if __name__ == "__main__":
    main()
