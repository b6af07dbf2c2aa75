"""Reference DualKV attention against a float64 dense masked softmax built independently."""

import math

import pytest
import torch

from megatron_dualkv import build_layout
from megatron_dualkv.ops import dualkv_attention, reference_attention


def _dense_replicated(q, k, v, groups):
    """Each response as its own causal [prompt | response] sequence: the replicated batch."""
    outs = {}
    rep = q.shape[1] // k.shape[1]
    pos = 0
    for p, rs in groups:
        prompt = list(range(pos, pos + len(p)))
        pos += len(p)
        for r in rs:
            resp = list(range(pos, pos + len(r)))
            pos += len(r)
            rows = torch.tensor(prompt + resp)
            qs, ks, vs = q[rows], k[rows].repeat_interleave(rep, 1), v[rows].repeat_interleave(rep, 1)
            s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
            n = len(rows)
            s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs)
            for i, row in enumerate(rows.tolist()):
                outs.setdefault(row, o[i])  # prompt rows are equal in every copy
    return torch.stack([outs[i] for i in range(pos)])


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 8), (6, 2, 16), (4, 1, 5)])
def test_reference_equals_replicated_batch(hq, hkv, d):
    groups = [([1, 2, 3, 4, 5], [[6], [7, 8, 9], [1, 2]]), ([3], [[4, 4, 4, 4]]), ([5, 6], [[1]])]
    lay = build_layout(groups)
    t = lay.num_tokens
    q = torch.randn(t, hq, d, dtype=torch.float64)
    k = torch.randn(t, hkv, d, dtype=torch.float64)
    v = torch.randn(t, hkv, d, dtype=torch.float64)
    out, lse = reference_attention(q, k, v, lay.segments, query_chunk=3)
    expect = _dense_replicated(q, k, v, groups)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    assert lse.shape == (hq, t) and torch.isfinite(lse).all()
    torch.testing.assert_close(dualkv_attention(q, k, v, lay, backend="reference"), expect, rtol=1e-12, atol=1e-12)


def test_reference_gradients_equal_replicated_batch():
    groups = [([1, 2, 3], [[6, 7], [7]]), ([3, 4], [[4, 4, 4]])]
    lay = build_layout(groups)
    t = lay.num_tokens
    args = [torch.randn(t, h, 4, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    w = torch.randn(t, 4, 4, dtype=torch.float64)
    (reference_attention(*args, lay.segments)[0] * w).sum().backward()
    got = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    # replicated: prompt rows appear N times but their output is counted once (the packed loss)
    (_dense_replicated(*args, groups) * w).sum().backward()
    for g, a in zip(got, args):
        torch.testing.assert_close(g, a.grad, rtol=1e-12, atol=1e-12)


def test_wrong_mask_would_be_caught():
    """A full (non-causal) response mask must differ from the reference: the test can fail."""
    groups = [([1, 2], [[3, 4, 5]])]
    lay = build_layout(groups)
    q, k, v = (torch.randn(5, 2, 4, dtype=torch.float64) for _ in range(3))
    out, _ = reference_attention(q, k, v, lay.segments)
    s = torch.einsum("qhd,khd->hqk", q, k) / 2.0
    full = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    assert not torch.allclose(out, full)


def test_entry_point_rejects_mismatched_shapes():
    lay = build_layout([([1, 2], [[3]])])
    q = torch.randn(4, 2, 4)
    with pytest.raises(ValueError, match="4, 4, 4 tokens but the layout packs 3"):
        dualkv_attention(q, q, q, lay)
    with pytest.raises(ValueError, match="GQA"):
        dualkv_attention(torch.randn(3, 3, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), lay)
