"""Where the milliseconds of one DualKV forward + backward go, kernel by kernel (torch.profiler).

    python tools/kernel_breakdown.py 64x256x1024,16x512x1024 [--reps 5] [--backend cuda]
    python tools/kernel_breakdown.py 28x16384x2048 --backend cuda-deterministic   # deterministic=True

For each shape (one group of N responses of R tokens behind a prompt of P; bf16, Hq=32, Hkv=8,
d=128): two untimed runs (extension load, work lists, compiles), then --reps profiled runs of
forward + backward on fresh random inputs. Printed per shape: every GPU kernel's mean time per run
(ms) and share, summed by name, and the total. bench_kernel.py gives the end-to-end times; this
says which kernel (the attention kernels, the delta pre-pass, the dQ zero fill and conversion,
copies) they are made of.
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from bench_kernel import D, HKV, HQ, group_segments, parse_shapes, randn  # tools/, beside this script
from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import cuda_backend, flex_backend


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name cut to `width` characters for the table (the sums are kept by full name)."""
    return name if len(name) <= width else name[: width - 3] + "..."


def run_once(backend: str, seg: SegmentTable, t: int) -> None:
    q, k, v = (randn(t, h, D).requires_grad_() for h in (HQ, HKV, HKV))
    do = randn(t, HQ, D)
    if backend.startswith("cuda"):
        out = cuda_backend.attention(q, k, v, seg, D ** -0.5, deterministic=backend == "cuda-deterministic")
    else:
        out = flex_backend.attention(q, k, v, seg, D ** -0.5, kernel={"flex-flash": "FLASH", "flex-triton": "TRITON"}[backend])
    out.backward(do)


def breakdown(shape: tuple, backend: str, reps: int) -> None:
    n, p, r = shape
    seg = group_segments(n, p, r)
    t = seg.num_tokens
    for _ in range(2):
        run_once(backend, seg, t)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run_once(backend, seg, t)
        torch.cuda.synchronize()
    # summed by full name: cut at the first "(", every kernel of an anonymous namespace
    # ("void at::native::(anonymous namespace)::...") fell into one row
    per_kernel = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time_total / 1000 / reps  # us -> ms per run
    total = sum(per_kernel.values())
    print(f"\n(N, P, R) = ({n}, {p}, {r}), T = {t}, {backend}: {total:.3f} ms of GPU kernels per forward + backward "
          f"(mean of {reps}; includes the random inputs' generation)")
    print("| kernel | ms per run | share |")
    print("|---|---|---|")
    for name, ms in per_kernel.most_common():
        print(f"| `{short_name(name)}` | {ms:.3f} | {100 * ms / total:.1f} % |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", help="comma-separated NxPxR")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cuda-deterministic", "flex-flash", "flex-triton"))
    args = ap.parse_args()
    for shape in parse_shapes(args.shapes):
        breakdown(shape, args.backend, args.reps)


if __name__ == "__main__":
    main()
