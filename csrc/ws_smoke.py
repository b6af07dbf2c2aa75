"""First GPU check of the warp-specialized kernels (fwd_impl / bwd_impl "ws"), meant to run under
a short timeout before anything else touches them (tools/gpu_session_check.sh, csrc/gpu_check.sh):
a pipeline bug shows as a hang or a launch error here, not in the middle of the test suite.

    timeout 60 python csrc/ws_smoke.py [--part fwd|bwd|all]     (default all)

exit 0: every checked ws kernel agrees with the default sm90 kernels; 1: a mismatch; 2: the ws ops
are missing. --part fwd checks (and times) only the ws forward, --part bwd only the ws backward
(after the sm90 forward), so each gates its own tests: a failing backward does not exclude the
forward. For a few layouts (tiny, odd lengths, a long prompt) and both dtypes it compares out and
lse of the ws forward (with and without ping-pong), and dq, dk, dv of the ws backward, with the
default "sm90" kernels (fast mode) on the same inputs, then times one published shape. The
backward check is per gradient (each within 1e-2 of sm90's; dk and dv are expected bitwise equal,
same per-CTA accumulation order, and say so; dq comes from fp32 atomics in another order); a dq
mismatch prints the worst row and its segment.
"""
import math
import os
import sys
import time

import torch

from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import cuda_backend


LAYOUTS = [  # (groups, pad, hq, hkv, d); short prompt key tiles followed by responses in each
    ([(5, [3])], 0, 8, 2, 128),
    ([(100, [3, 70, 1]), (5, [9])], 3, 8, 2, 64),
    ([(1000, [1, 129, 700]), (3, [2] * 5)], 9, 32, 8, 128),
    ([(5059, [1, 2, 63, 64, 65, 129, 511, 1000, 2048])], 37, 32, 8, 128),
]
N, P, R = 28, 4096, 2048  # the timed shape


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def worst_row(x, ref, seg):
    """'row i (segment s, root|child of p, rows a..b): rel err e' for the row of x farthest from ref."""
    err = (x.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1).clamp_min(1e-30)
    i = int(err.argmax())
    for s, (a, n, p) in enumerate(zip(seg.host_start, seg.host_length, seg.host_parent)):
        if a <= i < a + n:
            kind = "root" if p < 0 else f"child of {p}"
            return f"row {i} (segment {s}, {kind}, rows {a}..{a + n - 1}): rel err {err[i].item():.2e}"
    return f"row {i}: rel err {err[i].item():.2e}"


def check_forward(q, k, v, seg, scale, label):
    bad = 0
    o_ref, l_ref = cuda_backend.forward(q, k, v, seg, scale, fwd_impl="sm90")
    for pp in ("1", "0"):  # with / without the ping-pong turns
        os.environ["MEGATRON_DUALKV_WS_PINGPONG"] = pp
        t0 = time.time()
        o_ws, l_ws = cuda_backend.forward(q, k, v, seg, scale, fwd_impl="ws")
        torch.cuda.synchronize()
        dt = time.time() - t0
        e_o = rel(o_ws, o_ref)
        e_l = (l_ws - l_ref).abs().max().item()
        good = bool(torch.isfinite(o_ws).all()) and e_o < 1e-2 and e_l < 1e-3
        bad += not good
        print(f"ws smoke pingpong={pp} {label}: rel(out) vs sm90 {e_o:.2e}, max|dlse| {e_l:.2e}, "
              f"first call {dt * 1e3:.0f} ms {'ok' if good else 'MISMATCH'}", flush=True)
    os.environ.pop("MEGATRON_DUALKV_WS_PINGPONG", None)
    return bad


def check_backward(q, k, v, seg, scale, label):
    do = torch.randn_like(q)
    grads = {}
    for impl in ("sm90", "ws"):  # both after the sm90 forward: only the backward differs
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        t0 = time.time()
        cuda_backend.attention(qq, kk, vv, seg, scale, fwd_impl="sm90", bwd_impl=impl).backward(do)
        torch.cuda.synchronize()
        grads[impl] = (qq.grad, kk.grad, vv.grad, time.time() - t0)
    ws, ref = grads["ws"][:3], grads["sm90"][:3]
    finite = [bool(torch.isfinite(g).all()) for g in ws]
    errs = [rel(a, b) for a, b in zip(ws, ref)]
    verdict = []
    for name, f, e in zip(("dq", "dk", "dv"), finite, errs):
        if not f or not e < 1e-2:
            verdict.append(f"{name} {'NON-FINITE' if not f else 'MISMATCH'}")
    bitwise = [name for name, a, b in zip(("dk", "dv"), ws[1:], ref[1:]) if torch.equal(a, b)]
    print(f"ws smoke backward {label}: rel(dq, dk, dv) vs sm90 {errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e} "
          f"(bitwise equal: {', '.join(bitwise) or 'none'}), first call {grads['ws'][3] * 1e3:.0f} ms "
          f"{'ok' if not verdict else ' '.join(verdict)}", flush=True)
    if not errs[0] < 1e-2:
        print(f"    dq worst {worst_row(ws[0], ref[0], seg)}", flush=True)
    return 1 if verdict else 0


def published(device="cuda"):
    seg = SegmentTable.from_group_lengths([(P, [R] * N)], device="cuda")
    fl = 4 * 128 * 32 * (P * (P + 1) // 2 + N * (R * P + R * (R + 1) // 2))
    q, k, v = (torch.randn(seg.num_tokens, h, 128, device=device, dtype=torch.bfloat16) for h in (32, 8, 8))
    return seg, fl, q, k, v


def time_forward():
    seg, fl, q, k, v = published()
    for impl in ("sm90", "ws", "ws-no-pingpong"):
        os.environ["MEGATRON_DUALKV_WS_PINGPONG"] = "0" if impl == "ws-no-pingpong" else "1"
        fi = "ws" if impl.startswith("ws") else impl
        cuda_backend.forward(q, k, v, seg, 0.088, fwd_impl=fi)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            cuda_backend.forward(q, k, v, seg, 0.088, fwd_impl=fi)
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b) / 5
        print(f"ws smoke timing ({N}, {P}, {R}) fwd {impl}: {ms:.2f} ms, {fl / ms / 1e9:.0f} useful TFLOP/s", flush=True)
    os.environ.pop("MEGATRON_DUALKV_WS_PINGPONG")


def time_backward():
    """fwd+bwd with the sm90 forward and each backward (the backward's own gain), and ws + ws."""
    seg, fl, q, k, v = published()
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    do = torch.randn_like(q)
    for fi, bi in (("sm90", "sm90"), ("sm90", "ws"), ("ws", "ws")):
        def fb():
            cuda_backend.attention(q, k, v, seg, 0.088, fwd_impl=fi, bwd_impl=bi).backward(do)
        fb()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(3):
            fb()
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b) / 3
        print(f"ws smoke timing ({N}, {P}, {R}) fwd+bwd {fi}+{bi}: {ms:.2f} ms, "
              f"{3.5 * fl / ms / 1e9:.0f} useful TFLOP/s", flush=True)


def main(argv):
    part = "all"
    if "--part" in argv:
        part = argv[argv.index("--part") + 1]
    if part not in ("fwd", "bwd", "all"):
        print(f"ws smoke: --part must be fwd, bwd or all, got {part!r}")
        return 2
    ok, why = cuda_backend.is_available()
    need = [op for p, op in (("fwd", "fwd_ws_sm90"), ("bwd", "bwd_ws_sm90")) if part in (p, "all")]
    missing = [op for op in need if not cuda_backend._has_op(op)] if ok else need
    if missing:
        print(f"ws smoke: unavailable ({why or 'op ' + ', '.join(missing) + ' missing'})")
        return 2
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for groups, pad, hq, hkv, d in LAYOUTS:
            seg = SegmentTable.from_group_lengths(groups, pad, "cuda")
            t = seg.num_tokens
            g = torch.Generator(device="cuda").manual_seed(t)
            q, k, v = (torch.randn(t, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
            scale = 1 / math.sqrt(d)
            label = f"{dtype} T={t} hq={hq} hkv={hkv} d={d}"
            if part in ("fwd", "all"):
                bad += check_forward(q, k, v, seg, scale, label)
            if part in ("bwd", "all"):
                bad += check_backward(q, k, v, seg, scale, label)
    if part in ("fwd", "all"):
        time_forward()
    if part in ("bwd", "all") and not bad:  # a wrong backward is not worth timing
        time_backward()
    print(f"ws smoke --part {part}: {'ok' if not bad else f'{bad} check(s) failed'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
