"""First GPU check of the warp-specialized kernels (fwd_impl / bwd_impl "ws"), meant to run under
a short timeout before anything else touches them (csrc/gpu_check.sh does): a pipeline bug shows
as a hang or a launch error here, not in the middle of the test suite.

    timeout 90 python csrc/ws_smoke.py      exit 0: ws agrees with the default sm90 kernels

For a few layouts (tiny, odd lengths, a long prompt) and both dtypes it compares out and lse of
the ws forward (with and without ping-pong) and dq, dk, dv of the ws backward with the default
"sm90" kernels (fast mode) on the same inputs, then times one published shape.
"""
import math
import os
import sys
import time

import torch

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import cuda_backend


def segments(groups, pad=0):
    start, length, parent, pos = [], [], [], 0
    for p, rs in groups:
        root = len(start)
        start.append(pos); length.append(p); parent.append(-1); pos += p
        for r in rs:
            start.append(pos); length.append(r); parent.append(root); pos += r
    if pad:
        start.append(pos); length.append(pad); parent.append(-1); pos += pad
    return SegmentTable.from_host(start, length, parent, device="cuda")


def main():
    ok, why = cuda_backend.is_available()
    if not ok or not cuda_backend._has_op("fwd_ws_sm90"):
        print(f"ws smoke: unavailable ({why or 'op fwd_ws_sm90 missing'})")
        return 2
    layouts = [
        ([(5, [3])], 0, 8, 2, 128),
        ([(100, [3, 70, 1]), (5, [9])], 3, 8, 2, 64),
        ([(1000, [1, 129, 700]), (3, [2] * 5)], 9, 32, 8, 128),
        ([(5059, [1, 2, 63, 64, 65, 129, 511, 1000, 2048])], 37, 32, 8, 128),
    ]
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for groups, pad, hq, hkv, d in layouts:
            seg = segments(groups, pad)
            t = seg.num_tokens
            g = torch.Generator(device="cuda").manual_seed(t)
            q, k, v = (torch.randn(t, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
            scale = 1 / math.sqrt(d)
            o_ref, l_ref = cuda_backend.forward(q, k, v, seg, scale, fwd_impl="sm90")
            for pp in ("1", "0"):  # with / without the ping-pong turns
                os.environ["MEGATRON_DUALKV_WS_PINGPONG"] = pp
                t0 = time.time()
                o_ws, l_ws = cuda_backend.forward(q, k, v, seg, scale, fwd_impl="ws")
                torch.cuda.synchronize()
                dt = time.time() - t0
                e_o = ((o_ws.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
                e_l = (l_ws - l_ref).abs().max().item()
                good = bool(torch.isfinite(o_ws).all()) and e_o < 1e-2 and e_l < 1e-3
                bad += not good
                print(f"ws smoke pingpong={pp} {dtype} T={t} hq={hq} hkv={hkv} d={d}: rel(out) vs sm90 {e_o:.2e}, "
                      f"max|dlse| {e_l:.2e}, first call {dt * 1e3:.0f} ms {'ok' if good else 'MISMATCH'}", flush=True)
            os.environ.pop("MEGATRON_DUALKV_WS_PINGPONG", None)
            do = torch.randn_like(q)
            grads = {}
            for impl in ("sm90", "ws"):
                qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
                t0 = time.time()
                cuda_backend.attention(qq, kk, vv, seg, scale, fwd_impl="sm90", bwd_impl=impl).backward(do)
                torch.cuda.synchronize()
                grads[impl] = (qq.grad, kk.grad, vv.grad, time.time() - t0)
            errs = [((a.float() - b.float()).norm() / b.float().norm()).item()
                    for a, b in zip(grads["ws"][:3], grads["sm90"][:3])]
            good = all(torch.isfinite(g).all() for g in grads["ws"][:3]) and max(errs) < 2e-2
            bad += not good
            print(f"ws smoke backward {dtype} T={t} hq={hq} hkv={hkv} d={d}: rel(dq, dk, dv) vs sm90 "
                  f"{errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e}, first call {grads['ws'][3] * 1e3:.0f} ms "
                  f"{'ok' if good else 'MISMATCH'}", flush=True)
    n, p, r = 28, 4096, 2048
    seg = segments([(p, [r] * n)])
    t = seg.num_tokens
    q, k, v = (torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8))
    fl = 4 * 128 * 32 * (p * (p + 1) // 2 + n * (r * p + r * (r + 1) // 2))
    for impl in ("sm90", "ws", "ws-no-pingpong"):
        os.environ["MEGATRON_DUALKV_WS_PINGPONG"] = "0" if impl == "ws-no-pingpong" else "1"
        impl_name, impl = impl, impl[:4] if impl != "ws-no-pingpong" else "ws"
        cuda_backend.forward(q, k, v, seg, 0.088, fwd_impl=impl)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            cuda_backend.forward(q, k, v, seg, 0.088, fwd_impl=impl)
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b) / 5
        print(f"ws smoke timing ({n}, {p}, {r}) fwd {impl_name}: {ms:.2f} ms, {fl / ms / 1e9:.0f} useful TFLOP/s", flush=True)
    os.environ.pop("MEGATRON_DUALKV_WS_PINGPONG")
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    do = torch.randn_like(q)
    for impl in ("sm90", "ws"):
        def fb():
            cuda_backend.attention(q, k, v, seg, 0.088, fwd_impl=impl, bwd_impl=impl).backward(do)
        fb()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(3):
            fb()
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b) / 3
        print(f"ws smoke timing ({n}, {p}, {r}) fwd+bwd {impl}: {ms:.2f} ms, {3.5 * fl / ms / 1e9:.0f} useful TFLOP/s",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
