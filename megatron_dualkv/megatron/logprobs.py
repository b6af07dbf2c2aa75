"""Per-token logprobs (and entropy) from vocab-parallel logits, in float32 (float64 for float64).

    lp, ent = vocab_parallel_logprobs(logits, targets, tp_group, with_entropy=True)

`logits` [E, V/tp] is this tensor-parallel rank's slice of the vocabulary (rank r holds ids
[r*V/tp, (r+1)*V/tp)); `targets` [E] are global vocabulary ids and may live on another rank.
Only [E]-sized values cross ranks (max, sum of exp, target logit, sum of p*z): nothing of size
vocab is gathered. Returns logprob [E] and entropy [E] (or None), identical on every TP rank.
Backward needs no communication: every rank receives the same upstream gradient and computes
the gradient of its own vocabulary slice.

`EdgeLogprobs` is what the DualKV model returns: one value per loss edge of the layout
(response-major, token order inside a response).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class EdgeLogprobs:
    """Per-response-token results in the layout's edge order."""

    logprobs: Tensor  # float32 [E] (float64 for a float64 model)
    entropy: Optional[Tensor] = None  # [E] when asked for


def _all_reduce(x: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group, with_entropy: bool):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
        v_local = z.shape[-1]
        first = rank * v_local
        zmax = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        p = torch.exp(z - zmax[:, None])  # becomes the softmax below
        sum_exp = _all_reduce(p.sum(dim=-1), dist.ReduceOp.SUM, group)
        lse = zmax + torch.log(sum_exp)
        p.div_(sum_exp[:, None])

        local_t = targets - first
        mine = (local_t >= 0) & (local_t < v_local)
        safe_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        z_t = torch.where(mine, z.gather(1, safe_t[:, None]).squeeze(1), torch.zeros_like(zmax))
        z_t = _all_reduce(z_t, dist.ReduceOp.SUM, group)
        logprob = z_t - lse

        entropy = mean_z = None
        if with_entropy:
            mean_z = _all_reduce((p * z).sum(dim=-1), dist.ReduceOp.SUM, group)
            entropy = lse - mean_z
        ctx.with_entropy = with_entropy
        ctx.in_dtype = logits.dtype
        ctx.save_for_backward(p, safe_t, mine, z if with_entropy else None, mean_z)
        if with_entropy:
            return logprob, entropy
        return logprob, None

    @staticmethod
    def backward(ctx, grad_logprob: Optional[Tensor], grad_entropy: Optional[Tensor]):
        p, safe_t, mine, z, mean_z = ctx.saved_tensors
        grad = torch.zeros_like(p)
        if grad_logprob is not None:
            # d logprob / dz = onehot(target) - p
            grad = -p * grad_logprob[:, None]
            grad.scatter_add_(1, safe_t[:, None], torch.where(mine, grad_logprob, torch.zeros_like(grad_logprob))[:, None])
        if ctx.with_entropy and grad_entropy is not None:
            # d entropy / dz = -p * (z - E_p[z])
            grad = grad - p * (z - mean_z[:, None]) * grad_entropy[:, None]
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    tp_group=None,
    with_entropy: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """log softmax(logits)[target] and optionally the entropy, over a vocabulary split on TP.

    logits [E, V_local] (computed in float32, or float64 for float64 logits), targets [E] int64 global ids.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [E, V_local] and targets [E]; got {tuple(logits.shape)} and {tuple(targets.shape)}")
    return _VocabParallelLogprobs.apply(logits, targets, tp_group, with_entropy)
