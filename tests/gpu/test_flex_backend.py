"""GPU tests of the FlexAttention backend (megatron_dualkv.ops.flex_backend); skipped without CUDA.

Every case draws fresh random inputs and compares out, dq, dk, dv with the exact float64
reference (megatron_dualkv.ops.reference_attention). The bar for bf16/fp16 is the error of the
replicated batch through torch SDPA (each response as its own causal [prompt | response]
sequence, prompt rows read from the first copy, so it is the same function of q, k, v) against
the same float64 truth: Flex may not be worse than that.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

from local_query_rows import cp_like_rows  # tests/ (the root conftest's directory) is on sys.path
from megatron_dualkv.layout import SegmentTable
from megatron_dualkv.ops import flex_backend
from megatron_dualkv.ops.reference import reference_attention

_ok, _why = flex_backend.is_available(torch.empty(1, 1, 64, device="cuda", dtype=torch.bfloat16)) \
    if torch.cuda.is_available() else (False, "no CUDA device")
pytestmark = pytest.mark.skipif(not _ok, reason=f"FlexAttention backend unavailable: {_why}")

SLACK = 1.05  # allowed ratio to the replicated SDPA error (one random draw's noise)


def make_segments(groups, pad=0, device="cuda"):
    """groups: [(P, [R_1, ..., R_N]), ...]; pad: a trailing padding root segment."""
    return SegmentTable.from_group_lengths(groups, pad, device)

def random_groups(rng, num_groups, max_p=1200, max_r=300, max_n=6):
    groups = []
    for _ in range(num_groups):
        p = rng.randrange(1, max_p) | 1  # odd prompt lengths
        rs = [1] + [rng.randint(1, max_r) for _ in range(rng.randint(0, max_n - 1))]
        rng.shuffle(rs)
        groups.append((p, rs))
    return groups


def replicated_sdpa(q, k, v, seg, scale):
    """The replicated batch through SDPA, mapped back to packed rows (prompt rows from copy 0)."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    rows_done = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    for s, par in enumerate(seg.host_parent):
        if par < 0 and not any(p == s for p in seg.host_parent):  # childless root (padding)
            idx = torch.arange(seg.host_start[s], seg.host_start[s] + seg.host_length[s], device=q.device)
        elif par < 0:
            continue
        else:
            p0, pn = seg.host_start[par], seg.host_length[par]
            idx = torch.cat([torch.arange(p0, p0 + pn), torch.arange(seg.host_start[s], seg.host_start[s] + seg.host_length[s])]).to(q.device)
        qs = q[idx].transpose(0, 1)[None]
        ks = k[idx].repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        vs = v[idx].repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1)
        keep = ~rows_done[idx]  # first copy of the prompt rows, every response row
        out = out.index_put((idx[keep],), o[keep])
        rows_done[idx] = True
    assert bool(rows_done.all())
    return out


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def run_case(groups, hq, hkv, d, dtype, pad=0, kernel=None):
    seg = make_segments(groups, pad)
    t = seg.num_tokens
    scale = 1.0 / math.sqrt(d)
    q, k, v = (torch.randn(t, h, d, device="cuda").to(dtype).requires_grad_() for h in (hq, hkv, hkv))
    dout = torch.randn(t, hq, d, device="cuda").to(dtype)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, seg, scale)
    truth = (ref.detach(), *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))

    out = flex_backend.attention(q, k, v, seg, scale, kernel=kernel)
    assert out.shape == (t, hq, d) and out.dtype == dtype
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    rout = replicated_sdpa(q, k, v, seg, scale)
    base = (rout.detach(), *torch.autograd.grad(rout, (q, k, v), dout))

    names = ("out", "dq", "dk", "dv")
    errs = {n: (rel(g, tr), rel(b, tr)) for n, g, b, tr in zip(names, got, base, truth)}
    print(f"\n  T={t} Hq={hq} Hkv={hkv} d={d} {dtype}: " +
          ", ".join(f"{n} flex {e:.2e} / sdpa {r:.2e}" for n, (e, r) in errs.items()))
    for n, (e, r) in errs.items():
        assert math.isfinite(e), f"{n}: non-finite"
        assert e <= SLACK * r, f"{n}: flex error {e:.3e} > {SLACK} x replicated SDPA error {r:.3e}"
    return errs


@pytest.mark.parametrize("dtype,d,hq,hkv,num_groups", [
    (torch.bfloat16, 128, 8, 2, 3),
    (torch.float16, 64, 6, 2, 2),
    (torch.bfloat16, 64, 6, 2, 4),
    (torch.float16, 128, 8, 2, 1),
])
def test_matches_float64_like_replicated_sdpa(dtype, d, hq, hkv, num_groups):
    rng = random.Random(zlib.crc32(f"{dtype}{d}{hq}{num_groups}".encode()))
    run_case(random_groups(rng, num_groups), hq, hkv, d, dtype, pad=rng.choice([0, 5]))


def test_float32_matches_float64():
    seg = make_segments([(257, [1, 130, 64]), (31, [3, 200])])
    t, scale = seg.num_tokens, 0.11
    q, k, v = (torch.randn(t, h, 64, device="cuda", requires_grad=True) for h in (4, 2, 2))
    dout = torch.randn(t, 4, 64, device="cuda")
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, seg, scale)
    truth = (ref.detach(), *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))
    out = flex_backend.attention(q, k, v, seg, scale)
    got = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    for name, g, tr in zip(("out", "dq", "dk", "dv"), got, truth):
        assert rel(g, tr) < 1e-4, f"{name}: {rel(g, tr):.2e}"


def test_new_lengths_do_not_recompile():
    """Policy: one compilation per static configuration, none per packed length or layout."""
    from torch._dynamo.utils import counters

    rng = random.Random(7)
    hq, hkv, d = 8, 2, 128
    dtype = torch.bfloat16
    run_case([(129, [1, 40])], hq, hkv, d, dtype)  # compiles this configuration if still new
    graphs, configs = counters["stats"]["unique_graphs"], flex_backend.compiled_count()
    lengths = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n_groups in (1, 2, 3, 1, 4):
            groups = random_groups(rng, n_groups, max_p=2000, max_r=400)
            seg = make_segments(groups)
            t = seg.num_tokens
            lengths.append(t)
            q, k, v = (torch.randn(t, h, d, device="cuda").to(dtype).requires_grad_() for h in (hq, hkv, hkv))
            out = flex_backend.attention(q, k, v, seg, 1.0 / math.sqrt(d))
            out.float().square().sum().backward()
            assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert len(set(lengths)) == len(lengths)
    assert counters["stats"]["unique_graphs"] == graphs, f"recompiled for lengths {lengths}"
    assert flex_backend.compiled_count() == configs


def test_block_mask_is_built_at_block_level():
    """A 98K-token micro-batch (the published (16, 65536, R=2048) shape): the mask costs MBs,
    not the 60 GiB of a dense T x T mask, and is built once per micro-batch."""
    seg = make_segments([(65536, [2048] * 16)])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    padded, mask = flex_backend.cached_block_mask(seg)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < 512 * 2**20, f"block mask build peaked at {peak / 2**20:.0f} MiB"
    assert padded.num_tokens == seg.num_tokens == 98304
    assert flex_backend.cached_block_mask(seg)[1] is mask
    nb = 98304 // 128
    assert mask.kv_num_blocks.shape == (1, 1, nb)
    # prompt rows: causal (1 partial diagonal block per row); response rows: prompt blocks full
    assert int(mask.kv_num_blocks[0, 0, : 512].max()) == 1
    assert int(mask.full_kv_num_blocks[0, 0, 600]) == 512 + (600 - 512) % 16


@pytest.mark.skipif(not flex_backend.flash_installed(), reason="flash-attn-4 (flash_attn.cute) not installed")
def test_flash_kernel_matches_float64_like_replicated_sdpa():
    rng = random.Random(11)
    run_case(random_groups(rng, 2), 8, 2, 128, torch.bfloat16, kernel="FLASH")


@pytest.mark.parametrize("kernel", ["TRITON", "FLASH"])
def test_local_queries_match_float64_like_the_full_batch(kernel):
    """Local queries (context parallelism: q holds some rows, k and v all) through each kernel.
    The full batch with dout zero outside those rows is the same function, so its error against
    float64 is the bar for every output and gradient."""
    if kernel == "FLASH":
        problem = flex_backend.flash_problem(torch.device("cuda"), torch.bfloat16)
        if problem:
            pytest.skip(problem)
    seg = make_segments([(300, [1, 40, 129]), (77, [200, 3])], pad=5)
    t, hq, hkv, d, scale = seg.num_tokens, 8, 2, 128, 0.1
    rows = cp_like_rows(t, seed=23)
    q, k, v = (torch.randn(t, h, d, device="cuda").to(torch.bfloat16).requires_grad_() for h in (hq, hkv, hkv))
    dout = torch.zeros(t, hq, d, device="cuda", dtype=torch.bfloat16)
    dout[rows] = torch.randn(len(rows), hq, d, device="cuda").to(torch.bfloat16)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, seg, scale)
    t_out, t_dq, t_dk, t_dv = ref.detach(), *torch.autograd.grad(ref, (q64, k64, v64), dout.double())

    full = flex_backend.attention(q, k, v, seg, scale, kernel=kernel)
    f_dq, f_dk, f_dv = torch.autograd.grad(full, (q, k, v), dout)
    bar = {"out": rel(full.detach()[rows], t_out[rows]), "dq": rel(f_dq[rows], t_dq[rows]),
           "dk": rel(f_dk, t_dk), "dv": rel(f_dv, t_dv)}

    q_loc = q.detach()[rows].requires_grad_()
    out = flex_backend.attention(q_loc, k, v, seg, scale, kernel=kernel, q_rows=rows)
    assert out.shape == (len(rows), hq, d)
    l_dq, l_dk, l_dv = torch.autograd.grad(out, (q_loc, k, v), dout[rows])
    got = {"out": rel(out.detach(), t_out[rows]), "dq": rel(l_dq, t_dq[rows]), "dk": rel(l_dk, t_dk),
           "dv": rel(l_dv, t_dv)}
    print(f"\n  {kernel} local queries ({len(rows)} of {t} rows): " +
          ", ".join(f"{n} {got[n]:.2e} / full {bar[n]:.2e}" for n in got))
    for n in got:
        assert math.isfinite(got[n]) and got[n] <= 1.5 * bar[n] + 1e-6, f"{n}: {got[n]:.3e} vs full batch {bar[n]:.3e}"
