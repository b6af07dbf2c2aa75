"""What DualKV saves: tokens and attention FLOPs, deduplicated vs replicated.

Attention FLOPs count the two matrix products of causal attention over the key tokens each query
actually sees: 4 * Hq * D per (query, key) pair forward (QK^T and PV, 2 FLOPs per multiply-add).
Forward + backward is counted as 3.5x forward (the convention of the published DualKV numbers:
backward does 2.5x the forward's matrix work).
"""

from __future__ import annotations

from typing import Sequence, Union

from .layout import PackedLayout, SegmentTable

FWD_BWD_FACTOR = 3.5


def _causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def attended_pairs(segments: Union[SegmentTable, PackedLayout], include_roots_without_children: bool = True) -> int:
    """(query, key) pairs the DualKV mask allows: each segment sees its ancestors fully and itself
    causally."""
    seg = segments.segments if isinstance(segments, PackedLayout) else segments
    total = 0
    for s in range(seg.num_segments):
        n = seg.host_length[s]
        above = sum(seg.host_length[a] for a in seg.ancestors(s))
        total += n * above + _causal_pairs(n)
    return total


def group_pairs(prompt_len: int, response_lens: Sequence[int]) -> tuple[int, int]:
    """(deduplicated, replicated) attended pairs of one group."""
    dedup = _causal_pairs(prompt_len) + sum(r * prompt_len + _causal_pairs(r) for r in response_lens)
    repl = sum(_causal_pairs(prompt_len + r) for r in response_lens)
    return dedup, repl


def group_tokens(prompt_len: int, response_lens: Sequence[int]) -> tuple[int, int]:
    """(deduplicated, replicated) token counts of one group."""
    return prompt_len + sum(response_lens), sum(prompt_len + r for r in response_lens)


def attention_flops(pairs: int, num_q_heads: int, head_dim: int, backward: bool = False) -> float:
    fwd = 4.0 * num_q_heads * head_dim * pairs
    return fwd * FWD_BWD_FACTOR if backward else fwd


def savings(n: int, p: int, r: int) -> dict:
    """Per-layer savings for a group of N responses of length R on a prompt of length P."""
    dt, rt = group_tokens(p, [r] * n)
    dp, rp = group_pairs(p, [r] * n)
    return {
        "tokens_dedup": dt, "tokens_replicated": rt, "token_reduction": rt / dt,
        "attn_pairs_dedup": dp, "attn_pairs_replicated": rp, "attn_flop_reduction": rp / dp,
    }
