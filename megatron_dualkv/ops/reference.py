"""Exact DualKV attention in plain PyTorch: the definition every other backend is tested against.

Runs on any device and dtype (float64 included), any head dim, GQA; differentiable through
autograd. Memory is O(chunk x tree) per head, so it is meant for tests and small problems.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..layout import SegmentTable


def _ancestor_matrix(segments: SegmentTable, device: torch.device) -> Tensor:
    """anc[s, a] is True when a is a strict ancestor of s."""
    n = segments.num_segments
    anc = torch.zeros(n, n, dtype=torch.bool)
    for s in range(n):
        for a in segments.ancestors(s):
            anc[s, a] = True
    return anc.to(device)


def allowed_mask(segments: SegmentTable, rows: Tensor, cols: Tensor) -> Tensor:
    """bool [len(rows), len(cols)]: may query token `rows[i]` attend key token `cols[j]`."""
    seg = segments.token_segment_ids().to(rows.device)
    anc = _ancestor_matrix(segments, rows.device)
    sr, sc = seg[rows], seg[cols]
    same = (sr[:, None] == sc[None, :]) & (cols[None, :] <= rows[:, None])
    return same | anc[sr[:, None], sc[None, :]]


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segments: SegmentTable,
    softmax_scale: Optional[float] = None,
    query_chunk: int = 1024,
    q_rows: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """out [T, Hq, D] (q's dtype) and lse [Hq, T] (float32, or float64 for float64 inputs).

    q_rows: int64 [Tq], the packed rows of the queries when q holds only some of them (context
    parallelism: a rank's local queries against the gathered k, v of all T rows); then out is
    [Tq, Hq, D] and lse [Hq, Tq].
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q_rows is not None:
        t = k.shape[0]
        if q_rows.dim() != 1 or q_rows.shape[0] != q.shape[0]:
            raise ValueError(f"q_rows must be [{q.shape[0]}] (one packed row per query), got {tuple(q_rows.shape)}")
    if k.shape[0] != t or v.shape[0] != t or segments.num_tokens != t or (q_rows is None and q.shape[0] != t):
        raise ValueError(
            f"q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]} tokens; the layout has {segments.num_tokens}"
        )
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = hq // hkv
    kk = k.to(compute).repeat_interleave(rep, dim=1)
    vv = v.to(compute).repeat_interleave(rep, dim=1)
    qq = q.to(compute)
    seg = segments.token_segment_ids().to(q.device)
    anc = _ancestor_matrix(segments, q.device)

    # (query positions in q, their packed rows, key range): queries only see keys of their tree
    blocks = []
    trees = segments.tree_ranges()
    if q_rows is None:
        for lo, hi in trees:
            for a in range(lo, hi, query_chunk):
                b = min(a + query_chunk, hi)
                blocks.append((slice(a, b), torch.arange(a, b, device=q.device), lo, hi))
    else:
        rows_host = q_rows.tolist()
        tree_of = lambda r: next((lo, hi) for lo, hi in trees if lo <= r < hi)
        for a in range(0, len(rows_host), query_chunk):
            b = min(a + query_chunk, len(rows_host))
            lo, hi = tree_of(min(rows_host[a:b]))[0], tree_of(max(rows_host[a:b]))[1]
            blocks.append((slice(a, b), q_rows[a:b].to(q.device), lo, hi))

    outs, lses = [], []
    for qs, rows, lo, hi in blocks:
        cols = torch.arange(lo, hi, device=q.device)
        kt, vt = kk[lo:hi].transpose(0, 1), vv[lo:hi].transpose(0, 1)  # [H, L, D]
        sr, sc = seg[rows], seg[cols]
        mask = ((sr[:, None] == sc[None, :]) & (cols[None, :] <= rows[:, None])) | anc[sr[:, None], sc[None, :]]
        scores = torch.matmul(qq[qs].transpose(0, 1), kt.transpose(1, 2)) * scale  # [H, rows, L]
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, rows]; every row sees itself, so finite
        probs = torch.exp(scores - lse[..., None])
        outs.append(torch.matmul(probs, vt).transpose(0, 1))  # [rows, H, D]
        lses.append(lse)
    out = torch.cat(outs, dim=0).to(q.dtype)
    return out, torch.cat(lses, dim=1)
