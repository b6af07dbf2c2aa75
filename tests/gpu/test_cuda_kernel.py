"""GPU tests of the fused DualKV CUDA kernels (megatron_dualkv.ops.cuda_backend).

Skipped without a CUDA GPU or without the built extension. Every case draws fresh random inputs
and compares forward (out, lse) and backward (dq, dk, dv) with an exact float64 computation; the
kernel's error must be no larger than the error of the replicated batch through torch SDPA (each
response as its own [prompt | response] causal sequence, prompt gradients summed over copies)
against the same float64 truth.
"""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_kernel  # noqa: E402  (tools/: the benchmark's layouts, which the rules were measured on)
from local_query_rows import cp_like_rows  # tests/ (the root conftest's directory) is on sys.path
from megatron_dualkv.layout import SegmentTable

cuda_backend = pytest.importorskip("megatron_dualkv.ops.cuda_backend")

_ok, _why = cuda_backend.is_available() if torch.cuda.is_available() else (False, "no CUDA device")
gpu = pytest.mark.skipif(not _ok, reason=f"DualKV CUDA backend unavailable: {_why}")

# slack on "no larger than the replicated SDPA error": 2% for the noise of one random draw
SLACK = 1.02


@pytest.fixture(autouse=True)
def _fused_fast_backward(monkeypatch):
    """Fast mode here runs the fused kernel it names (dQ summed by the dK/dV kernel) on every
    layout, not the deterministic kernels that fast mode picks for itself on some layouts
    (`fast_bwd_separate_dq`, tested below with the switch at auto)."""
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "fused")


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


def make_segments(groups, pad=0, device="cuda"):
    """groups: list of (P, [R_1, ..., R_N]); pad: a trailing padding root segment."""
    return SegmentTable.from_group_lengths(groups, pad, device)

def dense_mask(seg, lo, hi, device):
    """bool [L, L] for tokens [lo, hi) (one tree): the DualKV rule written out directly."""
    ids = torch.empty(hi - lo, dtype=torch.long)
    for s, (a, n) in enumerate(zip(seg.host_start, seg.host_length)):
        if a >= lo and a + n <= hi:
            ids[a - lo:a + n - lo] = s
    ids = ids.to(device)
    par = torch.tensor(seg.host_parent, device=device)[ids]
    idx = torch.arange(hi - lo, device=device)
    same = (ids[:, None] == ids[None, :]) & (idx[None, :] <= idx[:, None])
    return same | (par[:, None] == ids[None, :])


# ---------------------------------------------------------------------------------------------
# exact float64 truth, forward and backward (per head, per tree, dense)
# ---------------------------------------------------------------------------------------------


def exact(q, k, v, dout, seg, scale):
    t, hq, d = q.shape
    rep = hq // k.shape[1]
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, dout))
    out = torch.zeros_like(q64)
    lse = torch.zeros(hq, t, dtype=torch.float64, device=q.device)
    dq, dk, dv = torch.zeros_like(q64), torch.zeros_like(k64), torch.zeros_like(v64)
    for lo, hi in seg.tree_ranges():
        mask = dense_mask(seg, lo, hi, q.device)
        for h in range(hq):
            hk = h // rep
            qh, kh, vh, doh = q64[lo:hi, h], k64[lo:hi, hk], v64[lo:hi, hk], do64[lo:hi, h]
            s = (qh @ kh.T) * scale
            s = s.masked_fill(~mask, float("-inf"))
            m = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - m[:, None])
            o = p @ vh
            out[lo:hi, h] = o
            lse[h, lo:hi] = m
            dp = doh @ vh.T
            ds = p * (dp - (doh * o).sum(-1, keepdim=True))
            dq[lo:hi, h] = scale * ds @ kh
            dk[lo:hi, hk] += scale * ds.T @ qh
            dv[lo:hi, hk] += p.T @ doh
            del s, p, dp, ds
    return out, lse, dq, dk, dv


def replicated_sdpa(q, k, v, dout, seg, scale):
    """The stock path: each response as its own [prompt | response] causal sequence through SDPA
    (in the input dtype); returns out, dq, dk, dv mapped back to packed rows (prompt gradients
    summed over copies, prompt outputs taken from the first copy)."""
    out = torch.zeros_like(q, dtype=torch.float32)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    children = {}
    for s, p in enumerate(seg.host_parent):
        if p >= 0:
            children.setdefault(p, []).append(s)
    seqs = []
    for s, p in enumerate(seg.host_parent):
        a, n = seg.host_start[s], seg.host_length[s]
        if p >= 0:
            pa, pn = seg.host_start[p], seg.host_length[p]
            seqs.append((torch.cat([torch.arange(pa, pa + pn), torch.arange(a, a + n)]), pn, children[p][0] == s))
        elif s not in children:
            seqs.append((torch.arange(a, a + n), 0, True))  # root without children (padding)
    for rows, pn, first in seqs:
        rows = rows.to(q.device)
        rep = q.shape[1] // k.shape[1]
        qs = q[rows].transpose(0, 1)[None].detach().requires_grad_(True)
        ks = k[rows].transpose(0, 1)[None].detach().requires_grad_(True)
        vs = v[rows].transpose(0, 1)[None].detach().requires_grad_(True)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1), is_causal=True, scale=scale)
        g = dout[rows].clone()
        if not first:
            g[:pn] = 0  # the prompt's output gradient is applied once (to the first copy)
        o.backward(g.transpose(0, 1)[None])
        o = o[0].transpose(0, 1).float()
        sel = rows if first else rows[pn:]
        out[sel] = o if first else o[pn:]
        gq = qs.grad[0].transpose(0, 1).float()
        dq[sel] = gq if first else gq[pn:]
        dk.index_add_(0, rows, ks.grad[0].transpose(0, 1).float())
        dv.index_add_(0, rows, vs.grad[0].transpose(0, 1).float())
    return out, dq, dk, dv


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def inputs(t, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(t, h, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def poison_allocator(nbytes):
    """Fill a freed block of the caching allocator with NaN so that outputs carved from it show
    any element the kernels leave unwritten."""
    x = torch.full((nbytes // 4,), float("nan"), device="cuda", dtype=torch.float32)
    del x


def run_kernel(q, k, v, dout, seg, scale, deterministic=False, impl=None, bwd_impl=None, rows=None):
    """(out, lse, dq, dk, dv); rows: local queries, q[rows] and dout[rows] against all of k, v."""
    poison_allocator(8 * (q.numel() + 2 * k.numel()) * q.element_size() + (64 << 20))
    if rows is not None:
        q, dout = q[rows], dout[rows]
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    # impl names the forward (and the backward unless bwd_impl is given)
    bwd = bwd_impl or (impl if impl in cuda_backend.BWD_IMPLS else ("sm90" if impl else None))
    out, lse = cuda_backend.forward(qq, kk, vv, seg, scale, deterministic=deterministic, fwd_impl=impl,
                                    bwd_impl=bwd, q_rows=rows)
    out.backward(dout)
    torch.cuda.synchronize()
    return out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad


_rr = random.Random(1)
CASES = [
    # (groups, pad, hq, hkv, d, dtype)
    ([(5059, [1, 2, 63, 64, 65, 129, 511, 1000, 2048]), (333, [_rr.randint(1, 200) for _ in range(64)]),
      (1, [5]), (77, [1])], 37, 32, 8, 128, torch.bfloat16),
    ([(1999, [1, 700, 64, 2048]), (130, [17] * 16)], 0, 32, 4, 128, torch.float16),
    ([(5059, [1, 33, 2048]), (64, [64, 64])], 11, 32, 8, 64, torch.float16),
    ([(777, [3, 1500]), (2, [1] * 40)], 0, 32, 4, 64, torch.bfloat16),
    # many responses behind a short prompt: the ws backward's deterministic lists split the prompt's
    # key tiles by query rows (so do cases 1 and 3, a 2048- and a 1500-row response cut in parts;
    # cases 0 and 2 split nothing); fast mode's take head parts for balance there instead (and on 2)
    ([(130, [200] * 48)], 0, 32, 8, 128, torch.bfloat16),
]


# forward + backward kernel pairs. The warp-specialized ids carry "wsfwd" / "wsbwd" so that each
# ws kernel can be selected or left out on its own (tools/gpu_session_check.sh: -k "not wsbwd" when
# only the ws forward passed its smoke check, ...)
IMPLS = {
    "sm90": ("sm90", "sm90"),            # fast mode: dQ by fp32 atomics in the dK/dV kernel
    "mma": ("mma", "mma"),
    "sm90-dq-kernel": ("sm90", "sm90"),  # the dQ kernel (the deterministic path) in fast mode
    "wsfwd": ("ws", "sm90"),
    "wsfwd-no-pingpong": ("ws", "sm90"),  # consumers issuing without turns
    "wsfwd-176": ("ws", "sm90"),          # 176-key tiles at head dim 128 (MEGATRON_DUALKV_WS_FWD_TILE=176)
    "wsfwd-176-full-tail": ("ws", "sm90"),  # the same, the parent's last tile in key order at full width
    "wsfwd-persistent": ("ws", "sm90"),   # one CTA per SM taking query tiles in turn (MEGATRON_DUALKV_WS_FWD_PERSISTENT=1)
    "wsbwd": ("sm90", "ws"),
    "wsbwd-no-turns": ("sm90", "ws"),     # consumers issuing without turns
    "wsbwd-atomic-dq": ("sm90", "ws"),    # dQ by float2 atomics instead of the TMA reduce-add
    "wsbwd-qtile-64": ("sm90", "ws"),     # 64-row query steps at head dim 128 too (default there: 80)
    "wsbwd-no-split": ("sm90", "ws"),     # no key tile split by query rows (MEGATRON_DUALKV_WS_SPLIT=0)
    "wsbwd-no-phase": ("sm90", "ws"),     # every walk from its first step, own rows first (MEGATRON_DUALKV_WS_PHASE=0)
    "wsbwd-deterministic": ("sm90", "ws"),  # deterministic=True: dK/dV without dQ in list order, the ws dQ kernel
    "wsfwd-wsbwd": ("ws", "ws"),
}


@gpu
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_against_float64_and_replicated_sdpa(case, impl, monkeypatch):
    if impl == "sm90-dq-kernel":
        monkeypatch.setenv("MEGATRON_DUALKV_ATOMIC_DQ", "0")
    if impl == "wsfwd-no-pingpong":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_PINGPONG", "0")
    if impl.startswith("wsfwd-176"):
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", "176")
    if impl == "wsfwd-176-full-tail":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL", "full")
    if impl == "wsfwd-persistent":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", "1")
    if impl == "wsbwd-no-turns":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_BWD_TURNS", "0")
    if impl == "wsbwd-atomic-dq":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_DQ", "atomic")
    if impl == "wsbwd-qtile-64":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_BWD_QTILE", "64")
    if impl == "wsbwd-no-split":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    if impl == "wsbwd-no-phase":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_PHASE", "0")
    fwd, bwd = IMPLS[impl]
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    t = seg.num_tokens
    scale = 1.0 / math.sqrt(d)
    q, k, v, dout = inputs(t, hq, hkv, d, dtype, seed=1234 + case + random.randrange(1 << 20))
    out, lse, dq, dk, dv = run_kernel(q, k, v, dout, seg, scale, deterministic=impl == "wsbwd-deterministic",
                                      impl=fwd, bwd_impl=bwd)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"{name}: non-finite elements (unwritten or overflow)"
    ex_out, ex_lse, ex_dq, ex_dk, ex_dv = exact(q, k, v, dout, seg, scale)
    r_out, r_dq, r_dk, r_dv = replicated_sdpa(q, k, v, dout, seg, scale)
    lines = []
    for name, mine, rep, truth in (("out", out, r_out, ex_out), ("dq", dq, r_dq, ex_dq), ("dk", dk, r_dk, ex_dk),
                                   ("dv", dv, r_dv, ex_dv)):
        e_k, e_r = rel(mine, truth), rel(rep, truth)
        lines.append(f"{name}: kernel {e_k:.3e} replicated-SDPA {e_r:.3e}")
        assert e_k <= e_r * SLACK + 1e-7, (
            f"{impl} (forward {fwd}, backward {bwd}) {name}: kernel error {e_k:.3e} exceeds replicated SDPA error {e_r:.3e}")
    lse_err = (lse.double() - ex_lse).abs().max().item()
    lines.append(f"lse max abs err {lse_err:.3e}")
    print(f"case {case} {impl} T={t}: " + "; ".join(lines))
    assert lse_err < 1e-2


@gpu
def test_matches_lead_reference_small():
    reference = pytest.importorskip("megatron_dualkv.ops.reference")
    seg = make_segments([(100, [3, 70, 1]), (5, [9])], pad=3)
    q, k, v, _ = inputs(seg.num_tokens, 8, 2, 64, torch.bfloat16, seed=random.randrange(1 << 20))
    out, lse = cuda_backend.forward(q, k, v, seg, 0.125)
    ref_out, ref_lse = reference.reference_attention(q.double(), k.double(), v.double(), seg, 0.125)
    assert rel(out, ref_out) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


@gpu
@pytest.mark.parametrize("variant", ["0", "1", "wsfwd"])
@pytest.mark.parametrize("d", [128, 64])
def test_forward_kernels_agree(variant, d, monkeypatch):
    """The wgmma forwards (both tile variants, and the warp-specialized "ws") and the mma.sync
    forward compute the same function."""
    if variant != "wsfwd":
        monkeypatch.setenv("MEGATRON_DUALKV_SM90_FWD_VARIANT", variant)
    seg = make_segments([(1000, [1, 129, 700]), (3, [2] * 5)], pad=9)
    q, k, v, _ = inputs(seg.num_tokens, 32, 8, d, torch.bfloat16, seed=random.randrange(1 << 20))
    a_out, a_lse = cuda_backend.forward(q, k, v, seg, 0.08, fwd_impl="ws" if variant == "wsfwd" else "sm90")
    b_out, b_lse = cuda_backend.forward(q, k, v, seg, 0.08, fwd_impl="mma")
    ex_out, ex_lse = exact(q, k, v, q, seg, 0.08)[:2]
    assert rel(a_out, ex_out) <= rel(b_out, ex_out) * 1.05
    assert (a_lse - b_lse).abs().max().item() < 1e-3


@gpu
@pytest.mark.parametrize("impl", ["sm90", "mma", "wsfwd-wsbwd"])  # the ws forward and backward
def test_deterministic_bitwise(impl):
    seg = make_segments([(3001, [5, 900, 2048, 1]), (100, [50] * 8)], pad=5)
    q, k, v, dout = inputs(seg.num_tokens, 32, 8, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    impl = "ws" if impl == "wsfwd-wsbwd" else impl
    a = run_kernel(q, k, v, dout, seg, 0.088, deterministic=True, impl=impl)
    b = run_kernel(q, k, v, dout, seg, 0.088, deterministic=True, impl=impl)
    for x, y, name in zip(a, b, ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs"


def deterministic_runs(case, seed, settings, monkeypatch, bwd_impl="ws"):
    """CASES[case] on fresh inputs through the ws forward and a deterministic backward, as the
    environment is and then once more after each of `settings` (dicts of variables set in
    turn): each run's (out, lse, dq, dk, dv)."""
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=seed + case + random.randrange(1 << 20))
    runs = []
    for env in [{}, *settings]:
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        runs.append(run_kernel(q, k, v, dout, seg, 1.0 / math.sqrt(d), deterministic=True, impl="ws", bwd_impl=bwd_impl))
    return runs


GRADS = {"dq": 2, "dk": 3, "dv": 4}  # run_kernel's outputs


def assert_same_bits(runs, names, what):
    """Every run's gradients `names` (of dq, dk, dv) bitwise the first run's, and finite."""
    for name in names:
        i = GRADS[name]
        assert torch.isfinite(runs[0][i]).all(), f"{name}: non-finite elements (unwritten?)"
        for other in runs[1:]:
            assert torch.equal(runs[0][i], other[i]), f"{name} differs {what}: rel {rel(runs[0][i], other[i]):.3e}"


def assert_close_no_worse(got, ref, ex, names, against, finite=False):
    """Gradients `names` of run `got` within bf16 rounding of run `ref`'s (rel < 1e-2) and no further
    from the float64 gradients `ex` than ref's (SLACK); finite: and every element finite."""
    for name in names:
        i = GRADS[name]
        if finite:
            assert torch.isfinite(got[i]).all(), f"{name}: non-finite elements (unwritten?)"
        assert rel(got[i], ref[i]) < 1e-2, f"{name}: rel {rel(got[i], ref[i]):.3e} {against}"
        assert rel(got[i], ex[i]) <= rel(ref[i], ex[i]) * SLACK + 1e-7, f"{name} error vs float64"


def ws_runs_default_and_with(var, value, q, k, v, dout, seg, scale, deterministic, monkeypatch):
    """(default run, run with `var`=`value`) of the ws forward and backward on the same inputs; a
    deterministic default run is first checked bitwise equal to a second one."""
    base = run_kernel(q, k, v, dout, seg, scale, deterministic=deterministic, impl="ws", bwd_impl="ws")
    if deterministic:
        again = run_kernel(q, k, v, dout, seg, scale, deterministic=True, impl="ws", bwd_impl="ws")
        assert_same_bits([base, again], ["dq", "dk", "dv"], "between two deterministic runs")
    monkeypatch.setenv(var, value)
    return base, run_kernel(q, k, v, dout, seg, scale, deterministic=deterministic, impl="ws", bwd_impl="ws")


@gpu
@pytest.mark.parametrize("case", [0, 2])
def test_dq_kernel_key_tiles_give_the_same_bits(case, monkeypatch):
    """The deterministic dQ kernel in 128-key steps (default) and in 64-key steps
    (MEGATRON_DUALKV_DQ_KTILE=64) add the same k16 slices in the same key order: bitwise equal dq
    (d = 128 bf16 and d = 64 fp16, partial parent tiles and causal diagonals)."""
    runs = deterministic_runs(case, 99, [{"MEGATRON_DUALKV_DQ_KTILE": "64"}], monkeypatch, bwd_impl="sm90")
    assert_same_bits(runs, ["dq"], "between 128- and 64-key steps")


@gpu
@pytest.mark.parametrize("case", [0, 1, 2])
def test_wsbwd_dq_kernels_give_the_same_bits(case, monkeypatch):
    """The deterministic ws backward's dQ by the warp-specialized dQ kernel (default, 64-key tiles)
    and by the sm90 one (MEGATRON_DUALKV_DQ_KERNEL=sm90, 128-key steps): the same k16 slices in
    the same key order (the ws kernel's ragged prompt tile in its place: MEGATRON_DUALKV_DQ_NARROW=0),
    so bitwise equal dq; dk, dv come from the same dK/dV kernel."""
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_NARROW", "0")
    runs = deterministic_runs(case, 77, [{"MEGATRON_DUALKV_DQ_KERNEL": "sm90"}], monkeypatch)
    assert_same_bits(runs, ["dq", "dk", "dv"], "between the ws and the sm90 dQ kernels")


@gpu
@pytest.mark.parametrize("case", range(len(CASES)))
def test_wsbwd_dq_kernel_skips_masked_work(case, monkeypatch):
    """The ws dQ kernel's consumer 0 stops one 64-key tile early where every key of a query tile's
    last tile lies past its 64 rows (causal diagonals); with MEGATRON_DUALKV_DQ_SKIP=0 it walks that
    tile (adding zero products). Its consumer 1 issues nothing for a query tile of 64 rows or fewer
    (rows it would not store); with MEGATRON_DUALKV_DQ_IDLE=0 it walks the tile. Bitwise equal dq
    every way. Every case has query tiles of more than 64 rows at a diagonal and of 64 or fewer."""
    runs = deterministic_runs(case, 13, [{"MEGATRON_DUALKV_DQ_SKIP": "0"}, {"MEGATRON_DUALKV_DQ_IDLE": "0"}],
                              monkeypatch)
    assert_same_bits(runs, ["dq", "dk", "dv"], "with the masked work walked")


@gpu
@pytest.mark.parametrize("case", range(len(CASES)))
def test_wsbwd_deterministic_diagonal_steps_last(case, monkeypatch):
    """The deterministic dK/dV kernel walks a key tile's diagonal steps (rows k0 .. k0 + 63, every
    score masked for its second consumer's keys) after every head's other steps, reversed (split)
    walks and walks in list order alike, and that consumer stops before them. Against
    MEGATRON_DUALKV_DET_SKIP=0 (the plain walk): only the order of dK/dV's sums differs, so dk, dv
    within fp32-sum rounding and no worse against float64, dq bitwise (the dQ kernel's), two runs
    bitwise equal. Cases 1, 3, 4 split (reversed walks), 0 and 2 do not."""
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=7 + case + random.randrange(1 << 20))
    scale = 1.0 / math.sqrt(d)
    last, plain = ws_runs_default_and_with("MEGATRON_DUALKV_DET_SKIP", "0", q, k, v, dout, seg, scale, True,
                                           monkeypatch)
    assert torch.equal(last[2], plain[2]), "dq changed with the dK/dV walk's order"
    assert_close_no_worse(last, plain, exact(q, k, v, dout, seg, scale), ["dk", "dv"], "vs the plain walk")


# prompts of 217 and 25 rows leave 25 keys in their last 64-key tile (narrowed to 32), 100 leaves 36 (not)
RAGGED_32 = [([(217, [40, 300, 5]), (100, [70, 2]), (25, [129])], 3, 32, 8, 128, torch.bfloat16),
             ([(217, [64, 200])], 0, 32, 4, 64, torch.float16)]


@gpu
@pytest.mark.parametrize("layout", CASES + RAGGED_32)
def test_wsbwd_dq_kernel_ragged_prompt_tile_first(layout, monkeypatch):
    """The ws dQ kernel walks a ragged prompt's last 64-key tile (P mod 64 of the prompt's keys in
    it) first, its S and dP at 16 or 32 keys where they cover them. Against
    MEGATRON_DUALKV_DQ_NARROW=0 (in key order at full width): only dq's sum order differs, so dq
    within bf16 rounding and no worse against float64, dk and dv bitwise, two runs bitwise equal.
    CASES' prompts (5059, 1999, 777, 333, 130, 77, 2 rows) leave 2-15 keys there (16 wide);
    RAGGED_32's 217 and 25 leave 25 (32 wide), and 64 and 100 rows are walked as before."""
    groups, pad, hq, hkv, d, dtype = layout
    seg = make_segments(groups, pad)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=17 + random.randrange(1 << 20))
    scale = 1.0 / math.sqrt(d)
    first, in_order = ws_runs_default_and_with("MEGATRON_DUALKV_DQ_NARROW", "0", q, k, v, dout, seg, scale, True,
                                               monkeypatch)
    assert_same_bits([first, in_order], ["dk", "dv"], "with the dQ kernel's walk order")
    assert_close_no_worse(first, in_order, exact(q, k, v, dout, seg, scale), ["dq"], "vs the walk in key order",
                          finite=True)


@gpu
def test_wsbwd_dq_side_stream(monkeypatch):
    """The deterministic mode's dQ kernel on a second stream beside the dK/dV kernel
    (MEGATRON_DUALKV_DQ_STREAM=1) or after it on one stream (MEGATRON_DUALKV_DQ_STREAM=0), and the
    default where key tiles split, as in case 4 (a programmatic dependent launch): bitwise the same
    gradients (nothing of one kernel is read by the other)."""
    runs = deterministic_runs(4, 31, [{"MEGATRON_DUALKV_DQ_STREAM": "1"}, {"MEGATRON_DUALKV_DQ_STREAM": "0"}],
                              monkeypatch)
    assert_same_bits(runs, ["dq", "dk", "dv"], "with the dQ kernel's stream")


@gpu
@pytest.mark.parametrize("case", [0, 2])
def test_wsbwd_deterministic_overlap(case, monkeypatch):
    """The deterministic dK/dV kernel with the intra-warpgroup overlap (default; 64-row steps) and
    without it (MEGATRON_DUALKV_DET_OVERLAP=0; 80-row steps at head dim 128) add the same 16-row
    MMA slices in the same order (the overlapped walk's diagonal steps in their place:
    MEGATRON_DUALKV_DET_SKIP=0): bitwise equal dk, dv (and dq)."""
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    monkeypatch.setenv("MEGATRON_DUALKV_DET_SKIP", "0")
    runs = deterministic_runs(case, 57, [{"MEGATRON_DUALKV_DET_OVERLAP": "0"}], monkeypatch)
    assert_same_bits(runs, ["dq", "dk", "dv"], "with the overlap")


@gpu
@pytest.mark.parametrize("var, bad", [("MEGATRON_DUALKV_DQ_KERNEL", "fast"), ("MEGATRON_DUALKV_DQ_STREAM", "yes"),
                                      ("MEGATRON_DUALKV_DET_OVERLAP", "on"), ("MEGATRON_DUALKV_DQ_SKIP", "yes"),
                                      ("MEGATRON_DUALKV_DET_SKIP", "no"), ("MEGATRON_DUALKV_DQ_IDLE", "2"),
                                      ("MEGATRON_DUALKV_DQ_NARROW", "on")])
def test_wsbwd_deterministic_names_a_bad_switch(var, bad, monkeypatch):
    """A deterministic ws backward switch set to a value it does not take is an error naming the
    variable (MEGATRON_DUALKV_DQ_KERNEL: ws or sm90; DQ_STREAM: auto, 0, 1 or pdl; DET_OVERLAP,
    DQ_SKIP, DET_SKIP, DQ_IDLE and DQ_NARROW: 0 or 1)."""
    seg = make_segments([(100, [30, 7])])
    q, k, v, dout = inputs(seg.num_tokens, 4, 2, 128, torch.bfloat16, seed=6)
    monkeypatch.setenv(var, bad)
    with pytest.raises(RuntimeError, match=f"{var} must be"):
        run_kernel(q, k, v, dout, seg, 0.1, deterministic=True, impl="ws", bwd_impl="ws")


@gpu
@pytest.mark.parametrize("case", range(len(CASES)))
def test_deterministic_wsbwd_equals_sm90(case, monkeypatch):
    """The ws backward's deterministic mode (dK/dV by the ws kernel in list order, without dQ; dQ
    by the ws dQ kernel) gives bitwise the sm90 deterministic backward's dq, dk, dv after the
    same forward where no key tile is split (MEGATRON_DUALKV_WS_SPLIT=0) and the diagonal steps
    keep their place (MEGATRON_DUALKV_DET_SKIP=0), as does a ragged prompt's tile in the dQ kernel
    (MEGATRON_DUALKV_DQ_NARROW=0): every key tile's dK/dV and every query tile's dQ add the same
    16-row MMA slices in the same order."""
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    monkeypatch.setenv("MEGATRON_DUALKV_DET_SKIP", "0")
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_NARROW", "0")
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=4321 + case + random.randrange(1 << 20))
    ws = run_kernel(q, k, v, dout, seg, 1.0 / math.sqrt(d), deterministic=True, impl="ws", bwd_impl="ws")
    ref = run_kernel(q, k, v, dout, seg, 1.0 / math.sqrt(d), deterministic=True, impl="ws", bwd_impl="sm90")
    for name, i in (("dq", 2), ("dk", 3), ("dv", 4)):
        assert torch.isfinite(ws[i]).all(), f"{name}: non-finite elements (unwritten?)"
        assert torch.equal(ws[i], ref[i]), f"{name} differs from the sm90 deterministic backward: rel {rel(ws[i], ref[i]):.3e}"


@gpu
@pytest.mark.parametrize("case", [1, 3, 4])  # the layouts whose key tiles split (CASES)
def test_wsbwd_deterministic_split(case, monkeypatch):
    """Deterministic mode splits the key tiles fast mode splits; each part stores its dK/dV in a
    workspace slot of its own (not zeroed: poisoned memory shows a slot left unwritten) and the
    last part sums the slots in part order. Two runs bitwise equal (the parts finish in varying
    order); dq bitwise the unsplit deterministic backward's (the split is dK/dV's only); dk, dv
    within fp32-sum rounding of it and no worse against float64."""
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=2024 + case + random.randrange(1 << 20))
    scale = 1.0 / math.sqrt(d)
    work = cuda_backend.work_tensors(seg, q.device, None, cuda_backend.ws_split(q, k, per_part=True))
    assert work.ws_slots[0] > 0, "the layout splits no key tile"
    asked = []  # the split arguments forward() builds its lists with
    real_ws_split = cuda_backend.ws_split
    monkeypatch.setattr(cuda_backend, "ws_split", lambda *a_, **kw: asked.append(kw) or real_ws_split(*a_, **kw))
    a = run_kernel(q, k, v, dout, seg, scale, deterministic=True, impl="ws", bwd_impl="ws")
    assert asked and all(kw.get("per_part") for kw in asked), f"deterministic forward() asked for {asked}"
    b = run_kernel(q, k, v, dout, seg, scale, deterministic=True, impl="ws", bwd_impl="ws")
    assert_same_bits([a, b], ["dq", "dk", "dv"], "between two deterministic runs")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    whole = run_kernel(q, k, v, dout, seg, scale, deterministic=True, impl="ws", bwd_impl="ws")
    assert torch.equal(a[2], whole[2]), "dq changed with the split"
    assert_close_no_worse(a, whole, exact(q, k, v, dout, seg, scale), ["dk", "dv"], "vs unsplit")


@gpu
@pytest.mark.parametrize("walk", ["plain", "phase", "split"])
@pytest.mark.parametrize("d", [128, 64])
def test_wsbwd_dq_matches_sm90(d, walk, monkeypatch):
    """The ws backward against the sm90 fast backward on the same forward, gradient by gradient:
    with neither splits nor phase-aligned walks dk, dv bitwise (same per-CTA accumulation order);
    with the phase-aligned walks (the prompt's children first, from a step other CTAs publish) or
    this small grid's key tiles split by query rows (their dK/dV summed in fp32 in another order)
    within bf16 rounding and no worse than sm90's against float64; dq within bf16 rounding (fp32
    atomics in another order), against float64 no worse than sm90's. The layout has short key
    tiles of a prompt followed by its responses (the ws kernel's TMA box then holds the responses'
    keys: the case its first GPU run got wrong in dq only)."""
    split = walk == "split"
    if not split:
        monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    else:  # the split by query rows, which head parts for balance would replace on this layout
        monkeypatch.setenv("MEGATRON_DUALKV_WS_BALANCE", "unsplit")
    if walk == "plain":
        monkeypatch.setenv("MEGATRON_DUALKV_WS_PHASE", "0")
    seg = make_segments([(5, [3]), (100, [3, 70, 1]), (130, [200] * 6)], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, d, torch.bfloat16, seed=random.randrange(1 << 20))
    slots = cuda_backend.work_tensors(seg, q.device, None, cuda_backend.ws_split(q, k)).ws_slots[0] if split else 0
    assert (slots > 0) == split, f"{slots} key tiles split"
    ref = run_kernel(q, k, v, dout, seg, 0.1, impl="sm90", bwd_impl="sm90")
    ws = run_kernel(q, k, v, dout, seg, 0.1, impl="sm90", bwd_impl="ws")
    ex = exact(q, k, v, dout, seg, 0.1)
    if walk != "plain":
        assert_close_no_worse(ws, ref, ex, ["dk", "dv"], "vs sm90")
    else:
        assert torch.equal(ws[3], ref[3]), f"dk differs from sm90's: rel {rel(ws[3], ref[3]):.3e}"
        assert torch.equal(ws[4], ref[4]), f"dv differs from sm90's: rel {rel(ws[4], ref[4]):.3e}"
    assert torch.isfinite(ws[2]).all(), "dq: non-finite elements"
    ex_dq = ex[2]
    e_ws, e_ref = rel(ws[2], ex_dq), rel(ref[2], ex_dq)
    bad_rows = ((ws[2].float() - ref[2].float()).flatten(1).norm(dim=1) >
                1e-2 * ref[2].float().flatten(1).norm(dim=1) + 1e-3).nonzero().flatten().tolist()
    assert rel(ws[2], ref[2]) < 1e-2 and not bad_rows, (
        f"dq: rel {rel(ws[2], ref[2]):.3e} vs sm90, rows off: {bad_rows[:20]} ({len(bad_rows)} in all)")
    assert e_ws <= e_ref * SLACK + 1e-7, f"dq error vs float64 {e_ws:.3e} exceeds sm90's {e_ref:.3e}"


@pytest.mark.parametrize("groups, separate", [
    ([(128, [512] * 16)], True),                    # 447 keys per query tile: (128, 128, 512)'s kind
    ([(512, [1024] * 8), (300, [700, 1300])], True),
    ([(1024, [1024] * 32)], False),                 # 1,569: (32, 1024, 1024), where the fused kernel is faster
    ([(128, [256] * 8)], False),                    # 320: short query tiles, the dQ kernel's start-up
])
def test_fast_mode_picks_its_backward(groups, separate, monkeypatch):
    """Fast mode takes the deterministic kernels at head dim 64, and at head dim 128 where the
    layout's query tiles attend SEPARATE_DQ_KEYS keys on average; MEGATRON_DUALKV_FAST_BWD forces
    either and names itself when set to anything else."""
    seg = make_segments(groups, device="cpu")
    lo, hi = cuda_backend.SEPARATE_DQ_KEYS
    keys = cuda_backend.mean_keys_per_query_tile(seg)
    assert (lo <= keys <= hi) == separate, keys
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "auto")
    assert cuda_backend.fast_bwd_separate_dq(seg, 128) == separate
    assert cuda_backend.fast_bwd_separate_dq(seg, 64)
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "separate")
    assert cuda_backend.fast_bwd_separate_dq(seg, 128)
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "fused")
    assert not cuda_backend.fast_bwd_separate_dq(seg, 128) and not cuda_backend.fast_bwd_separate_dq(seg, 64)
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "fast")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_FAST_BWD must be"):
        cuda_backend.fast_bwd_separate_dq(seg, 128)


@gpu
@pytest.mark.parametrize("d", [128, 64])
def test_fast_mode_on_the_separate_dq_layouts_is_the_deterministic_backward(d, monkeypatch):
    """Where fast mode picks the deterministic kernels (switch at auto), its gradients are
    bitwise those of deterministic=True, and within rounding of the fused kernel's (forced)."""
    seg = make_segments([(128, [512] * 6), (100, [300, 700])])
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, d, torch.bfloat16, seed=random.randrange(1 << 20))
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "auto")
    assert cuda_backend.fast_bwd_separate_dq(seg, d)
    fast = run_kernel(q, k, v, dout, seg, 0.1, deterministic=False, impl="ws", bwd_impl="ws")
    det = run_kernel(q, k, v, dout, seg, 0.1, deterministic=True, impl="ws", bwd_impl="ws")
    for name, i in (("out", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
        assert torch.equal(fast[i], det[i]), f"{name}: fast mode on this layout is not the deterministic backward"
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "fused")
    fused = run_kernel(q, k, v, dout, seg, 0.1, deterministic=False, impl="ws", bwd_impl="ws")
    assert_close_no_worse(fast, fused, exact(q, k, v, dout, seg, 0.1), ["dq", "dk", "dv"], "against the fused kernel")


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_wsbwd_long_band_order(deterministic, monkeypatch):
    """Long responses put their key tiles in the first band, which is grouped by segment (the
    default) or heaviest first across segments (MEGATRON_DUALKV_WS_LONG_BAND=work): only the
    order of the CTAs changes, so dk and dv are bitwise the same (each key tile's sums are one
    CTA's: no splits, and in fast mode no phase-aligned walks, whose start varies), deterministic
    dq too, and fast dq within fp32-sum rounding and no worse against float64."""
    seg = make_segments([(64, [1300, 300, 900]), (40, [600])])
    items = {v: cuda_backend.ws_kv_work(seg, long_band_by_segment=v)[0] for v in (False, True)}
    n_long = items[True][0][5]
    assert items[True][:n_long] != items[False][:n_long], "the layout's first band does not span segments"
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    # this small grid would split the prompt's key tiles (a split list is one band, its parts'
    # dK/dV summed by atomics in fast mode), and fast mode's phase-aligned walks start where other
    # CTAs are: both off, so that the two runs differ in the band order only
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_PHASE", "0")
    assert cuda_backend.ws_split(q, k, per_part=deterministic) is None
    monkeypatch.setenv("MEGATRON_DUALKV_WS_LONG_BAND", "work")
    work = run_kernel(q, k, v, dout, seg, 0.1, deterministic=deterministic, impl="ws", bwd_impl="ws")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_LONG_BAND", "segment")
    grouped = run_kernel(q, k, v, dout, seg, 0.1, deterministic=deterministic, impl="ws", bwd_impl="ws")
    for name, i in (("out", 0), ("dk", 3), ("dv", 4)) + ((("dq", 2),) if deterministic else ()):
        assert torch.equal(grouped[i], work[i]), f"{name} differs between the band orders"
    if not deterministic:
        assert_close_no_worse(grouped, work, exact(q, k, v, dout, seg, 0.1), ["dq"], "between the orders")



@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [128, 64])
def test_wsbwd_prompt_tails_merged(d, deterministic, monkeypatch):
    """Prompts of P % 128 = 6, 5, 104 and 2 tail keys: each response's first key tile holds its
    prompt's tail keys (loaded over the TMA box's first rows, which held the previous segment's) and
    adds their dK/dV into the tail's slot, whose last part stores them (deterministic: a slot per
    part, summed in part order). Against the tails kept as tiles of their own
    (MEGATRON_DUALKV_WS_TAIL=tile): dq, dk, dv within bf16 rounding and no worse against float64,
    every element written (poisoned buffers); deterministic mode bitwise reproducible, its dq (the
    dQ kernel's) bitwise unchanged."""
    seg = make_segments([(262, [300] * 12), (5, [3, 9]), (1000, [1, 129, 64]), (130, [17] * 40)], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, d, torch.bfloat16, seed=random.randrange(1 << 20))
    # fast mode takes the deterministic kernels (a slot per part) on short layouts and at head dim 64
    per_part = deterministic or cuda_backend.fast_bwd_separate_dq(seg, d)
    work = cuda_backend.work_tensors(seg, q.device, None, cuda_backend.ws_split(q, k, per_part=per_part))
    # per_part: each part's t rows, 128 // t parts to a slot: tails of 6, 5, 104 and 2 keys
    assert work.ws_slots[1] == (1 + 1 + 4 + 1 if per_part else 4), work.ws_slots
    merged, tiles = ws_runs_default_and_with("MEGATRON_DUALKV_WS_TAIL", "tile", q, k, v, dout, seg, 0.1,
                                             deterministic, monkeypatch)
    assert_close_no_worse(merged, tiles, exact(q, k, v, dout, seg, 0.1), ["dq", "dk", "dv"], "vs the tail tiles",
                          finite=True)
    if per_part:
        assert torch.equal(merged[2], tiles[2]), "dq (the dQ kernel's) changed with the merged tails"

@gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_wsbwd_split_list_walks_reversed(deterministic, monkeypatch):
    """A split list's walks take each head's query tiles last first (the default) or in list order
    (MEGATRON_DUALKV_WS_REVERSE_ROWS=0); only the order of the sums differs: same inputs, dk, dv
    within fp32-sum rounding of each other and dq within bf16 rounding, all no worse against
    float64; deterministic mode bitwise reproducible reversed. The parts hold several short
    responses (a part's ranges searched from its last one down) and a 2048-row response is cut."""
    seg = make_segments([(1999, [1, 700, 64, 2048]), (130, [17] * 16)], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    monkeypatch.setenv("MEGATRON_DUALKV_WS_BALANCE", "unsplit")  # fast mode would take head parts here
    work = cuda_backend.work_tensors(seg, q.device, None, cuda_backend.ws_split(q, k, per_part=deterministic))
    assert work.ws_slots[0] > 0, "the layout splits no key tile"
    rev, listed = ws_runs_default_and_with("MEGATRON_DUALKV_WS_REVERSE_ROWS", "0", q, k, v, dout, seg, 0.1,
                                           deterministic, monkeypatch)
    assert_close_no_worse(rev, listed, exact(q, k, v, dout, seg, 0.1), ["dq", "dk", "dv"], "vs list order",
                          finite=True)


def held_rows_only(dout, rows):
    """dout [T, Hq, D] with the rows a context-parallel rank does not hold zeroed: the whole
    problem's gradients are then the local queries' (their dq on `rows`, their dk and dv)."""
    held = torch.zeros(dout.shape[0], 1, 1, device=dout.device, dtype=dout.dtype)
    held[rows] = 1
    return dout * held


def assert_head_parts_match_one_cta(parts, ex, deterministic, monkeypatch, *args, rest_parts=None, **run_kw):
    """run_kernel(*args, **run_kw) with the long band in `parts` head parts (and, given rest_parts,
    the second band in that many) against one CTA per kv head (MEGATRON_DUALKV_WS_HEAD_PARTS=1,
    and MEGATRON_DUALKV_WS_REST_PARTS=1 given rest_parts): dq, dk, dv within bf16 rounding and no
    worse against the float64 `ex`, every element written; deterministic: the parts' run bitwise
    reproducible and its dq (the dQ kernel's) bitwise the one-CTA run's."""
    def set_parts(head, rest):
        monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", str(head))
        if rest_parts is not None:
            monkeypatch.setenv("MEGATRON_DUALKV_WS_REST_PARTS", str(rest))
    set_parts(1, 1)
    whole = run_kernel(*args, deterministic=deterministic, **run_kw)
    set_parts(parts, rest_parts)
    split = run_kernel(*args, deterministic=deterministic, **run_kw)
    against = "vs one CTA per kv head" + (" (local queries)" if run_kw.get("rows") is not None else "")
    assert_close_no_worse(split, whole, ex, ["dq", "dk", "dv"], against, finite=True)
    if deterministic:
        again = run_kernel(*args, deterministic=True, **run_kw)
        assert_same_bits([split, again], ["dq", "dk", "dv"], "between two deterministic runs with head parts")
        assert torch.equal(split[2], whole[2]), "dq (the dQ kernel's) changed with head parts"


@gpu
@pytest.mark.parametrize("tails", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hq, hkv, parts, d", [(32, 4, 2, 128), (32, 4, 8, 128), (32, 2, 8, 128), (8, 2, 2, 128),
                                                (8, 2, 4, 64), (24, 2, 4, 128), (20, 2, 2, 64)])
def test_wsbwd_head_parts(hq, hkv, parts, d, deterministic, tails, monkeypatch):
    """The long band's key tiles as `parts` CTAs per kv head, each walking its share of the group's
    query heads, their dK/dV summed in fp32 slots (MEGATRON_DUALKV_WS_HEAD_PARTS), against one CTA
    walking them all: the same inputs, dq, dk, dv within bf16 rounding and no worse against
    float64, every element written (poisoned buffers); deterministic mode bitwise reproducible with
    parts (each part stores its sums, which the last one adds in part order) and its dq (the dQ
    kernel's) bitwise unchanged. Lists split by query rows take no head parts, and this small grid
    would split: either the split is off (no prompt tail merged either), or (tails) the list is
    built for 8 SMs, which splits nothing and merges the 1000-token prompt's 104 tail keys into its
    responses' first key tiles; two of those tail parts lie in the long band and are walked whole,
    their slots before the head parts'. Groups of 12 and 10 query heads: parts of 3 and 5 heads,
    as auto_head_parts takes them."""
    seg = make_segments([(1000, [1, 300, 1029, 64]), (256, [17] * 9)], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, torch.bfloat16, seed=random.randrange(1 << 20))
    if tails:
        monkeypatch.setitem(cuda_backend._SM_COUNTS, q.device, 8)
    else:
        monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", str(parts))
    # the lists forward() builds
    split = cuda_backend.ws_split(q, k, per_part=deterministic)
    work = cuda_backend.work_tensors(seg, q.device, None, split, not deterministic, merge_tails=tails)
    items = work.ws_kv.tolist()
    head_parts, long_items = cuda_backend.ws_head_parts(work, hq // hkv)
    assert head_parts == parts and 0 < long_items < len(items), (head_parts, long_items, len(items))
    assert work.ws_slots[0] == 0 and (work.ws_slots[1] > 0) == tails, work.ws_slots
    assert any(it[7] > 0 for it in items[:long_items]) == tails, "tail parts in the long band"
    assert_head_parts_match_one_cta(parts, exact(q, k, v, dout, seg, 0.1), deterministic, monkeypatch,
                                    q, k, v, dout, seg, 0.1, impl="ws", bwd_impl="ws")


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hq, hkv, parts, d", [(32, 4, 2, 128), (8, 2, 4, 64)])
def test_wsbwd_head_parts_local_queries(hq, hkv, parts, d, deterministic, monkeypatch):
    """Head parts on a rank's local queries (context parallelism): the lists are built from the
    held rows' runs, and the long band's key tiles walk only those rows. With parts against one CTA
    per kv head on the same inputs: dq (held rows), dk, dv within bf16 rounding and no worse
    against the float64 truth (dout zero on the rows not held), every element written;
    deterministic mode bitwise reproducible and its dq (the dQ kernel's) unchanged. Fast mode runs
    the fused kernel (MEGATRON_DUALKV_FAST_BWD=fused; auto would take the deterministic kernels on
    this layout)."""
    seg = make_segments([(1000, [1, 300, 1029, 64]), (256, [17] * 9)], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, torch.bfloat16, seed=random.randrange(1 << 20))
    rows = cp_like_rows(seg.num_tokens, seed=5)
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "fused")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", str(parts))
    work = cuda_backend.work_tensors(seg, q.device, cuda_backend.cached_query_chunks(seg, rows), None,
                                     not deterministic)
    head_parts, long_items = cuda_backend.ws_head_parts(work, hq // hkv)
    assert head_parts == parts and 0 < long_items < len(work.ws_kv.tolist()), (head_parts, long_items)
    ex_out, ex_lse, ex_dq, ex_dk, ex_dv = exact(q, k, v, held_rows_only(dout, rows), seg, 0.1)
    ex = (ex_out, ex_lse, ex_dq[rows], ex_dk, ex_dv)
    assert_head_parts_match_one_cta(parts, ex, deterministic, monkeypatch, q, k, v, dout, seg, 0.1, rows=rows)


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("groups, hq, sms, parts, d", [
    ([(3000, [300] * 5)], 8, 20, 4, 128),
    ([(2500, [300, 129, 64, 1, 400])], 4, 16, 2, 64),
])
def test_wsbwd_balance_head_parts(groups, hq, sms, parts, d, deterministic, monkeypatch):
    """One kv head (a tensor-parallel rank's share: Qwen3-8B's heads at TP = 8 are 4 / 1) on a grid
    of `sms` SMs: the long band's key tiles are about as many as the SMs, none splits by query rows,
    and auto takes head parts for balance (balance_head_parts; the prompt's tail keys merged, its
    parts walked whole), more than the L2 rule alone (MEGATRON_DUALKV_WS_BALANCE=off) takes. The
    default run against one CTA per kv head: dq, dk, dv within bf16 rounding and no worse against
    float64, every element written; deterministic bitwise reproducible, its dq (the dQ kernel's)
    unchanged."""
    seg = make_segments(groups, pad=3)
    q, k, v, dout = inputs(seg.num_tokens, hq, 1, d, torch.bfloat16, seed=random.randrange(1 << 20))
    monkeypatch.setitem(cuda_backend._SM_COUNTS, q.device, sms)
    monkeypatch.delenv("MEGATRON_DUALKV_WS_HEAD_PARTS", raising=False)
    per_part = deterministic or cuda_backend.fast_bwd_separate_dq(seg, d)  # the lists forward() builds
    lists = lambda: cuda_backend.work_tensors(seg, q.device, None, cuda_backend.ws_split(q, k, per_part=per_part),  # noqa: E731
                                              not per_part)
    work = lists()
    assert work.ws_slots[0] == 0 and work.ws_slots[1] > 0, work.ws_slots
    assert cuda_backend.ws_head_parts(work, hq) == (parts, work.ws_long_items)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_BALANCE", "off")  # the L2 rule's parts only (8 / 1: 2)
    off = lists()
    assert cuda_backend.ws_head_parts(off, hq)[0] == cuda_backend.auto_head_parts(hq, off.ws_long_own_share) < parts
    monkeypatch.delenv("MEGATRON_DUALKV_WS_BALANCE")
    assert_head_parts_match_one_cta("auto", exact(q, k, v, dout, seg, 0.1), deterministic, monkeypatch,
                                    q, k, v, dout, seg, 0.1, impl="ws", bwd_impl="ws")


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hq, hkv, head, rest, d, tails", [
    (16, 2, 1, 2, 128, False), (16, 2, 2, 2, 128, True), (32, 4, 1, 4, 128, False), (32, 4, 4, 2, 64, True),
    (8, 1, 2, 8, 128, False), (16, 2, 1, 2, 64, True), (24, 2, 4, 2, 128, False), (20, 2, 1, 2, 64, False),
    (32, 2, 8, 4, 128, True), (8, 2, 1, 4, 64, False),
])
def test_wsbwd_rest_parts(hq, hkv, head, rest, d, tails, deterministic, monkeypatch):
    """The second band's key tiles (every item after the long band: the responses' own tiles) as
    `rest` CTAs per kv head (MEGATRON_DUALKV_WS_REST_PARTS), beside the long band's `head` parts,
    against one CTA walking each key tile's whole group: dq, dk, dv within bf16 rounding and no
    worse against float64, every element written (poisoned buffers); deterministic mode bitwise
    reproducible (each part its own slot, max(head, rest) slots an item) and its dq (the dQ
    kernel's) unchanged. Several groups with responses of 1 to 1029 tokens; with `tails` the list
    is built for 8 SMs, which splits nothing and merges the prompts' tail keys into their
    responses' first key tiles, walked whole by part 0 in either band."""
    seg = make_segments([(1000, [1, 300, 1029, 64]), (256, [17] * 9), (77, [500, 3])], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, torch.bfloat16, seed=random.randrange(1 << 20))
    if tails:
        monkeypatch.setitem(cuda_backend._SM_COUNTS, q.device, 8)
    else:
        monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    split = cuda_backend.ws_split(q, k, per_part=deterministic)
    work = cuda_backend.work_tensors(seg, q.device, None, split, not deterministic, merge_tails=tails)
    items = work.ws_kv.tolist()
    monkeypatch.setenv("MEGATRON_DUALKV_WS_REST_PARTS", str(rest))
    assert cuda_backend.ws_rest_parts(work, hq // hkv) == rest and 0 < work.ws_long_items < len(items)
    assert work.ws_slots[0] == 0 and (work.ws_slots[1] > 0) == tails, work.ws_slots
    if tails:
        assert any(it[7] > 0 for it in items[work.ws_long_items:]), "no tail part in the second band"
    assert_head_parts_match_one_cta(head, exact(q, k, v, dout, seg, 0.1), deterministic, monkeypatch,
                                    q, k, v, dout, seg, 0.1, rest_parts=rest, impl="ws", bwd_impl="ws")


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hq, hkv, head, rest, d", [(16, 2, 1, 2, 128), (32, 2, 2, 4, 64)])
def test_wsbwd_rest_parts_local_queries(hq, hkv, head, rest, d, deterministic, monkeypatch):
    """Second-band head parts on a rank's local queries (context parallelism; lists from the held
    rows' runs) against one CTA per key tile and kv head: dq (held rows), dk, dv within bf16
    rounding and no worse against float64 (dout zero on the rows not held), every element written;
    deterministic bitwise reproducible, its dq (the dQ kernel's) unchanged. Fast mode runs the
    fused kernel (MEGATRON_DUALKV_FAST_BWD=fused)."""
    seg = make_segments([(1000, [1, 300, 1029, 64]), (256, [17] * 9)], pad=3)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, torch.bfloat16, seed=random.randrange(1 << 20))
    rows = cp_like_rows(seg.num_tokens, seed=7)
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "fused")
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT", "0")
    work = cuda_backend.work_tensors(seg, q.device, cuda_backend.cached_query_chunks(seg, rows), None,
                                     not deterministic)
    assert 0 < work.ws_long_items < len(work.ws_kv.tolist())
    ex_out, ex_lse, ex_dq, ex_dk, ex_dv = exact(q, k, v, held_rows_only(dout, rows), seg, 0.1)
    ex = (ex_out, ex_lse, ex_dq[rows], ex_dk, ex_dv)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_REST_PARTS", str(rest))
    assert cuda_backend.ws_rest_parts(work, hq // hkv) == rest
    assert_head_parts_match_one_cta(head, ex, deterministic, monkeypatch, q, k, v, dout, seg, 0.1, rest_parts=rest,
                                    rows=rows)


@gpu
def test_wsbwd_head_parts_must_divide_the_group(monkeypatch):
    seg = make_segments([(300, [100, 200])])
    q, k, v, _ = inputs(seg.num_tokens, 8, 2, 128, torch.bfloat16, seed=0)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", "8")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_HEAD_PARTS=8 does not divide the 4 query heads"):
        cuda_backend.forward(q, k, v, seg, 0.1)


# One kv head on a grid of 20 SMs (monkeypatched): the deterministic lists split nothing and take
# head parts for balance (test_wsbwd_balance_head_parts' first layout)
HEAD_PARTS_CASE = ([(3000, [300] * 5)], 3, 8, 1, 128, torch.bfloat16)


@gpu
@pytest.mark.parametrize("case", [1, 3, 4, "head parts"])  # the layouts whose key tiles split (CASES), or in head parts
@pytest.mark.parametrize("mode", ["auto", "auto, one queue", "pdl", "1"])
def test_wsbwd_deterministic_dq_beside_dkdv(case, mode, monkeypatch):
    """The deterministic backward's dQ kernel beside its dK/dV kernel (MEGATRON_DUALKV_DQ_STREAM:
    "pdl", a programmatic dependent launch on the same stream, auto's choice where key tiles split
    or the long band runs in head parts; "1", a second stream, auto's under
    CUDA_DEVICE_MAX_CONNECTIONS=1) gives bitwise what the two one after the other give ("0"), and
    the stream's next work sees both kernels complete: copies enqueued right behind the backward
    equal the gradients read after a device synchronize (a dQ grid finishing before the dK/dV grid
    would show as a stale dk or dv copy)."""
    groups, pad, hq, hkv, d, dtype = HEAD_PARTS_CASE if case == "head parts" else CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, dout = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=3030 + random.randrange(1 << 20))
    if case == "head parts":
        monkeypatch.setitem(cuda_backend._SM_COUNTS, q.device, 20)
        monkeypatch.delenv("MEGATRON_DUALKV_WS_HEAD_PARTS", raising=False)
        work = cuda_backend.work_tensors(seg, q.device, None, cuda_backend.ws_split(q, k, per_part=True))
        parts = cuda_backend.ws_head_parts(work, hq // hkv)[0]
        assert work.ws_slots[0] == 0 and parts > 1 and cuda_backend.ws_dq_beside(work, parts), (work.ws_slots, parts)

    def run():
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out = cuda_backend.attention(qq, kk, vv, seg, 0.1, deterministic=True, fwd_impl="ws", bwd_impl="ws")
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        early = [g.clone() for g in grads]  # on the stream, right behind the backward's kernels
        torch.cuda.synchronize()
        return early, grads

    monkeypatch.setenv("MEGATRON_DUALKV_DQ_STREAM", "0")
    _, serial = run()
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_STREAM", mode.split(",")[0])
    if mode == "auto, one queue":  # read at every call (the process keeps its queues)
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for _ in range(3):
        early, grads = run()
        for name, e, g, ref in zip(("dq", "dk", "dv"), early, grads, serial):
            assert torch.equal(e, g), f"{name}: the copy taken behind the backward differs (a kernel still running)"
            assert torch.equal(g, ref), f"{name} differs from the serial launches' (mode {mode})"


@gpu
@pytest.mark.parametrize("mode", ["fast", "deterministic", "deterministic, second stream"])
def test_wsbwd_replays_in_a_cuda_graph(mode, monkeypatch):
    """Forward and backward captured in a CUDA graph (after an eager warm-up that builds the work
    lists) and replayed on new inputs copied into the captured ones: the deterministic backward (its
    dQ kernel a programmatic dependent launch, or on a second stream) bitwise what eager gives on
    those inputs, the fast one within fp32-sum rounding; the layout splits key tiles (CASES[4])."""
    if mode.endswith("second stream"):
        monkeypatch.setenv("MEGATRON_DUALKV_DQ_STREAM", "1")
    deterministic = mode != "fast"
    groups, pad, hq, hkv, d, dtype = CASES[4]
    seg = make_segments(groups, pad)
    first = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=random.randrange(1 << 20))
    second = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=random.randrange(1 << 20))
    qq, kk, vv, do = (x.clone().requires_grad_(i < 3) for i, x in enumerate(first))

    def step():
        out = cuda_backend.attention(qq, kk, vv, seg, 0.1, deterministic=deterministic, fwd_impl="ws", bwd_impl="ws")
        return (out, *torch.autograd.grad(out, (qq, kk, vv), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's graph docs ask
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for dst, src in zip((qq, kk, vv, do), second):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "dq", "dk", "dv"), captured, eager):
        assert torch.isfinite(got).all(), f"{name}: non-finite elements after the replay"
        if deterministic or name == "out":
            assert torch.equal(got, want), f"{name} replayed differs from eager: rel {rel(got, want):.3e}"
        else:
            assert rel(got, want) < 1e-2, f"{name} replayed: rel {rel(got, want):.3e} vs eager"


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_local_queries(case, deterministic):
    """Local queries (context parallelism): q holds some packed rows, k and v all of them. The ws
    forward gives bitwise the full micro-batch's out and lse on those rows; the ws backward's dq
    (held rows) and dk, dv (all rows, contributions of the held queries) are within the
    replicated SDPA error of the float64 truth of the same problem (dout zero on other rows).
    Deterministic: dq bitwise the whole micro-batch's deterministic dq on those rows (a row's dQ
    sums the same key tiles in the same order, whichever rows share its query tile), and two runs
    bitwise alike."""
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    t = seg.num_tokens
    scale = 1.0 / math.sqrt(d)
    q, k, v, dout = inputs(t, hq, hkv, d, dtype, seed=99 + case + random.randrange(1 << 20))
    rows = cp_like_rows(t, seed=case)
    full = run_kernel(q, k, v, dout, seg, scale, deterministic=True, impl="ws", bwd_impl="ws")
    full_out, full_lse = cuda_backend.forward(q, k, v, seg, scale, fwd_impl="ws")
    assert torch.equal(full_out, full[0])
    out, lse, dq, dk, dv = run_kernel(q, k, v, dout, seg, scale, deterministic, rows=rows)
    assert out.shape == (rows.numel(), hq, d) and lse.shape == (hq, rows.numel())
    assert torch.equal(out, full_out[rows]) and torch.equal(lse, full_lse[:, rows]), "forward differs from the full batch"
    if deterministic:
        assert torch.equal(dq, full[2][rows]), "deterministic dq differs from the whole micro-batch's on the held rows"
        again = run_kernel(q, k, v, dout, seg, scale, deterministic, rows=rows)
        for name, a, b in (("dq", dq, again[2]), ("dk", dk, again[3]), ("dv", dv, again[4])):
            assert torch.equal(a, b), f"deterministic local queries: {name} differs between two runs"
    masked = held_rows_only(dout, rows)
    _, _, ex_dq, ex_dk, ex_dv = exact(q, k, v, masked, seg, scale)
    _, r_dq, r_dk, r_dv = replicated_sdpa(q, k, v, masked, seg, scale)
    lines = []
    for name, mine, rep, truth in (("dq", dq, r_dq[rows], ex_dq[rows]), ("dk", dk, r_dk, ex_dk),
                                   ("dv", dv, r_dv, ex_dv)):
        assert torch.isfinite(mine).all(), f"{name}: non-finite elements (unwritten or overflow)"
        e_k, e_r = rel(mine, truth), rel(rep, truth)
        lines.append(f"{name}: kernel {e_k:.3e} replicated-SDPA {e_r:.3e}")
        assert e_k <= e_r * SLACK + 1e-7, f"local queries {name}: kernel error {e_k:.3e} > replicated SDPA {e_r:.3e}"
    print(f"case {case} local queries {rows.numel()} of {t} rows, deterministic={deterministic}: " + "; ".join(lines))


@gpu
def test_local_queries_fast_mode_takes_the_separate_dq(monkeypatch):
    """Fast mode with local queries on a layout where it picks the deterministic kernels
    (`fast_bwd_separate_dq`) is bitwise the deterministic local backward; with
    MEGATRON_DUALKV_DQ_KERNEL=sm90 (which takes all rows only) it keeps the fused kernel, and a
    deterministic call names the switch."""
    seg = make_segments([(128, [512] * 6), (100, [300, 700])])
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    rows = cp_like_rows(seg.num_tokens, seed=11)
    # the backward each call runs: the deterministic flag forward() hands the autograd function
    modes, apply = [], cuda_backend._DualKVFunction.apply
    monkeypatch.setattr(cuda_backend._DualKVFunction, "apply", lambda *a: modes.append(a[8]) or apply(*a))
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "auto")
    assert cuda_backend.fast_bwd_separate_dq(seg, 128)
    fast = run_kernel(q, k, v, dout, seg, 0.1, False, rows=rows)
    det = run_kernel(q, k, v, dout, seg, 0.1, True, rows=rows)
    assert modes == [True, True]
    for name, i in (("dq", 2), ("dk", 3), ("dv", 4)):
        assert torch.equal(fast[i], det[i]), f"{name}: fast mode with local queries is not the deterministic backward"
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_KERNEL", "sm90")
    fused = run_kernel(q, k, v, dout, seg, 0.1, False, rows=rows)
    assert modes[-1] is False, "fast mode under MEGATRON_DUALKV_DQ_KERNEL=sm90 must keep the fused kernel"
    masked = held_rows_only(dout, rows)
    _, _, ex_dq, ex_dk, ex_dv = exact(q, k, v, masked, seg, 0.1)
    _, r_dq, r_dk, r_dv = replicated_sdpa(q, k, v, masked, seg, 0.1)
    for name, i, truth, rep in (("dq", 2, ex_dq[rows], r_dq[rows]), ("dk", 3, ex_dk, r_dk), ("dv", 4, ex_dv, r_dv)):
        for label, run in (("separate", fast), ("fused", fused)):
            assert rel(run[i], truth) <= rel(rep, truth) * SLACK + 1e-7, f"{name} ({label}): worse than replicated SDPA"
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_DQ_KERNEL=sm90"):
        run_kernel(q, k, v, dout, seg, 0.1, True, rows=rows)


@gpu
def test_local_queries_through_the_entry_point():
    """dualkv_attention(..., q_rows=...) picks the cuda backend and refuses what it cannot take."""
    from megatron_dualkv.ops import attention as entry

    seg = make_segments([(300, [5, 90]), (40, [7] * 3)], pad=3)
    q, k, v, _ = inputs(seg.num_tokens, 8, 2, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    rows = cp_like_rows(seg.num_tokens, seed=7)
    assert entry.select_backend(q[rows], local_queries=True)[0] == "cuda"
    out = entry.dualkv_attention(q[rows].contiguous(), k, v, seg, 0.1, q_rows=rows)
    assert torch.equal(out, cuda_backend.attention(q, k, v, seg, 0.1)[rows])
    assert entry.select_backend(q[rows], local_queries=True, deterministic=True)[0] == "cuda"
    out = entry.dualkv_attention(q[rows].contiguous(), k, v, seg, 0.1, q_rows=rows, deterministic=True)
    assert torch.equal(out, cuda_backend.attention(q, k, v, seg, 0.1)[rows])
    with pytest.raises(ValueError, match="ws forward and backward only"):
        cuda_backend.attention(q[rows].contiguous(), k, v, seg, 0.1, fwd_impl="sm90", q_rows=rows)
    with pytest.raises(ValueError, match="ascending"):
        cuda_backend.attention(q[rows].contiguous(), k, v, seg, 0.1, q_rows=rows.flip(0))


@gpu
def test_bad_inputs_raise_clear_errors():
    seg = make_segments([(10, [3])])
    t = seg.num_tokens
    dev = "cuda"
    q = torch.randn(t, 4, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, 2, 128, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim"):
        cuda_backend.attention(q[..., :96].contiguous(), k[..., :96].contiguous(), k[..., :96].contiguous(), seg, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        cuda_backend.attention(q.float(), k.float(), k.float(), seg, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        qt = torch.randn(4, t, 128, device=dev, dtype=torch.bfloat16).transpose(0, 1)
        cuda_backend.attention(qt, k, k, seg, 0.1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cuda_backend.attention(torch.randn(t, 3, 128, device=dev, dtype=torch.bfloat16), k, k, seg, 0.1)
    deep = SegmentTable.from_host([0, 4, 8], [4, 4, 5], [-1, 0, 1], device=dev)
    with pytest.raises(ValueError, match="depth"):
        cuda_backend.attention(q, k, k, deep, 0.1)


@gpu
def test_ws_forward_names_a_bad_key_tile():
    seg = make_segments([(100, [30, 7])])
    rows = cuda_backend.work_tensors(seg, torch.device("cuda")).rows128
    for d, tile in ((64, 176), (128, 96)):
        q, k, v, _ = inputs(seg.num_tokens, 4, 2, d, torch.bfloat16, seed=5)
        with pytest.raises(RuntimeError, match="176 at head dim 128"):
            torch.ops.megatron_dualkv.fwd_ws_sm90(q, k, v, rows, 0.1, tile)


@gpu
@pytest.mark.parametrize("tile", [128, 176])
def test_ws_forward_tail_first_matches_key_order(tile, monkeypatch):
    """The parent's last key tile last, after the loop, with narrowed MMAs (the default) against the
    same tile in key order at full width, and narrowed to 64 keys at least
    (MEGATRON_DUALKV_WS_FWD_TAIL_MIN=64, the previous rule): each as close to float64 as the
    others. Prompts of 1, 77, 130, 150, 168 and 1999 rows leave 1, 77, 2, 22, 40 and 79 keys in the
    last 128-key tile (narrowed to 16, 128, 16, 32, 64, left full; at least 64 with the switch) and
    1, 77, 130, 150, 168 and 63 in the last 176-key tile (64, 128, full, full, full, 64)."""
    seg = make_segments([(1, [3, 40]), (77, [30, 200]), (130, [129]), (150, [20, 64]), (168, [33]), (1999, [5, 300])],
                        pad=5)
    q, k, v, _ = inputs(seg.num_tokens, 32, 8, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", str(tile))
    got = {}
    for mode, narrowest in (("narrow", "16"), ("narrow", "64"), ("full", "16")):
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL", mode)
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL_MIN", narrowest)
        got[mode, narrowest] = cuda_backend.forward(q, k, v, seg, 0.09, fwd_impl="ws")
    ex_out, ex_lse = exact(q, k, v, q, seg, 0.09)[:2]
    e = {mode: rel(out, ex_out) for mode, (out, _) in got.items()}
    for a_ in e:
        for b_ in e:
            assert e[a_] <= e[b_] * 1.05 + 1e-7, e
    for mode, (_, lse) in got.items():
        assert (lse.double() - ex_lse).abs().max().item() < 1e-3, mode


@gpu
@pytest.mark.parametrize("tile", [128, 176])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_ws_forward_persistent_is_one_tile_per_cta_bitwise(case, tile, monkeypatch):
    """Persistent CTAs (one per SM, query tiles taken in turn, the K/V ring and the consumers'
    turns running on from tile to tile, the next Q loaded under the current tile's end) give
    bitwise the out and lse of one CTA per query tile, every element written (NaN-poisoned
    buffers): CASES (odd prompts, narrowed partial prompt tiles, GQA 32/8 and 32/4, both head
    dims and dtypes, each SM taking many query tiles of unequal length), a layout of fewer query
    tiles than SMs, and a context-parallel rank's local queries."""
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, _ = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=77 + case + random.randrange(1 << 20))
    small = make_segments([(100, [30, 7])])
    qs, ks, vs, _ = inputs(small.num_tokens, 4, 2, d, dtype, seed=5 + case)
    rows = cp_like_rows(seg.num_tokens, seed=case)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", str(tile))
    got = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", mode)
        poison_allocator(4 * q.numel() * q.element_size() + (64 << 20))
        got[mode] = (cuda_backend.forward(q, k, v, seg, 0.11, fwd_impl="ws"),
                     cuda_backend.forward(qs, ks, vs, small, 0.11, fwd_impl="ws"),
                     cuda_backend.forward(q[rows].contiguous(), k, v, seg, 0.11, q_rows=rows))
    for what, one, pers in zip(("whole batch", "8 query tiles", "local queries"), got["0"], got["1"]):
        for name, a, b in zip(("out", "lse"), one, pers):
            assert torch.isfinite(b).all(), f"{what}: persistent {name} has unwritten or non-finite elements"
            assert torch.equal(a, b), f"{what}: persistent {name} differs from one CTA per query tile"


@gpu
@pytest.mark.parametrize("tile", [128, 176])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_ws_forward_skipped_masked_work_is_bitwise(case, tile, monkeypatch):
    """What the forward's consumers leave out is masked: consumer 0 runs a causal diagonal's
    128-key tile after its loop at 64 keys (MEGATRON_DUALKV_WS_FWD_DIAG=0: at full width in the
    loop), and consumer 1 of a query tile of 64 rows or fewer computes nothing
    (MEGATRON_DUALKV_WS_FWD_IDLE=0: it walks the tile). Only zero products and rows never stored
    are dropped, so bitwise equal out and lse, every element written (NaN-poisoned buffers), one
    CTA per query tile and persistent, the whole batch and a context-parallel rank's local
    queries. Every case has query tiles of more than 64 rows at a diagonal and of 64 or fewer."""
    groups, pad, hq, hkv, d, dtype = CASES[case]
    seg = make_segments(groups, pad)
    q, k, v, _ = inputs(seg.num_tokens, hq, hkv, d, dtype, seed=31 + case + random.randrange(1 << 20))
    rows = cp_like_rows(seg.num_tokens, seed=case)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", str(tile))
    for persistent in ("0", "1"):
        monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", persistent)
        got = {}
        for diag, idle in (("1", "1"), ("0", "1"), ("1", "0")):
            monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_DIAG", diag)
            monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_IDLE", idle)
            poison_allocator(4 * q.numel() * q.element_size() + (64 << 20))
            got[diag, idle] = (cuda_backend.forward(q, k, v, seg, 0.11, fwd_impl="ws"),
                               cuda_backend.forward(q[rows].contiguous(), k, v, seg, 0.11, q_rows=rows))
        for switch in (("0", "1"), ("1", "0")):
            for what, new, old in zip(("whole batch", "local queries"), got["1", "1"], got[switch]):
                for name, a, b in zip(("out", "lse"), new, old):
                    where = f"{what}, persistent={persistent}, DIAG, IDLE={switch}"
                    assert torch.isfinite(a).all(), f"{where}: {name} has unwritten elements"
                    assert torch.equal(a, b), f"{where}: {name} differs with the masked work skipped"


@gpu
def test_ws_forward_names_a_bad_tail_mode(monkeypatch):
    seg = make_segments([(100, [30, 7])])
    q, k, v, _ = inputs(seg.num_tokens, 4, 2, 128, torch.bfloat16, seed=5)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL", "wide")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_FWD_TAIL must be"):
        cuda_backend.forward(q, k, v, seg, 0.1, fwd_impl="ws")


@gpu
@pytest.mark.parametrize("var, bad, allowed", [("MEGATRON_DUALKV_WS_FWD_TAIL_MIN", "8", "'16' or '64'"),
                                               ("MEGATRON_DUALKV_WS_FWD_DIAG", "yes", "'0' or '1'"),
                                               ("MEGATRON_DUALKV_WS_FWD_IDLE", "2", "'0' or '1'")])
def test_ws_forward_names_a_bad_switch(var, bad, allowed, monkeypatch):
    """A ws forward switch of the extension (WS_FWD_TAIL_MIN: 16 or 64; WS_FWD_DIAG and
    WS_FWD_IDLE: 0 or 1) set to a value it does not take: an error naming the variable."""
    seg = make_segments([(100, [30, 7])])
    q, k, v, _ = inputs(seg.num_tokens, 4, 2, 128, torch.bfloat16, seed=5)
    monkeypatch.setenv(var, bad)
    with pytest.raises(RuntimeError, match=f"{var} must be {allowed}"):
        cuda_backend.forward(q, k, v, seg, 0.1, fwd_impl="ws")


@gpu
@pytest.mark.parametrize("var", ["MEGATRON_DUALKV_WS_BWD_QTILE", "MEGATRON_DUALKV_WS_DQ",
                                 "MEGATRON_DUALKV_WS_REVERSE_ROWS"])
def test_ws_backward_names_a_bad_switch(var, monkeypatch):
    seg = make_segments([(100, [30, 7])])
    t = seg.num_tokens
    q, k, v, dout = inputs(t, 4, 2, 128, torch.bfloat16, seed=5)
    monkeypatch.setenv(var, "96")
    with pytest.raises(RuntimeError, match=f"{var} must be"):
        run_kernel(q, k, v, dout, seg, 0.1, impl="sm90", bwd_impl="ws")


@gpu
@pytest.mark.parametrize("bwd", ["sm90", "ws"])
def test_dq_kernel_names_a_bad_key_tile(bwd, monkeypatch):
    """MEGATRON_DUALKV_DQ_KTILE (the sm90 dQ kernel's key rows per step) other than 64 or 128 is
    an error naming the variable, in both backwards that run that kernel (the ws backward with
    MEGATRON_DUALKV_DQ_KERNEL=sm90)."""
    seg = make_segments([(100, [30, 7])])
    q, k, v, dout = inputs(seg.num_tokens, 4, 2, 128, torch.bfloat16, seed=5)
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_KERNEL", "sm90")
    monkeypatch.setenv("MEGATRON_DUALKV_DQ_KTILE", "96")
    with pytest.raises(RuntimeError, match="MEGATRON_DUALKV_DQ_KTILE must be"):
        run_kernel(q, k, v, dout, seg, 0.1, deterministic=True, impl="ws", bwd_impl=bwd)


@gpu
@pytest.mark.parametrize("fwd_kind, tiling", [("sm90", (128, False)), ("ws", (176, True))])
def test_torch_compile_traces_the_ops(fwd_kind, tiling):
    seg = make_segments([(200, [10, 70])])
    q, k, v, dout = inputs(seg.num_tokens, 8, 2, 128, torch.bfloat16, seed=random.randrange(1 << 20))
    lists = cuda_backend._lists(cuda_backend.work_tensors(seg, q.device), fwd_kind, "sm90")

    def f(q, k, v):
        return cuda_backend._DualKVFunction.apply(q, k, v, *lists[:4], 0.09, False, fwd_kind, lists[4], lists[5],
                                                  tiling)[0]

    qq = q.clone().requires_grad_(True)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(qq, k, v)
    out.backward(dout)
    ref = f(q, k, v)
    assert torch.equal(out, ref)
    assert qq.grad is not None and torch.isfinite(qq.grad).all()


# ---------------------------------------------------------------------------------------------
# work lists (host side, no GPU needed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tiles", [(64, 64), (128, 128)])
def test_work_lists_cover_every_allowed_pair_once(seed, tiles):
    """Row items tile every query once with the right key regions; key items visit exactly the
    queries that may attend them (own causal rows, all children of a root)."""
    rng = random.Random(seed)
    groups = [(rng.randint(1, 300), [rng.randint(1, 200) for _ in range(rng.randint(0, 6))])
              for _ in range(rng.randint(1, 4))]
    seg = make_segments(groups, pad=rng.choice([0, 3, 70]), device="cpu")
    row_tile, kv_tile = tiles
    rows, kvs, ranges = cuda_backend.build_work(seg, row_tile=row_tile, kv_tile=kv_tile)
    t = seg.num_tokens
    seg_of = seg.token_segment_ids().tolist()
    starts, lens, parents = seg.host_start, seg.host_length, seg.host_parent
    covered = [0] * t
    for q0, q1, self0, par0, par1, cost, _, _ in rows:
        s_ = seg_of[q0]
        assert seg_of[q1 - 1] == s_ and q1 - q0 <= row_tile and self0 == starts[s_]
        p_ = parents[s_]
        assert (par0, par1) == ((starts[p_], starts[p_] + lens[p_]) if p_ >= 0 else (0, 0))
        for i in range(q0, q1):
            covered[i] += 1
    assert covered == [1] * t
    kcovered = [0] * t
    for k0, k1, seg_end, rlo, rhi, per_head, _, _ in kvs:
        s_ = seg_of[k0]
        assert seg_of[k1 - 1] == s_ and k1 - k0 <= kv_tile and seg_end == starts[s_] + lens[s_]
        visited = set(range(k0, seg_end))
        n_tiles = -(-(seg_end - k0) // 64)
        for a, b in ranges[rlo:rhi]:
            visited |= set(range(a, b))
            n_tiles += -(-(b - a) // 64)
        assert per_head == n_tiles
        kids = {c for c, p in enumerate(parents) if p == s_}
        for j in range(k0, k1):
            kcovered[j] += 1
            allowed = {i for i in range(t) if (seg_of[i] == s_ and i >= j) or seg_of[i] in kids}
            assert allowed <= visited
            assert {i for i in visited if not (seg_of[i] == s_ and i < j)} == allowed
    assert kcovered == [1] * t


def random_chunks(t, rng):
    """Query chunks as a context-parallel rank holds them: some runs of [0, t), ascending."""
    cuts = sorted(rng.sample(range(1, t), min(t - 1, rng.randint(1, 9))))
    runs = list(zip([0] + cuts, cuts + [t]))
    held = [r for r in runs if rng.random() < 0.5] or [runs[0]]
    rows = torch.cat([torch.arange(a, b) for a, b in held])
    return rows, cuda_backend.query_chunks(rows, t)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("local", [False, True])
def test_ws_work_lists_cover_the_held_queries_once(seed, local):
    """The ws lists (128-row tiles): row items tile each held query once, with its local row; kv
    items visit, for every key row, exactly the held queries that attend it, at their local rows,
    causal only inside the key's own segment."""
    rng = random.Random(seed)
    groups = [(rng.randint(1, 300), [rng.randint(1, 200) for _ in range(rng.randint(0, 6))])
              for _ in range(rng.randint(1, 4))]
    seg = make_segments(groups, pad=rng.choice([0, 3, 70]), device="cpu")
    t = seg.num_tokens
    rows, chunks = random_chunks(t, rng) if local else (torch.arange(t), None)
    local_of = {int(g): i for i, g in enumerate(rows)}
    seg_of = seg.token_segment_ids().tolist()
    parents = seg.host_parent
    covered = {}
    row_list = cuda_backend.row_items(seg, 128, chunks)
    for q0, q1, self0, par0, par1, cost, qloc, _ in row_list:
        assert seg_of[q1 - 1] == seg_of[q0] and 0 < q1 - q0 <= 128 and self0 == seg.host_start[seg_of[q0]]
        for i in range(q0, q1):
            assert local_of[i] == qloc + i - q0
            covered[i] = covered.get(i, 0) + 1
    assert covered == {i: 1 for i in local_of}
    # grouped by segment, the segment with the heaviest tile first, heaviest first inside one
    runs = [[it for it in row_list if it[2] == s] for s in dict.fromkeys(it[2] for it in row_list)]
    assert [it for run in runs for it in run] == row_list, "the tiles of one segment are not neighbours"
    assert [run[0][5] for run in runs] == sorted((run[0][5] for run in runs), reverse=True)
    assert all([it[5] for it in run] == sorted((it[5] for it in run), reverse=True) for run in runs)
    items, ranges = cuda_backend.ws_kv_work(seg, chunks)
    kcovered = [0] * t
    tail_walks = {}  # (prompt tail key, query row) -> times walked, over the tail's parts
    for k0, k1, rlo, rhi, per_head, _, wide_per_head, _, tail, dest in items:
        # a response's first key tile may hold its prompt's tail keys dest.. in its first rows
        head = max(tail, 0)
        s_ = seg_of[k0 + head]
        assert seg_of[k1 - 1] == s_ and k1 - k0 <= 128
        assert not head or (parents[s_] >= 0 and k0 + head == seg.host_start[s_]
                            and dest + head == seg.host_start[parents[s_]] + seg.host_length[parents[s_]])
        visited = {}
        for a, b, loc, causal in ranges[rlo:rhi]:
            assert causal == (seg_of[a] == s_) and (not causal or a >= k0 + head)  # no rows wholly masked
            for i in range(a, b):
                assert i not in visited and local_of[i] == loc + i - a
                visited[i] = causal
        assert per_head == sum(-(-(b - a) // 64) for a, b, _, _ in ranges[rlo:rhi])
        assert wide_per_head == sum(-(-(b - a) // 80) for a, b, _, _ in ranges[rlo:rhi])
        for j in range(dest, dest + head):  # never masked: every row the tile walks attends them
            for i in visited:
                tail_walks[j, i] = tail_walks.get((j, i), 0) + 1
        for j in range(k0 + head, k1):
            kcovered[j] += 1
            walked = {i for i, c in visited.items() if not (c and i < j)}
            if tail < 0:  # a prompt's tail tile: its own rows here, its children's in their first tiles
                for i in walked:
                    tail_walks[j, i] = tail_walks.get((j, i), 0) + 1
                continue
            allowed = {i for i in local_of if (seg_of[i] == s_ and i >= j) or parents[seg_of[i]] == s_}
            assert walked == allowed
    for it in items:
        if it[8] < 0:
            s_ = seg_of[it[0]]
            assert it[1] == seg.host_start[s_] + seg.host_length[s_] and it[1] - it[0] == -it[8]
            for j in range(it[0], it[1]):
                allowed = {i for i in local_of if (seg_of[i] == s_ and i >= j) or parents[seg_of[i]] == s_}
                walked = {i: n for (jj, i), n in tail_walks.items() if jj == j}
                assert walked == {i: 1 for i in allowed}, f"tail key {j}: its queries not walked once each"
    assert kcovered == [1] * t


def _grouped_by_walked_segment(items, ranges, starts):
    """Whether items come grouped by the segment each walks first (`_walked_segment`), the
    segments in order of their heaviest item, heaviest first inside one."""
    seg_of = [cuda_backend._walked_segment(it, ranges, starts) for it in items]
    runs = [g for i, g in enumerate(seg_of) if i == 0 or seg_of[i - 1] != g]
    if len(runs) != len(set(runs)):
        return False
    work = {g: [it[4] for it, s in zip(items, seg_of) if s == g] for g in runs}
    return (all(w == sorted(w, reverse=True) for w in work.values())
            and [work[g][0] for g in runs] == sorted((work[g][0] for g in runs), reverse=True))


@pytest.mark.parametrize("groups", [[(4096, [2048] * 28)], [(700, [5, 300]), (3000, [64] * 9), (40, [1])],
                                    [(512, [30000, 12000, 20000])], [(64, [9000] * 3), (128, [4000, 9500])]])
@pytest.mark.parametrize("by_segment", [True, False])
def test_ws_kv_items_name_their_long_band(groups, by_segment):
    """Field 5 of every ws kv item is n_long: items 0..n_long-1 carry at least 1/LONG_BAND of the
    heaviest item's query tiles, the rest less. The kernel starts the first band's CTAs of every
    kv head before any other; for a GRPO group whose responses are short next to its prompt that
    band is exactly the prompt's key tiles. Each band is grouped by the segment its items walk
    first (a response's key tiles are neighbours), heaviest first inside one; long responses put
    their key tiles in the first band too, and with long_band_by_segment=False (the A/B switch
    MEGATRON_DUALKV_WS_LONG_BAND=work) that band is heaviest first across segments."""
    seg = make_segments(groups, device="cpu")
    items, ranges = cuda_backend.ws_kv_work(seg, long_band_by_segment=by_segment)
    n_long = items[0][5]
    assert all(it[5] == n_long for it in items) and 0 < n_long <= len(items)
    heaviest = max(it[4] for it in items)
    assert all(it[4] * cuda_backend.LONG_BAND >= heaviest for it in items[:n_long])
    assert all(it[4] * cuda_backend.LONG_BAND < heaviest for it in items[n_long:])
    starts = sorted(seg.host_start)
    assert _grouped_by_walked_segment(items[n_long:], ranges, starts), "the second band is not grouped by segment"
    band = [it[4] for it in items[:n_long]]
    if by_segment:
        assert _grouped_by_walked_segment(items[:n_long], ranges, starts), "the first band is not grouped by segment"
    else:
        assert band == sorted(band, reverse=True)
    if len(groups) == 1 and groups[0][0] >= 4096:
        p = groups[0][0]
        assert sorted(it[0] for it in items[:n_long]) == list(range(0, p, 128))
    # both orders list the same items in the same bands; only the first band's order differs
    other, _ = cuda_backend.ws_kv_work(seg, long_band_by_segment=not by_segment)
    assert other[0][5] == n_long and other[n_long:] == items[n_long:]
    assert sorted(other[:n_long]) == sorted(items[:n_long])
    spans = len({cuda_backend._walked_segment(it, ranges, starts) for it in items[:n_long]}) > 1
    assert (other[:n_long] != items[:n_long]) == spans


def test_ws_long_band_switch_is_named(monkeypatch):
    monkeypatch.setenv("MEGATRON_DUALKV_WS_LONG_BAND", "heaviest")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_LONG_BAND must be"):
        cuda_backend.ws_long_band_by_segment()
    monkeypatch.setenv("MEGATRON_DUALKV_WS_LONG_BAND", "work")
    assert cuda_backend.ws_long_band_by_segment() is False


@pytest.mark.parametrize("groups, hkv, group, slots, local", [
    ([(512, [1024] * 16)], 8, 4, 4, False),        # (N, P, R) = (16, 512, 1024): the prompt's 4 key tiles
    ([(256, [1024] * 64)], 8, 4, 2, False),
    ([(4096, [2048] * 28)], 8, 4, 0, False),       # the published shapes split nothing
    ([(65536, [1024] * 16)], 8, 4, 0, False),
    ([(130, [200] * 48), (5, [3])], 4, 8, 2, False),  # 8 query heads per kv head
    ([(1999, [1, 700, 64, 2048]), (130, [17] * 16)], 4, 8, 14, False),  # a 2048-row response cut in parts
    ([(300, [90] * 60), (7, [50, 3])], 8, 4, 3, True),  # a context-parallel rank's rows
])
@pytest.mark.parametrize("per_part", [False, True])
def test_ws_split_by_rows(groups, hkv, group, slots, local, per_part):
    """Key tiles whose CTA would outlast the grid become parts that walk disjoint query rows: every
    (key tile, query row) pair of the unsplit list walked by exactly one item, causal as before;
    field 7 = (slot << 20) | (part << 10) | parts with `parts` items per split tile, numbered 0 ..
    parts - 1, and slots numbered from 0: one per tile, or per_part (the deterministic lists) one
    per part, a tile's parts taking consecutive slots from its own; the same parts either way; no part
    crosses a segment start and all but a tile's last have at least WS_SPLIT_MIN_ROWS rows; fields
    4 and 6 count the part's 64- and 80-row steps. After a split: one band (field 5 = 0) and the
    items grouped by the segment whose rows they walk first, so a response's own key tiles and the
    prompt's parts over its rows are neighbours in the list."""
    seg = make_segments(groups, device="cpu")
    chunks = random_chunks(seg.num_tokens, random.Random(5))[1] if local else None
    # (prompt tails kept as tiles: test_ws_prompt_tails_merged takes them)
    plain, plain_ranges = cuda_backend.ws_kv_work(seg, chunks, merge_tails=False)
    items, ranges = cuda_backend.ws_kv_work(seg, chunks, split=(hkv, group, 132, per_part), merge_tails=False)
    fast = cuda_backend.ws_kv_work(seg, chunks, split=(hkv, group, 132), merge_tails=False)
    assert [it[:7] for it in items] == [it[:7] for it in fast[0]] and ranges == fast[1]
    tiles = len({it[7] >> 20 for it in fast[0] if it[7] > 0})
    assert tiles == slots and cuda_backend.split_slots(fast[0]) == slots
    assert cuda_backend.split_slots(items, per_part) == (sum(it[7] > 0 for it in items) if per_part else slots)
    if not slots:
        assert items == plain and ranges == plain_ranges
        return

    def pairs(item, rs):
        return {(item[0], row, loc + row - a, c) for a, b, loc, c in rs[item[2]:item[3]] for row in range(a, b)}

    walked = {}
    for it in items:
        for pair in pairs(it, ranges):
            assert pair[:2] not in walked, f"key tile {it[0]}, query row {pair[1]} walked twice"
            walked[pair[:2]] = pair
        part = ranges[it[2]:it[3]]
        assert it[4] == sum(-(-(b - a) // 64) for a, b, _, _ in part)
        assert it[6] == sum(-(-(b - a) // cuda_backend.WS_BWD_WIDE_TILE) for a, b, _, _ in part)
        assert not it[7] or not any(a < s < b for a, b, _, _ in part for s in seg.host_start), (
            f"a part of {it[0]} crosses a segment")
    assert set(walked.values()) == {pair for it in plain for pair in pairs(it, plain_ranges)}
    split = [it for it in items if it[7]]
    per_slot = {}
    for it in split:
        per_slot.setdefault(it[7] >> 20, []).append(it)
    bases = sorted(per_slot)
    assert bases == [sum(len(per_slot[b]) for b in bases[:i]) if per_part else i for i in range(len(bases))]
    for slot, parts in per_slot.items():
        assert len({it[0] for it in parts}) == 1 and all(it[7] & 1023 == len(parts) >= 2 for it in parts)
        assert sorted((it[7] >> 10) & 1023 for it in parts) == list(range(len(parts)))
        rows = sorted(sum(b - a for a, b, _, _ in ranges[it[2]:it[3]]) for it in parts)
        assert all(r >= cuda_backend.WS_SPLIT_MIN_ROWS for r in rows[1:]), f"slot {slot}: parts of {rows} rows"
    assert all(it[5] == 0 for it in items)
    starts = sorted(seg.host_start)
    first = [max(s for s in range(len(starts)) if starts[s] <= next((r[0] for r in ranges[it[2]:it[3]] if not r[3]), it[0]))
             for it in items]
    runs = [g for i, g in enumerate(first) if i == 0 or first[i - 1] != g]
    assert len(runs) == len(set(runs)), "the items of one segment are not neighbours"


@pytest.mark.parametrize("groups", [
    [(300, [5, 200]), (1000, [1, 129, 64])],
    [(262, [1024] * 64)],                            # (64, 262, 1024): a 6-key tail, the prompt tiles split
    [(130, [200] * 48), (5, [3]), (256, [9, 9])],   # a prompt of 5 keys: its only tile is the tail
])
@pytest.mark.parametrize("per_part", [False, True])
def test_ws_prompt_tails_merged(groups, per_part, monkeypatch):
    """A prompt whose length is not a multiple of 128 keeps a tile of its t tail keys that walks
    its own rows only (field 8 = -t); each of its responses' first key tiles holds the t keys (k0 =
    response start - t, field 8 = t, field 9 = the first tail key). Those are the tail's parts:
    field 7 = (slot << 20) | (part << 10) | parts, the tail's own tile part 0, slots after the split
    parts' (per_part: one per 128 // t parts, consecutive). split_by_rows leaves them whole; the switch
    MEGATRON_DUALKV_WS_TAIL=tile keeps the old tiles; a prompt of whole tiles has nothing to merge."""
    seg = make_segments(groups, device="cpu")
    split = (8, 4, 132, per_part)
    items, ranges = cuda_backend.ws_kv_work(seg, split=split)
    tails = cuda_backend._prompt_tails(seg, 128, split)[0]  # where merging pays (test_ws_tail_merge_rule)
    assert tails and all(t == seg.host_length[s] % 128 for s, t in tails.items())
    owners = [it for it in items if it[8] < 0]
    assert sorted(it[0] for it in owners) == sorted(seg.host_start[s] + seg.host_length[s] - t for s, t in tails.items())
    row_slots = cuda_backend.split_slots(items, per_part)
    slot = row_slots
    for owner in sorted(owners, key=lambda it: it[0]):
        s_ = max(s for s in range(len(seg.host_start)) if seg.host_start[s] <= owner[0])
        t = -owner[8]
        assert owner[1] - owner[0] == t and owner[9] == owner[0]
        assert all(r[3] for r in ranges[owner[2]:owner[3]]), "a tail tile walks its children"
        kids = [c for c in range(len(seg.host_start)) if seg.host_parent[c] == s_]
        merged = [it for it in items if it[8] > 0 and it[9] == owner[0]]
        assert sorted(it[0] + t for it in merged) == sorted(seg.host_start[c] for c in kids)
        parts = [owner] + merged
        assert (owner[7] >> 10) & 1023 == 0 and all(it[7] & 1023 == len(parts) for it in parts)
        assert sorted((it[7] >> 10) & 1023 for it in parts) == list(range(len(parts)))
        assert {it[7] >> 20 for it in parts} == {slot}
        for it in merged:
            c = next(c for c in kids if seg.host_start[c] == it[0] + t)
            end = seg.host_start[c] + seg.host_length[c]
            assert it[1] == min(it[0] + 128, end) and ranges[it[2]:it[3]] == [[it[0] + t, end, it[0] + t, 1]]
        slot += -(-len(parts) // (128 // t)) if per_part else 1  # per_part: 128 // t parts' rows to a slot
    assert cuda_backend.tail_slots(items, per_part) == slot - row_slots
    # the split leaves the tails' items whole: the same as in the list without a split
    plain, plain_ranges = cuda_backend.ws_kv_work(seg)
    tail_items = lambda its, rs: sorted((it[0], it[1], it[8], it[9], tuple(map(tuple, rs[it[2]:it[3]])))  # noqa: E731
                                        for it in its if it[8])
    assert tail_items(items, ranges) == tail_items(plain, plain_ranges)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_TAIL", "tile")
    work = cuda_backend.Work(seg, torch.device("cpu"), split=split, merge_tails=cuda_backend.ws_tail_merge())
    assert not any(it[8] for it in work.ws_kv.tolist()) and work.ws_slots[1] == 0
    monkeypatch.setenv("MEGATRON_DUALKV_WS_TAIL", "keep")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_TAIL must be 'merge' or 'tile'"):
        cuda_backend.ws_tail_merge()
    whole = make_segments([(4096, [2048] * 4)], device="cpu")
    assert cuda_backend.ws_kv_work(whole) == cuda_backend.ws_kv_work(whole, merge_tails=False)


def test_ws_tail_merge_rule():
    """A prompt tail is merged where it costs its responses fewer query steps (and CTAs) merged:
    a few keys behind long responses, not a tail of nearly 128 keys (its response tile is nearly all
    tail, and every later tile takes one more partial step); without a split (the tests' and models'
    lists) every tail is merged."""
    pays = cuda_backend._tail_merge_pays
    assert pays(6, [1024] * 64, 4, 64) and pays(6, [1024], 4, 80) and pays(18, [1024] * 16, 4, 64)
    assert not pays(122, [512] * 8, 4, 64) and not pays(104, [1024], 4, 64)
    seg = make_segments([(262, [1024] * 8), (250, [512] * 8)], device="cpu")
    split = (8, 4, 132, True)
    assert cuda_backend._prompt_tails(seg, 128, split)[0] == {0: 6}
    assert cuda_backend._prompt_tails(seg, 128, None)[0] == {0: 6, 9: 122}
    items, _ = cuda_backend.ws_kv_work(seg, split=split)
    assert sorted(it[0] for it in items if it[8] < 0) == [256]
    # the deterministic mode's slots (a part's rows apart) stop at _MAX_TAIL_SLOTS_PER_PART; fast mode's go on
    many = make_segments([(300, [200] * 16)] * 64, device="cpu")
    det_tails, det_slots = cuda_backend._prompt_tails(many, 128, (8, 4, 132, True))
    fast_tails, fast_slots = cuda_backend._prompt_tails(many, 128, (8, 4, 132, False))
    assert det_slots <= cuda_backend._MAX_TAIL_SLOTS_PER_PART < det_slots + 9 and 0 < len(det_tails) < 64
    assert len(fast_tails) == fast_slots == 64
    det_items, _ = cuda_backend.ws_kv_work(many, split=(8, 4, 132, True))
    assert cuda_backend.tail_slots(det_items, True) == det_slots


@pytest.mark.parametrize("groups, local", [
    ([(300, [5, 200]), (1000, [1, 129, 64])], False),
    ([(300, [90] * 6), (1000, [50, 3])], True),
])
def test_ws_forward_key_tile_rule(groups, local, monkeypatch):
    """Work.fwd_mean_keys is the mean over the whole layout's query tiles (a context-parallel rank's
    too: it takes the tile width of the whole micro-batch) of the keys their last row attends,
    rounded up to 64-key tiles per part (the row items' cost); ws_fwd_tile takes 176 keys
    at head dim 128 from WIDE_TILE_KEYS on, the switch forces 128 or 176 (head dim 64: 128 always)
    and names itself when set to anything else; ws_fwd_narrow_tail narrows the parent's partial last
    tile unless forced to key order, and names a bad switch the same way."""
    seg = make_segments(groups, device="cpu")
    chunks = random_chunks(seg.num_tokens, random.Random(3))[1] if local else None
    work = cuda_backend.Work(seg, torch.device("cpu"), chunks)
    items = cuda_backend.row_items(seg, 128)
    exact = [(it[4] - it[3]) + (it[1] - it[2]) for it in items]  # parent keys + own keys up to row q1 - 1
    mean = sum(exact) / len(exact)
    assert mean <= work.fwd_mean_keys < mean + 128
    monkeypatch.delenv("MEGATRON_DUALKV_WS_FWD_TILE", raising=False)
    assert cuda_backend.ws_fwd_tile(work, 128) == 128  # short rows
    long_rows = type("W", (), {"fwd_mean_keys": cuda_backend.WIDE_TILE_KEYS})()
    assert cuda_backend.ws_fwd_tile(long_rows, 128) == 176 and cuda_backend.ws_fwd_tile(long_rows, 64) == 128
    below = type("W", (), {"fwd_mean_keys": cuda_backend.WIDE_TILE_KEYS - 1})()
    assert cuda_backend.ws_fwd_tile(below, 128) == 128
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", "176")
    assert cuda_backend.ws_fwd_tile(work, 128) == 176 and cuda_backend.ws_fwd_tile(work, 64) == 128
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", "128")
    assert cuda_backend.ws_fwd_tile(long_rows, 128) == 128
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TILE", "wide")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_FWD_TILE"):
        cuda_backend.ws_fwd_tile(work, 128)
    # the parent's partial last tile narrowed, unless forced to key order
    monkeypatch.delenv("MEGATRON_DUALKV_WS_FWD_TAIL", raising=False)
    assert cuda_backend.ws_fwd_narrow_tail()
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL", "narrow")
    assert cuda_backend.ws_fwd_narrow_tail()
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL", "full")
    assert not cuda_backend.ws_fwd_narrow_tail()
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_TAIL", "wide")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_FWD_TAIL must be 'auto', 'narrow' or 'full'"):
        cuda_backend.ws_fwd_narrow_tail()
    # persistent CTAs below PERSISTENT_FWD_KEYS[head dim] mean keys, unless forced either way
    monkeypatch.delenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", raising=False)
    limits = cuda_backend.PERSISTENT_FWD_KEYS
    assert limits[64] > limits[128] > 0
    for d, keys in limits.items():
        at = type("W", (), {"fwd_mean_keys": keys})()
        under = type("W", (), {"fwd_mean_keys": keys - 1})()
        assert not cuda_backend.ws_fwd_persistent(at, d) and cuda_backend.ws_fwd_persistent(under, d)
        assert cuda_backend.ws_fwd_persistent(work, d) == (work.fwd_mean_keys < keys)
    between = type("W", (), {"fwd_mean_keys": limits[128]})()  # persistent at head dim 64 only
    assert cuda_backend.ws_fwd_persistent(between, 64) and not cuda_backend.ws_fwd_persistent(between, 128)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", "1")
    assert cuda_backend.ws_fwd_persistent(long_rows, 128) and cuda_backend.ws_fwd_persistent(long_rows, 64)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", "0")
    assert not cuda_backend.ws_fwd_persistent(below, 64)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_FWD_PERSISTENT", "yes")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_FWD_PERSISTENT must be 'auto', '0' or '1'"):
        cuda_backend.ws_fwd_persistent(work, 128)


@pytest.mark.parametrize("groups, hkv, group, parts", [
    ([(512, [32768] * 4)], 4, 8, 4),       # long responses: the long band walks its own rows
    ([(65536, [2048] * 16)], 4, 8, 2),     # a long prompt: own rows half the long band's steps
    ([(65536, [2048] * 16)], 8, 4, 1),     # 4 query heads per kv head: one CTA walks them
    ([(32768, [2048] * 28)], 4, 8, 1),     # the children's walks dominate
    ([(32768, [2048] * 16)], 2, 16, 4),    # a third of the steps own rows, 16 query heads
    ([(32768, [2048] * 28)], 2, 16, 1),    # a fifth: 3.6 heads' own walks
    ([(1000, [8192] * 16)], 4, 8, 1),      # the same, behind a prompt tail
    ([(512, [1024] * 16)], 4, 8, 1),       # split by query rows: no head parts
])
def test_ws_head_parts_rule(groups, hkv, group, parts, monkeypatch):
    """ws_head_parts: head parts per long key tile and kv head at HEAD_PARTS_GROUP query heads per
    kv head or more where a CTA would walk OWN_WALKS heads' own causal rows or more (group x the
    long band's share of steps over causal ranges), as many as leave it 2.5 such walks, never on a
    list split by query rows; the switch forces 1, 2, 4 or 8 where the list allows, names itself
    when it does not divide the group or is anything else. long_band_own_share counts the long
    band's 64-row steps over causal ranges against those over children."""
    seg = make_segments(groups, device="cpu")
    monkeypatch.delenv("MEGATRON_DUALKV_WS_HEAD_PARTS", raising=False)
    work = cuda_backend.Work(seg, torch.device("cpu"), split=(hkv, group, 132, False), phase=True)
    items, ranges = work.ws_kv.tolist(), work.ws_ranges.tolist()
    n_long = items[0][5]
    steps = [(-(-(b - a) // 64), c) for it in items[:n_long] for a, b, _, c in ranges[it[2]:it[3]]]
    own = sum(n for n, c in steps if c)
    assert work.ws_long_items == n_long
    assert work.ws_long_own_share == (own / sum(n for n, _ in steps) if steps else 0.0)
    split = work.ws_slots[0] > 0
    assert cuda_backend.ws_head_parts(work, group) == ((parts, n_long) if parts > 1 else (1, 0))
    assert cuda_backend.ws_head_parts(work, group, split_on=False) == (1, 0)  # MEGATRON_DUALKV_WS_SPLIT=0
    assert parts == 1 or (not split and parts == cuda_backend.auto_head_parts(group, work.ws_long_own_share))
    # the CTA's own walks, group x share: none below 8 query heads or 4 walks, then the fewest parts
    # (powers of two up to 8 dividing the group) that leave 2.5 walks or fewer
    auto = cuda_backend.auto_head_parts
    assert [auto(4, 1.0), auto(8, 0.49), auto(8, 0.5), auto(8, 0.625), auto(8, 0.63), auto(8, 1.0)] == [
        1, 1, 2, 2, 4, 4]
    assert [auto(16, 0.24), auto(16, 0.3), auto(16, 0.33), auto(16, 0.62), auto(16, 0.67)] == [1, 2, 4, 4, 8]
    assert [auto(12, 1.0), auto(10, 1.0), auto(9, 1.0), auto(32, 1.0)] == [4, 2, 1, 8]
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", "2")
    assert cuda_backend.ws_head_parts(work, group) == ((1, 0) if split else (2, n_long))
    assert cuda_backend.ws_head_parts(work, group, split_on=False) == ((1, 0) if split else (2, n_long))
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", "1")
    assert cuda_backend.ws_head_parts(work, group) == (1, 0)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", "8")
    if group % 8:
        with pytest.raises(ValueError, match=f"HEAD_PARTS=8 does not divide the {group} query heads"):
            cuda_backend.ws_head_parts(work, group)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_HEAD_PARTS", "3")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_HEAD_PARTS must be 'auto', '1', '2', '4' or '8'"):
        cuda_backend.ws_head_parts(work, group)


def test_modelled_makespan_follows_the_block_order():
    """The list-scheduling model runs CTAs in bwd_ws_sm90's block order: the long band of every kv
    head and head part, then the rest; a CTA lasts its 64-row query tiles x the heads it walks +
    WS_CTA_OVERHEAD, and a prompt tail's part (field 7 > 0) in the long band is walked whole once."""
    o = cuda_backend.WS_CTA_OVERHEAD
    item = lambda tiles, n_long, field7=0: [0, 128, 0, 1, tiles, n_long, tiles, field7, 0, 0]  # noqa: E731
    items = [item(10, 1), item(2, 1), item(2, 1)]
    makespan = cuda_backend.modelled_makespan
    # group 2 on 2 SMs: 20 + o on one SM, 4 + o twice on the other
    assert makespan(items, 1, 2, 2) == 20 + o
    # two parts: 10 + o each, then the short CTAs one on each SM
    assert makespan(items, 1, 2, 2, parts=2) == 10 + o + 4 + o
    # two kv heads on 2 SMs: the long CTAs of both heads first, then the four short ones
    assert makespan(items, 2, 2, 2) == 20 + o + 2 * (4 + o)
    # a tail's part: part 0 walks it whole, part 1 exits (no CTA time)
    tail = [item(10, 1, field7=(0 << 20) | (0 << 10) | 2), item(2, 1), item(2, 1)]
    assert makespan(tail, 1, 2, 2, parts=2) == makespan(tail, 1, 2, 2) == 20 + o


@pytest.mark.parametrize("hkv, group, shape, whole_parts, row_slots", [
    (1, 4, (28, 16384, 2048), 2, 0),    # 128 long key tiles on 132 SMs: the heaviest sets the end
    (1, 8, (28, 16384, 2048), 2, 0),
    (8, 4, (28, 16384, 2048), 1, 0),    # 8 kv heads: the heaviest CTA under half an SM's share
    (1, 4, (16, 32768, 2048), 1, 0),    # 256 long tiles: parts model no 3 % shorter
    (1, 4, (28, 16384, 1024), 2, 7),    # a split by rows that leaves 1.19x the ideal
    (8, 4, (32, 1024, 1024), 2, 8),     # head parts model within 4 % of the split: it stays
])
def test_ws_balance_head_parts(hkv, group, shape, whole_parts, row_slots, monkeypatch):
    """balance_head_parts on the unsplit list: 1 where the heaviest CTA is half an SM's ideal share
    or less or no count models BALANCE_GAIN shorter, else the fewest parts within 0.5 % of the
    shortest. ws_split's balance: "auto" (fast mode) also replaces a split by query rows where the
    head parts model ROWS_BALANCE_GAIN shorter; "unsplit" (deterministic mode's) never does; "off"
    takes none (the L2 rule's parts only). ws_head_parts takes the more of the L2 rule's and these."""
    n, p, r = shape
    seg = make_segments([(p, [r] * n)], device="cpu")
    whole, _ = cuda_backend.ws_kv_work(seg, phase=True)
    assert cuda_backend.balance_head_parts(whole, hkv, group, 132) == whole_parts
    cpu = torch.device("cpu")
    monkeypatch.setitem(cuda_backend._SM_COUNTS, cpu, 132)
    q, k = torch.empty(1, hkv * group, 8), torch.empty(1, hkv, 8)
    monkeypatch.delenv("MEGATRON_DUALKV_WS_BALANCE", raising=False)
    monkeypatch.delenv("MEGATRON_DUALKV_WS_HEAD_PARTS", raising=False)
    monkeypatch.delenv("MEGATRON_DUALKV_WS_SPLIT_ORDER", raising=False)
    assert cuda_backend.ws_split(q, k) == (hkv, group, 132, False, "auto", "auto")
    assert cuda_backend.ws_split(q, k, per_part=True)[3:] == (True, "unsplit", "segment")
    works = {b: cuda_backend.Work(seg, cpu, split=(hkv, group, 132, False, b), phase=True)
             for b in ("auto", "unsplit", "off")}
    makespan = cuda_backend.modelled_makespan
    rows, _ = cuda_backend.ws_kv_work(seg, split=(hkv, group, 132, False, "unsplit"))
    replaced = row_slots > 0 and whole_parts > 1 and (
        makespan(whole, hkv, group, 132, whole_parts) < (1 - cuda_backend.ROWS_BALANCE_GAIN) * makespan(rows, hkv, group, 132))
    assert works["unsplit"].ws_slots[0] == works["off"].ws_slots[0] == row_slots
    assert works["auto"].ws_slots[0] == (0 if replaced else row_slots)
    assert replaced == (shape == (28, 16384, 1024))
    for b, work in works.items():
        l2 = cuda_backend.auto_head_parts(group, work.ws_long_own_share)
        balanced = whole_parts if b != "off" and not work.ws_slots[0] else 1
        assert work.ws_balance_parts == balanced, b
        parts = 1 if work.ws_slots[0] else max(l2, balanced)
        assert cuda_backend.ws_head_parts(work, group) == ((parts, work.ws_long_items) if parts > 1 else (1, 0)), b
    monkeypatch.setenv("MEGATRON_DUALKV_WS_BALANCE", "off")
    assert cuda_backend.ws_split(q, k)[4] == "off"
    monkeypatch.setenv("MEGATRON_DUALKV_WS_BALANCE", "1")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_BALANCE must be 'auto', 'unsplit' or 'off', got '1'"):
        cuda_backend.ws_split(q, k)


@pytest.mark.parametrize("hkv, group, shape, parts, split, beside", [
    (1, 4, (28, 16384, 2048), 2, False, True),    # head parts for balance
    (2, 4, (32, 8192, 1024), 2, False, True),
    (1, 4, (28, 16384, 1024), 1, True, True),     # deterministic mode keeps its split by query rows
    (4, 8, (16, 65536, 1024), 4, False, False),   # head parts for L2 alone
    (8, 4, (28, 16384, 2048), 1, False, False),   # one CTA per key tile, no split
])
def test_ws_dq_beside(hkv, group, shape, parts, split, beside, monkeypatch):
    """ws_dq_beside on the deterministic lists (what forward() builds): the dQ kernel beside the
    dK/dV kernel's last wave where key tiles split by query rows or the long band runs in head parts
    for balance, not where the parts are for L2 alone or nothing is split."""
    n, p, r = shape
    seg = make_segments([(p, [r] * n)], device="cpu")
    cpu = torch.device("cpu")
    monkeypatch.setitem(cuda_backend._SM_COUNTS, cpu, 132)
    for var in ("MEGATRON_DUALKV_WS_BALANCE", "MEGATRON_DUALKV_WS_HEAD_PARTS", "MEGATRON_DUALKV_WS_SPLIT_ORDER"):
        monkeypatch.delenv(var, raising=False)
    lists = cuda_backend.ws_split(torch.empty(1, hkv * group, 8), torch.empty(1, hkv, 8), per_part=True)
    work = cuda_backend.Work(seg, cpu, split=lists)
    assert (cuda_backend.ws_head_parts(work, group)[0], bool(work.ws_slots[0])) == (parts, split)
    assert cuda_backend.ws_dq_beside(work, parts) == beside


@pytest.mark.parametrize("hq, hkv, groups, shape, deterministic, parts", [
    (32, 4, 8, (16, 1024, 2048), False, 2),   # 18 steps a head: measured bwd 0.94-0.97
    (16, 2, 8, (16, 1024, 2048), False, 2),
    (32, 2, 8, (16, 1024, 2048), False, 4),   # group 16: 4 parts of 4 heads (measured 0.83; 2: 0.90)
    (32, 4, 4, (16, 1024, 1536), False, 2),   # 14 steps
    (32, 4, 8, (16, 1024, 1024), False, 2),   # 9.6 steps (measured 0.909)
    (32, 4, 4, (32, 1024, 1024), False, 2),   # 9.6 steps (measured 0.930)
    (32, 4, 8, (8, 2048, 1024), False, 2),    # 8.5 steps (measured 0.952)
    (16, 2, 8, (16, 2048, 1024), False, 2),   # (measured 0.955)
    (32, 2, 8, (16, 1024, 1024), False, 4),   # group 16 (measured 0.874; 2 parts 0.929)
    (32, 4, 8, (16, 512, 1024), False, 1),    # fast mode runs the deterministic kernels: no parts
    (32, 4, 4, (8, 2048, 8192), False, 1),    # 60 steps (measured level)
    (32, 2, 4, (8, 2048, 8192), False, 4),    # 60 steps at group 16 (measured 0.95)
    (32, 2, 8, (16, 512, 1024), False, 1),    # the deterministic kernels (parts there measured 1.04-1.08)
    (16, 1, 8, (16, 1024, 2048), False, 4),   # one kv head, store-and-ticket sums (measured 0.936)
    (16, 1, 8, (16, 1024, 1536), False, 4),   # (measured 0.991)
    (16, 1, 4, (16, 2048, 4096), False, 4),   # (measured 0.970)
    (8, 1, 8, (16, 1024, 2048), False, 2),    # (measured 0.989; 1.014 with atomic sums)
    (16, 4, 8, (16, 1024, 2048), False, 1),   # group 4 (measured 1.09)
    (32, 8, 8, (16, 1024, 2048), False, 1),
    (32, 4, 8, (16, 1024, 2048), True, 1),    # deterministic (measured 1.05)
    (32, 4, 1, (28, 4096, 2048), False, 2),   # one group, second band a fifth of the steps (0.97)
    (32, 4, 1, (16, 32768, 2048), False, 1),  # second band 2 % of the steps (measured level)
    (32, 4, 1, (64, 256, 1024), False, 1),    # split by query rows
])
def test_ws_rest_parts_rule(hq, hkv, groups, shape, deterministic, parts, monkeypatch):
    """auto_rest_parts on the lists forward() builds (132 SMs; fast mode's lists are the
    deterministic ones where it runs the deterministic kernels, fast_bwd_separate_dq): group / 4
    parts at 8 query heads per kv head or more on fast-mode unsplit lists whose second band walks REST_PARTS_MIN_STEPS to
    REST_PARTS_MAX_STEPS_PER_HEAD x group steps per head on average and holds REST_PARTS_SHARE of
    the steps; ws_rest_parts gives it under auto; the slots (parts - 1 an item) take about
    2 (parts - 1) / group of the fp32 dQ sums' memory."""
    cpu = torch.device("cpu")
    monkeypatch.setitem(cuda_backend._SM_COUNTS, cpu, 132)
    for var in ("MEGATRON_DUALKV_WS_REST_PARTS", "MEGATRON_DUALKV_WS_HEAD_PARTS", "MEGATRON_DUALKV_WS_BALANCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MEGATRON_DUALKV_FAST_BWD", "auto")  # fast mode's own choice, as in training
    n, p, r = shape  # the layouts timed: bench_kernel.py --groups G --spread 0.5 (one group: no spread)
    spread = 0.5 if groups > 1 else 0.0
    seg = make_segments([(p, bench_kernel.response_lengths(n, r, spread, g)) for g in range(groups)], device="cpu")
    deterministic = deterministic or cuda_backend.fast_bwd_separate_dq(seg, 128)  # as forward() decides
    split = cuda_backend.ws_split(torch.empty(1, hq, 8), torch.empty(1, hkv, 8), per_part=deterministic)
    work = cuda_backend.Work(seg, cpu, split=split, phase=not deterministic)
    assert work.ws_rest_parts == parts
    assert cuda_backend.ws_rest_parts(work, hq // hkv) == parts
    if parts > 1:  # fast mode: parts - 1 slots [hkv, 2, 128, D] per item (a key tile of a segment;
        # at most T / 128 + segments) beside the dQ sums [T, hq, D]: about 2 (parts - 1) / group of their size
        slots = len(work.ws_kv) * (parts - 1)
        assert slots * hkv * 2 * 128 <= 2 * (parts - 1) / (hq // hkv) * (seg.num_tokens + 128 * len(seg.host_start)) * hq


@pytest.mark.parametrize("shape, split", [((28, 4096, 2048), False), ((64, 256, 1024), True)])
def test_ws_rest_parts(shape, split, monkeypatch):
    """ws_rest_parts: the second band's head parts, auto's (Work.ws_rest_parts) unless forced, 1
    on lists split by query rows (their walks are short already); the switch forces 1, 2, 4 or 8
    where the list allows them and names itself when it does not divide the group or is anything
    else."""
    n, p, r = shape
    seg = make_segments([(p, [r] * n)], device="cpu")
    cpu = torch.device("cpu")
    monkeypatch.setitem(cuda_backend._SM_COUNTS, cpu, 132)
    monkeypatch.delenv("MEGATRON_DUALKV_WS_REST_PARTS", raising=False)
    work = cuda_backend.Work(seg, cpu, split=cuda_backend.ws_split(torch.empty(1, 32, 8), torch.empty(1, 4, 8)))
    assert bool(work.ws_slots[0]) == split
    assert cuda_backend.ws_rest_parts(work, 8) == work.ws_rest_parts == (1 if split else 2)
    for forced in (1, 2, 4, 8):
        monkeypatch.setenv("MEGATRON_DUALKV_WS_REST_PARTS", str(forced))
        assert cuda_backend.ws_rest_parts(work, 8) == (1 if split else forced)
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_REST_PARTS=8 does not divide the 4 query heads"):
        cuda_backend.ws_rest_parts(work, 4)
    monkeypatch.setenv("MEGATRON_DUALKV_WS_REST_PARTS", "3")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_REST_PARTS must be 'auto', '1', '2', '4' or '8'"):
        cuda_backend.ws_rest_parts(work, 8)


@pytest.mark.parametrize("hkv, group, shape, reordered", [
    (1, 4, (8, 1000, 3000), True),      # one kv head: the segment order models 1.31x heaviest first
    (1, 8, (16, 1024, 2048), False),    # 1.21x: kept (measured 4 % slower heaviest first)
    (8, 4, (64, 256, 1024), False),     # 8 kv heads: 1.02x
])
def test_ws_split_order(hkv, group, shape, reordered, monkeypatch):
    """A split list's order: by segment (L2), unless the segment order models SPLIT_ORDER_GAP
    longer than heaviest first (order "auto"); "work" always heaviest first, "segment" never. Both
    orders hold the same items. ws_split asks "auto" in fast mode and "segment" in deterministic
    mode; the switch names itself when it is anything else."""
    n, p, r = shape
    seg = make_segments([(p, [r] * n)], device="cpu")
    lists = {o: cuda_backend.ws_kv_work(seg, split=(hkv, group, 132, False, "unsplit", o))[0]
             for o in ("segment", "auto", "work")}
    cta = lambda it: it[4] * group + cuda_backend.WS_CTA_OVERHEAD  # noqa: E731
    assert cuda_backend.split_slots(lists["segment"]) > 0
    assert sorted(map(tuple, lists["work"])) == sorted(map(tuple, lists["segment"]))
    assert [cta(it) for it in lists["work"]] == sorted((cta(it) for it in lists["work"]), reverse=True)
    assert lists["work"] != lists["segment"]
    span = lambda items: cuda_backend.modelled_makespan(items, hkv, group, 132)  # noqa: E731
    assert (span(lists["segment"]) > (1 + cuda_backend.SPLIT_ORDER_GAP) * span(lists["work"])) == reordered
    assert lists["auto"] == (lists["work"] if reordered else lists["segment"])
    cpu = torch.device("cpu")
    monkeypatch.setitem(cuda_backend._SM_COUNTS, cpu, 132)
    q, k = torch.empty(1, hkv * group, 8), torch.empty(1, hkv, 8)
    monkeypatch.delenv("MEGATRON_DUALKV_WS_SPLIT_ORDER", raising=False)
    assert [cuda_backend.ws_split(q, k, per_part=d)[5] for d in (False, True)] == ["auto", "segment"]
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT_ORDER", "work")
    assert [cuda_backend.ws_split(q, k, per_part=d)[5] for d in (False, True)] == ["work", "work"]
    monkeypatch.setenv("MEGATRON_DUALKV_WS_SPLIT_ORDER", "lpt")
    with pytest.raises(ValueError, match="MEGATRON_DUALKV_WS_SPLIT_ORDER must be 'auto', 'segment' or 'work'"):
        cuda_backend.ws_split(q, k)


@pytest.mark.parametrize("groups, local", [
    ([(4096, [2048] * 28)], False),
    ([(700, [5, 300]), (3000, [64] * 9), (40, [1]), (9, [])], False),
    ([(300, [90] * 6), (1000, [50, 3])], True),  # a context-parallel rank's rows
])
def test_ws_phase_walks(groups, local):
    """With phase=True every key tile with children (a prompt's) lists its child ranges first and
    its own after them, the same (key tile, query row) pairs as without; field 7 = -1 - slot, one
    slot per prompt, numbered from 0; the other items are unchanged. A list that splits keeps its
    split (phase needs every CTA of a prompt to walk the same child steps)."""
    seg = make_segments(groups, device="cpu")
    chunks = random_chunks(seg.num_tokens, random.Random(3))[1] if local else None
    plain, plain_ranges = cuda_backend.ws_kv_work(seg, chunks, merge_tails=False)
    items, ranges = cuda_backend.ws_kv_work(seg, chunks, phase=True, merge_tails=False)
    assert [it[:7] for it in items] == [it[:7] for it in plain]
    assert cuda_backend.split_slots(items) == 0, "a phase-aligned walk counted as a split part"
    slot_of = {}
    for it, old in zip(items, plain):
        rs, old_rs = ranges[it[2]:it[3]], plain_ranges[old[2]:old[3]]
        assert sorted(map(tuple, rs)) == sorted(map(tuple, old_rs))
        kids = [r for r in rs if not r[3]]
        if not kids:
            assert it[7] == 0 and rs == old_rs
            continue
        assert rs == kids + [r for r in rs if r[3]], f"key tile {it[0]}: own rows before its children"
        assert it[7] < 0
        prompt = max(s for s in seg.host_start if s <= it[0])
        assert slot_of.setdefault(prompt, -1 - it[7]) == -1 - it[7], f"two slots for the prompt at {prompt}"
    assert sorted(slot_of.values()) == list(range(len(slot_of))) and len(slot_of) == len(set(slot_of.values()))
    assert set(slot_of) == {max(s for s in seg.host_start if s <= it[0]) for it in plain
                            if any(not r[3] for r in plain_ranges[it[2]:it[3]])}
    split = cuda_backend.ws_kv_work(seg, chunks, split=(8, 4, 132), merge_tails=False)
    if cuda_backend.split_slots(split[0]):
        assert cuda_backend.ws_kv_work(seg, chunks, split=(8, 4, 132), phase=True, merge_tails=False) == split


@pytest.mark.parametrize("reads", [cuda_backend.WS_LIST_FORMAT, 1, None])
def test_a_stale_extension_is_refused(reads, monkeypatch):
    """The package uses a built extension only when it reads the work-list format the package
    writes (a stale build would take a phase-aligned walk's field 7 for a split part and write
    outside its workspace); otherwise the reason names the formats and how to rebuild."""
    class Ops:
        pass

    ops = Ops()
    if reads is not None:
        ops.ws_list_format = lambda: reads
    monkeypatch.setattr(torch.ops, "megatron_dualkv", ops)
    why = cuda_backend._list_format_problem()
    if reads == cuda_backend.WS_LIST_FORMAT:
        assert why == ""
    else:
        assert "stale" in why and f"format {cuda_backend.WS_LIST_FORMAT}" in why and "build_ext.py" in why
        assert ("no ws_list_format op" in why) if reads is None else (f"format {reads}," in why)


def test_query_chunks_reject_bad_rows():
    assert cuda_backend.query_chunks(torch.tensor([0, 1, 2, 5, 6, 9]), 10) == ((0, 3, 0), (5, 7, 3), (9, 10, 5))
    for bad in ([3, 2], [1, 1], [-1, 0], [9, 10]):
        with pytest.raises(ValueError, match="ascending, unique packed rows"):
            cuda_backend.query_chunks(torch.tensor(bad), 10)


def test_work_lists_reject_deeper_trees():
    deep = SegmentTable.from_host([0, 4, 8], [4, 4, 5], [-1, 0, 1])
    with pytest.raises(ValueError, match="depth"):
        cuda_backend.build_work(deep)


def test_extra_builds_are_named_and_checked_for_form():
    """MEGATRON_DUALKV_CUDA_LIB_EXTRA: NAME=PATH items (a second build beside the default one, for
    timing two builds in one process); a malformed item, the default namespace or a name given
    twice is an error naming the variable."""
    assert cuda_backend.extra_builds("") == []
    assert cuda_backend.extra_builds("old=/a/_C.so, b2=/b/_C.so") == [("old", "/a/_C.so"), ("b2", "/b/_C.so")]
    for bad, says in [("/a/_C.so", "is not NAME=PATH"), ("2nd=/a/_C.so", "is not NAME=PATH"), ("old=", "is not NAME=PATH"),
                      ("megatron_dualkv=/a/_C.so", "namespace of its own"), ("old=/a,old=/b", "named twice")]:
        with pytest.raises(ValueError, match="MEGATRON_DUALKV_CUDA_LIB_EXTRA") as err:
            cuda_backend.extra_builds(bad)
        assert says in str(err.value)


def test_extra_build_without_its_namespace_is_refused_unloaded(tmp_path, monkeypatch):
    """A file without its namespace's registration function is refused before it is loaded (a
    default build loaded a second time would abort the process registering megatron_dualkv again);
    one that holds it but is no library names the path; a missing file names it too."""
    plain = tmp_path / "plain.so"
    plain.write_bytes(b"\x7fELF mdkv_old\0 _ZL35TORCH_LIBRARY_init_megatron_dualkvRN5torch7LibraryE\0")
    monkeypatch.setenv("MEGATRON_DUALKV_CUDA_LIB_EXTRA", f"mdkv_old={plain}")
    assert cuda_backend._load_extra_builds() == (
        f"MEGATRON_DUALKV_CUDA_LIB_EXTRA: {plain} registers no ops under 'mdkv_old' "
        "(build it with csrc/build_ext.py --ops-namespace mdkv_old)")
    fake = tmp_path / "fake.so"
    fake.write_bytes(b"not a library, but it holds _ZL26TORCH_LIBRARY_init_mdkv_oldRN5torch7LibraryE\0")
    monkeypatch.setenv("MEGATRON_DUALKV_CUDA_LIB_EXTRA", f"mdkv_old={fake}")
    assert cuda_backend._load_extra_builds().startswith(f"MEGATRON_DUALKV_CUDA_LIB_EXTRA: cannot load {fake}")
    monkeypatch.setenv("MEGATRON_DUALKV_CUDA_LIB_EXTRA", f"mdkv_old={tmp_path / 'gone.so'}")
    assert cuda_backend._load_extra_builds().startswith(f"MEGATRON_DUALKV_CUDA_LIB_EXTRA: cannot read {tmp_path / 'gone.so'}")


def test_ops_namespace_names_a_build_that_is_not_loaded(monkeypatch):
    """MEGATRON_DUALKV_OPS picks the build a call runs on: unset, the default; a namespace with no
    ops loaded is an error naming the variable and the extra builds named."""
    monkeypatch.delenv("MEGATRON_DUALKV_OPS", raising=False)
    assert cuda_backend.ops_namespace() == "megatron_dualkv"
    monkeypatch.setenv("MEGATRON_DUALKV_OPS", "megatron_dualkv")
    assert cuda_backend.ops_namespace() == "megatron_dualkv"
    monkeypatch.setenv("MEGATRON_DUALKV_OPS", "mdkv_not_loaded")
    monkeypatch.setenv("MEGATRON_DUALKV_CUDA_LIB_EXTRA", "mdkv_old=/nowhere/_C.so")
    with pytest.raises(ValueError, match=r"MEGATRON_DUALKV_OPS=mdkv_not_loaded: no build is loaded .*\['mdkv_old'\]"):
        cuda_backend.ops_namespace()
