"""One forward + backward per backend on one published shape, for a profiler.

    ncu --clock-control none -k regex:dkdv_ws --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        python csrc/profile_ws.py 16 32768 2048

    # side by side with FlexAttention's FLASH kernels (flash-attn-4; docs/PERF.md, eleventh session)
    ncu --clock-control none --profile-from-start off -k "regex:fwd_ws|dkdv_ws|Forward|Backward" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python csrc/profile_ws.py 28 16384 2048 cuda,flex-flash

    python csrc/profile_ws.py 16 65536 2048 cuda,flex-flash 4     # Hkv = 4 (Qwen3-30B-A3B's heads)

Each backend runs twice; the first run warms up (loads the extension, builds the work lists,
compiles flex), so `--launch-skip 1` profiles the second launch of the chosen kernel, and the
second runs lie between cudaProfilerStart and Stop (`--profile-from-start off`). bf16, Hq=32,
Hkv=8 (or the fifth argument), d=128.
"""
import sys

import torch

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import cuda_backend, flex_backend


def main() -> None:
    n, p, r = (int(x) for x in sys.argv[1:4])
    backends = sys.argv[4].split(",") if len(sys.argv) > 4 else ["cuda"]
    hkv = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    if 32 % hkv:
        raise SystemExit(f"Hkv = {hkv} must divide Hq = 32")
    seg = SegmentTable.from_group_lengths([(p, [r] * n)], device="cuda")
    t = seg.num_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(t, h, 128, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(32).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk(32)
    runs = {"cuda": lambda: cuda_backend.attention(q, k, v, seg, 128 ** -0.5),
            "flex-flash": lambda: flex_backend.attention(q, k, v, seg, 128 ** -0.5, kernel="FLASH"),
            "flex-triton": lambda: flex_backend.attention(q, k, v, seg, 128 ** -0.5, kernel="TRITON")}
    unknown = [b for b in backends if b not in runs]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {sorted(runs)}")
    for b in backends:
        runs[b]().backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for b in backends:
        runs[b]().backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled (N, P, R) = ({n}, {p}, {r}), Hkv = {hkv}, T = {t}: {', '.join(backends)}")


if __name__ == "__main__":
    main()
