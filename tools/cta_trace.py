"""Where a ws kernel's SM time goes, CTA by CTA: the start of each CTA, its loop, its end and the
gaps between CTAs, from per-CTA clock stamps (docs/PERF.md, thirty-eighth session).

    python csrc/build_ext.py /tmp/trace --cta-trace [--python-include ...]   # a build with the stamps
    MEGATRON_DUALKV_CUDA_LIB=/tmp/trace/_C.so python tools/cta_trace.py bwd --shapes 28x4096x2048
    MEGATRON_DUALKV_CUDA_LIB=/tmp/trace/_C.so python tools/cta_trace.py fwd --groups 8 --spread 0.5 \\
        --shapes 16x1024x2048 --hq 32 --hkv 4 --out trace.md

A build with --cta-trace is for this tool only (a default build has none of the stamps; see
csrc/cta_trace.h). bwd traces the dK/dV kernel of the backward as forward() runs it (fast mode;
`--deterministic` for deterministic mode, whose overlapped walk is stamped as a whole); fwd the
forward with one CTA per query tile (MEGATRON_DUALKV_WS_FWD_PERSISTENT=0: persistent CTAs are not
stamped). Per layout: `--reps` traced calls after `--warmup` untraced ones; each row gives the
call's ms (CUDA events: the whole forward or backward, its other kernels included), the traced
kernel's span (first CTA start to last end, %globaltimer) and the shares of the SMs' time.
Shares: per SM, its CTAs' stamps (%clock64, one SM's counter) from its first start to its last
end, plus the time before its first and after its last CTA within the span; every part is a share
of all SMs' time, so the parts, the gaps and the idle ends add up to 1.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

SLOTS = 10  # csrc/cta_trace.h kSlots
# the stamps' points per kernel (slots 1..6 of csrc/cta_trace.h): part name -> (from, to)
PARTS = {
    "bwd": {"to K/V in": (1, 2), "step 0": (2, 3), "steps 1..": (3, 4), "last dQ + writes": (4, 5), "epilogue": (5, 6)},
    "fwd": {"to Q in": (1, 2), "tile 0": (2, 3), "loop": (3, 4), "last P V + narrow": (4, 5), "epilogue": (5, 6)},
}
COUNT = {"bwd": "steps", "fwd": "key tiles"}


def shares(stamps, kernel: str) -> dict:
    """The stamps of one launch (an int64 [blocks, SLOTS] tensor; blocks whose slot 1 is 0 were not
    stamped and are left out) as shares of the SMs' time: each part of PARTS[kernel], the gaps
    between one CTA's end and the next one's start on an SM, and the SMs' idle time before their
    first and after their last CTA within the kernel's span; with the span (ms), the CTAs, the mean
    count a CTA (COUNT[kernel]), the median cycles a loop unit (steps 1.. or the loop's key tiles,
    CTAs with more than 2) and the median fixed cycles a CTA (the start, the end)."""
    import torch

    tr = stamps[stamps[:, 1] != 0].double()
    if tr.shape[0] == 0:
        raise ValueError("no CTA was stamped: is the library a --cta-trace build (csrc/build_ext.py --cta-trace)?")
    parts = PARTS[kernel]
    sm = tr[:, 0].long() & 0xFFFFFFFF
    count = (tr[:, 0].long() >> 32).double()
    g0, g1 = tr[:, 7], tr[:, 8]
    span_ns = float(g1.max() - g0.min())
    whole = gaps = idle = 0.0
    for s in sm.unique():
        on = sm == s
        start, end = tr[on, 1], tr[on, 6]
        order = torch.argsort(start)
        start, end = start[order], end[order]
        busy = float(end.max() - start.min())
        cycles_per_ns = busy / max(float(g1[on].max() - g0[on].min()), 1.0)
        gaps += float((start[1:] - end[:-1]).clamp(min=0).sum())
        idle += (float(g0[on].min() - g0.min()) + float(g1.max() - g1[on].max())) * cycles_per_ns
        whole += busy
    whole += idle
    res = {"span ms": span_ns / 1e6, "CTAs": int(tr.shape[0]), f"{COUNT[kernel]} a CTA": float(count.mean())}
    for name, (a, b) in parts.items():
        res[name] = float((tr[:, b] - tr[:, a]).sum()) / whole
    res["gaps between CTAs"] = gaps / whole
    res["idle at the ends"] = idle / whole
    loop_units = count - (1 if kernel == "bwd" else 2)
    many = loop_units > 0
    res["cycles a loop unit"] = float(((tr[:, 4] - tr[:, 3])[many] / loop_units[many]).median()) if many.any() else 0.0
    res["fixed cycles a CTA"] = float(((tr[:, 2] - tr[:, 1]) + (tr[:, 6] - tr[:, 5])).median())
    return res


SHARE_KEYS = ("gaps between CTAs", "idle at the ends")


def row(label: str, ms: float, res: dict, kernel: str) -> str:
    cells = []
    for k, x in res.items():
        if k in PARTS[kernel] or k in SHARE_KEYS:
            cells.append(f"{100 * x:.1f} %")
        elif isinstance(x, int):
            cells.append(str(x))
        else:
            cells.append(f"{x:.2f}" if x < 100 else f"{x:.0f}")
    return f"| {label} | {ms:.2f} | " + " | ".join(cells) + " |"


def trace_layout(kernel, shape, args, buf):
    """[(call ms, shares)] of `args.reps` traced calls on one layout."""
    import torch

    import bench_kernel as bk  # tools/, beside this script
    from megatron_dualkv.ops import cuda_backend

    seg = bk.group_segments(*shape)
    t = seg.num_tokens
    q = bk.randn(t, args.hq, args.head_dim).requires_grad_(kernel == "bwd")
    k = bk.randn(t, args.hkv, args.head_dim).requires_grad_(kernel == "bwd")
    v = bk.randn(t, args.hkv, args.head_dim).requires_grad_(kernel == "bwd")
    dout = bk.randn(t, args.hq, args.head_dim)
    scale = args.head_dim ** -0.5
    var = "MDKV_CTA_TRACE_BWD" if kernel == "bwd" else "MDKV_CTA_TRACE_FWD"

    def call(traced):
        out = None
        if kernel == "bwd":
            out = cuda_backend.attention(q, k, v, seg, scale, deterministic=args.deterministic)
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if traced:
            buf.zero_()
            os.environ[var] = f"{buf.data_ptr()}:{buf.numel() // SLOTS}"
        try:
            with torch.no_grad() if kernel == "fwd" else contextlib.nullcontext():
                a.record()
                if kernel == "fwd":
                    cuda_backend.attention(q, k, v, seg, scale, deterministic=args.deterministic)
                else:
                    out.backward(dout)
                b.record()
            torch.cuda.synchronize()
        finally:
            os.environ.pop(var, None)
        q.grad = k.grad = v.grad = None
        return a.elapsed_time(b)

    for _ in range(args.warmup):
        call(False)
    results = []
    for _ in range(args.reps):
        ms = call(True)
        stamps = buf.view(-1, SLOTS).cpu()
        if stamps[-1, 1] != 0:
            raise SystemExit(f"cta_trace.py: the grid filled the buffer's {stamps.shape[0]} blocks; raise --max-blocks")
        results.append((ms, shares(stamps, kernel)))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("fwd", "bwd"))
    ap.add_argument("--shapes", required=True, help="comma-separated NxPxR (bench_kernel.py's layouts)")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--spread", type=float, default=0.0)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--deterministic", action="store_true", help="the deterministic mode's kernels")
    ap.add_argument("--reps", type=int, default=3, help="traced calls per layout (default 3)")
    ap.add_argument("--warmup", type=int, default=3, help="untraced calls first (default 3)")
    ap.add_argument("--max-blocks", type=int, default=1 << 20, help="the stamps buffer's blocks (default 2^20)")
    ap.add_argument("--out", help="also write the table here (markdown)")
    args = ap.parse_args(argv)

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_kernel as bk

    if not torch.cuda.is_available():
        sys.exit("cta_trace.py: needs a GPU")
    shapes = bk.parse_shapes(args.shapes)
    bk.HQ, bk.HKV, bk.D, bk.GROUPS, bk.SPREAD = args.hq, args.hkv, args.head_dim, args.groups, args.spread
    if args.kernel == "fwd":
        os.environ["MEGATRON_DUALKV_WS_FWD_PERSISTENT"] = "0"  # persistent CTAs are not stamped
    buf = torch.zeros(args.max_blocks * SLOTS, dtype=torch.int64, device="cuda")
    header = None
    lines = [f"{torch.cuda.get_device_name()}; {args.kernel}, Hq / Hkv = {args.hq} / {args.hkv}, d = {args.head_dim}, "
             f"groups {args.groups}, spread {args.spread}" + (", deterministic" if args.deterministic else ""), ""]
    for shape in shapes:
        for ms, res in trace_layout(args.kernel, shape, args, buf):
            if header is None:
                header = "| (N, P, R) | call ms | " + " | ".join(res) + " |"
                lines += [header, "|---|---|" + "---|" * len(res)]
            lines.append(row(str(tuple(shape)), ms, res, args.kernel))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
