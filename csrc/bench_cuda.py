"""Quick timing of the DualKV CUDA kernels on the published shapes (H100, bf16, d=128, 32/8 heads).

    python csrc/bench_cuda.py [--quick]

Prints fwd / bwd / fwd+bwd ms and useful TFLOP/s (attention FLOPs of the deduplicated problem,
fwd = 4*D*Hq*pairs, fwd+bwd counted as 3.5x fwd) and peak memory. tools/bench_kernel.py holds the
full comparison with FlexAttention and SDPA; this script is the kernel engineer's own check.
"""
import math
import os
import statistics
import sys

import torch

from megatron_dualkv.flops import group_pairs
from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import cuda_backend

SHAPES = [(28, 4096), (28, 16384), (16, 32768), (28, 32768), (16, 65536)]


def layout(n, p, r):
    return SegmentTable.from_group_lengths([(p, [r] * n)], device="cuda")


def pairs(n, p, r):
    return group_pairs(p, [r] * n)[0]


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


IMPLS = ("mma", "sm90", "sm90v1", "ws")
BWD = ("mma", "sm90")


def main():
    global IMPLS, BWD
    quick = "--quick" in sys.argv
    if "--default-only" in sys.argv:  # forward: only the default v1 kernel (both backward variants)
        IMPLS = ("sm90v1",)
    if "--ws" in sys.argv:  # forward: the default v1 kernel and the warp-specialized one
        IMPLS = ("sm90v1", "ws")
    if os.environ.get("MEGATRON_DUALKV_BENCH_NO_WS"):  # set by gpu_check.sh when ws failed its smoke check
        IMPLS = tuple(i for i in IMPLS if i != "ws")
    if "ws" in IMPLS and not cuda_backend._has_op("fwd_ws_sm90"):
        cuda_backend.is_available()  # loads the extension
        if not cuda_backend._has_op("fwd_ws_sm90"):
            IMPLS = tuple(i for i in IMPLS if i != "ws")
    hq, hkv, d = 32, 8, 128
    print(f"device: {torch.cuda.get_device_name()}")
    print("fwd: mma = mma.sync kernel, v0 = wgmma 128-key tiles 1 CTA/SM, v1 = wgmma 64-key tiles 2 CTAs/SM (default), "
          "ws = warp-specialized (TMA producer + 2 ping-pong consumers); fwd+bwd ws = ws forward + ws backward "
          "(dK/dV kernel with TMA producer, atomic dQ), bwd ms ws = fwd+bwd ws - fwd ws; "
          "bwd (after the v1 forward): det = wgmma dK/dV + dQ kernels, fast = wgmma dK/dV with fp32 atomic dQ (default)")
    print("| N | P | R | fwd ms mma | fwd ms v0 | fwd ms v1 | bwd ms det | bwd ms fast | fwd+bwd ms det | fwd+bwd ms fast | "
          "fwd TF/s mma | fwd TF/s v0 | fwd TF/s v1 | fwd+bwd TF/s det | fwd+bwd TF/s fast | peak GiB | "
          "fwd ms ws | fwd TF/s ws | bwd ms ws | fwd+bwd ms ws | fwd+bwd TF/s ws |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in (2048, 1024):
        for n, p in SHAPES:
            seg = layout(n, p, r)
            t = seg.num_tokens
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            do = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            scale = 1 / math.sqrt(d)
            cuda_backend.work_tensors(seg, q.device)
            reps = 1 if quick else 3
            torch.cuda.reset_peak_memory_stats()
            f_ms = {}
            with torch.no_grad():
                for impl in IMPLS:
                    os.environ["MEGATRON_DUALKV_SM90_FWD_VARIANT"] = "1" if impl == "sm90v1" else "0"
                    fi = impl[:4] if impl != "mma" else "mma"
                    cuda_backend.forward(q, k, v, seg, scale, fwd_impl=fi)  # warm-up
                    f_ms[impl] = timed(lambda: cuda_backend.forward(q, k, v, seg, scale, fwd_impl=fi), reps)
                os.environ["MEGATRON_DUALKV_SM90_FWD_VARIANT"] = "1"
            fb_ms = {}
            # MEGATRON_DUALKV_BENCH_NO_WS_BWD: the ws backward failed its smoke check (ws forward still timed)
            ws_fb = "ws" in IMPLS and not os.environ.get("MEGATRON_DUALKV_BENCH_NO_WS_BWD")
            for impl in BWD + (("ws",) if ws_fb else ()):  # "mma": the sm90 deterministic backward
                os.environ["MEGATRON_DUALKV_ATOMIC_DQ"] = "1" if impl == "sm90" else "0"  # fast: atomics
                def fb():
                    ki = "ws" if impl == "ws" else "sm90"
                    out = cuda_backend.attention(q, k, v, seg, scale, fwd_impl=ki, bwd_impl=ki,
                                                 deterministic=(impl == "mma"))
                    out.backward(do)
                fb()
                fb_ms[impl] = timed(fb, reps)
            os.environ.pop("MEGATRON_DUALKV_ATOMIC_DQ")
            peak = torch.cuda.max_memory_allocated() / 2**30
            fl = 4 * d * hq * pairs(n, p, r)
            nan = float("nan")
            fm, f0, f1, fw = f_ms.get("mma", nan), f_ms.get("sm90", nan), f_ms["sm90v1"], f_ms.get("ws", nan)
            bd, bf, bw = fb_ms["mma"], fb_ms.get("sm90", nan), fb_ms.get("ws", nan)
            print(f"| {n} | {p} | {r} | {fm:.1f} | {f0:.1f} | {f1:.1f} | {bd - f1:.1f} | {bf - f1:.1f} | {bd:.1f} | "
                  f"{bf:.1f} | {fl / fm / 1e9:.0f} | {fl / f0 / 1e9:.0f} | {fl / f1 / 1e9:.0f} | {3.5 * fl / bd / 1e9:.0f} | "
                  f"{3.5 * fl / bf / 1e9:.0f} | {peak:.1f} | {fw:.1f} | {fl / fw / 1e9:.0f} | {bw - fw:.1f} | "
                  f"{bw:.1f} | {3.5 * fl / bw / 1e9:.0f} |", flush=True)
            del q, k, v, do
            q = k = v = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
