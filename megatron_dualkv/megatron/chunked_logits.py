"""Output layer + vocab-parallel logprobs at the loss edges, optionally in chunks of edges (opt-in).

    lp, ent = edge_logprobs_from_rows(rows, targets, head, chunk_rows=None)   # one pass, as before
    lp, ent = edge_logprobs_from_rows(rows, targets, head, chunk_rows=4096)   # chunked

`rows` [E, 1, hidden] are the gathered hidden rows of the loss edges, replicated on every TP rank;
`head` (OutputHead) is the model's output layer and how its logits become logprobs.

Why: at a real vocabulary the [E, V/tp] float32 logits (and the softmax the log-softmax saves for
backward) are the largest DualKV memory term (docs/PLANNER.md). With `chunk_rows`, each chunk of
edges runs inside a non-reentrant `torch.utils.checkpoint`: forward keeps only the chunk's hidden
rows (a view of `rows`) and targets, the chunk's logits are freed as soon as its logprobs are out,
and backward recomputes them one chunk at a time. The output layer is Megatron's own module called
per chunk, so its autograd (TP input-gradient all-reduce of each chunk's rows, the weight gradient
into `.grad` / `main_grad`) runs unchanged; the weight's AccumulateGrad (and the DDP hook on it)
still fires once per backward, because non-reentrant recomputation feeds the original graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .logprobs import vocab_parallel_logprobs


@dataclass(frozen=True)
class OutputHead:
    """What turns hidden rows into logprobs: GPTModel's output layer (ColumnParallelLinear),
    the (possibly tied) weight, GPTModel's logit scaling, the sampling temperature, the TP group."""

    output_layer: Any
    output_weight: Optional[Tensor]
    scale_logits: Callable[[Tensor], Tensor]
    temperature: float
    tp_group: Any
    with_entropy: bool


def check_chunk_rows(chunk_rows: Optional[int]) -> Optional[int]:
    """None (no chunking) or a positive int; anything else is a ValueError."""
    if chunk_rows is None:
        return None
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"logits_chunk_rows must be None or a positive int, got {chunk_rows!r}")
    return chunk_rows


def _head_logprobs(rows: Tensor, targets: Tensor, head: OutputHead) -> tuple[Tensor, Optional[Tensor]]:
    """[E, 1, hidden] replicated rows -> logprob [E] (and entropy [E])."""
    layer = head.output_layer
    sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
    # rows are replicated on every TP rank (already gathered); set here, not around the caller,
    # because a chunk's recomputation in backward calls this again
    layer.sequence_parallel = False
    try:
        logits, _ = layer(rows, weight=head.output_weight, runtime_gather_output=False)
    finally:
        layer.sequence_parallel = sequence_parallel
    logits = head.scale_logits(logits).squeeze(1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if head.temperature != 1.0:
        logits = logits / head.temperature
    return vocab_parallel_logprobs(logits, targets, head.tp_group, head.with_entropy)


def edge_logprobs_from_rows(rows: Tensor, targets: Tensor, head: OutputHead,
                            chunk_rows: Optional[int] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Logprobs (and entropy) of the loss edges whose hidden rows are `rows`.

    chunk_rows None: one pass, the [E, V/tp] logits live until backward. Otherwise chunks of at
    most `chunk_rows` edges, each recomputed in backward (also when one chunk holds every edge:
    the logits are still not kept). Every TP rank must use the same chunk_rows (the log-softmax
    all-reduces per chunk)."""
    chunk_rows = check_chunk_rows(chunk_rows)
    num_edges = rows.shape[0]
    if targets.shape != (num_edges,):
        raise ValueError(f"expected targets [{num_edges}], got {tuple(targets.shape)}")
    if chunk_rows is None or num_edges == 0:
        return _head_logprobs(rows, targets, head)
    recompute = torch.is_grad_enabled()  # without autograd, chunks only bound the peak

    def run(rows_chunk: Tensor, targets_chunk: Tensor):
        lp, ent = _head_logprobs(rows_chunk, targets_chunk, head)
        return (lp, ent) if head.with_entropy else lp

    logprobs, entropy = [], []
    for start in range(0, num_edges, chunk_rows):
        stop = min(start + chunk_rows, num_edges)
        # no RNG in the output layer or the softmax: nothing to replay
        if recompute:
            out = checkpoint(run, rows[start:stop], targets[start:stop], use_reentrant=False,
                             preserve_rng_state=False)
        else:
            out = run(rows[start:stop], targets[start:stop])
        if head.with_entropy:
            logprobs.append(out[0])
            entropy.append(out[1])
        else:
            logprobs.append(out)
    return torch.cat(logprobs), (torch.cat(entropy) if head.with_entropy else None)
