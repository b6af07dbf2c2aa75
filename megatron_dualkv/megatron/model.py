"""DualKVGPTModel: a Megatron-Core GPTModel that runs one packed DualKV micro-batch.

    model = build_dualkv_model(qwen3_config("tiny"))          # or DualKVGPTModel(config, spec, ...)
    out = model(layout=layout, temperature=1.0, with_entropy=False)
    out.logprobs   # float32 [E]: log p(target of edge e), in layout edge order
    out.entropy    # float32 [E] or None

What it changes against GPTModel (same parameters, same state_dict keys):
- rotary positions per token: the rotary table is gathered at `layout.position_ids` (prompt
  0..P-1, each response P..P+R_i-1) and fed to Megatron's THD RoPE as a [T, 1, 1, d] table;
- attention: the DualKV core attention (spec) reads the layout from the packed-seq params;
- output: hidden rows `layout.source_rows` are gathered before the output layer (the last prompt
  row is used by the first token of every response of its group) and turned into logprobs by a
  vocab-parallel log-softmax; logits of the other prompt rows are never computed;
- MoE: DualKV routers weight tokens by `layout.token_weight` (see router.py), and padding is
  excluded from routing statistics through Megatron's padding_mask.
Context parallelism (pg_collection.cp of size cp > 1): each CP rank runs the rows of its
`CPShard` (megatron_dualkv.cp: rows chosen to balance attention work, the same number on every
rank); `layout=` takes the whole micro-batch (sharded here, identically on every rank) or a
`CPShard`. The logprobs come back for ALL loss edges, identical on every CP rank (like the
vocabulary-parallel logprobs on every TP rank): each rank computes the edges whose source row it
holds and the values are all-gathered; backward keeps each rank's own edges' gradient. Any loss
written for CP = 1 therefore runs unchanged; for Megatron's per-token loss, count the
micro-batch's tokens on one rank of the CP group (`cp_token_count`), since Megatron sums the
counts over DP x CP.
On a pipeline stage without the output layer, forward returns the hidden states as GPTModel does.
Called without `layout`, it is a plain GPTModel (then packed_seq_params must be
`dualkv_packed_seq_params(layout)` for the DualKV attention, and GPTModel's logits come back).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from ..cp import CPShard, cp_shard, gather_edges
from ..layout import PackedLayout
from .chunked_logits import OutputHead, check_chunk_rows, edge_logprobs_from_rows
from .core_attention import DualKVPackedSeqParams, dualkv_packed_seq_params
from .logprobs import EdgeLogprobs, vocab_parallel_logprobs
from .router import DualKVTopKRouter


class DualKVGPTModel(GPTModel):
    """GPTModel + DualKV rotary positions, loss-edge logprobs and MoE token weighting.

    replicate_moe_aux_loss: weight tokens in the MoE load-balancing losses so that they equal
    those of the replicated batch (default). False: count the packed tokens as they are.
    cp_chunks_per_rank, cp_chunk_multiple: how a PackedLayout is split under context
    parallelism (`megatron_dualkv.cp.cp_partition`); under sequence parallelism the chunk
    multiple must make every rank's rows a multiple of tp.
    logits_chunk_rows: opt-in; compute the output layer and log-softmax over chunks of at most
    this many loss edges, recomputed in backward (megatron_dualkv.megatron.chunked_logits), so no
    [edges, vocab/tp] logits are kept for backward. None (default): one pass. forward() takes the
    same keyword to override it for one call.
    """

    # Class-level defaults of the options __init__ sets: a stock GPTModel converted in place
    # (integrations.nemo_rl.convert swaps __class__ without calling __init__) still has them.
    replicate_moe_aux_loss: bool = True
    cp_chunks_per_rank: int = 8
    cp_chunk_multiple: int = 128
    logits_chunk_rows: Optional[int] = None

    def __init__(self, *args, replicate_moe_aux_loss: bool = True, cp_chunks_per_rank: int = 8,
                 cp_chunk_multiple: int = 128, logits_chunk_rows: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.replicate_moe_aux_loss = replicate_moe_aux_loss
        self.cp_chunks_per_rank = cp_chunks_per_rank
        self.cp_chunk_multiple = cp_chunk_multiple
        self.logits_chunk_rows = check_chunk_rows(logits_chunk_rows)
        self._dualkv_routers = [m for m in self.modules() if isinstance(m, DualKVTopKRouter)]
        if self.mtp_process:
            raise ValueError("DualKVGPTModel does not support multi-token prediction (mtp_block_spec)")
        if self.position_embedding_type not in ("rope", "none"):
            raise ValueError(
                f"DualKVGPTModel supports rope (or no) position embeddings, got {self.position_embedding_type!r}"
            )

    # -- rotary positions per token ---------------------------------------------------------
    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = super()._preprocess(
            input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        layout = getattr(packed_seq_params, "layout", None)
        shard = getattr(packed_seq_params, "cp_shard", None)
        table = out[1]
        if layout is None or table is None:
            return out
        # Megatron built the table for positions 0..max_seqlen_q-1 (the layout's position limit);
        # row t of the gathered table is the rotation of packed token t.
        if shard is None:
            per_token = layout.cached(
                ("rotary_per_token", id(self.rotary_pos_emb), tuple(table.shape), table.dtype),
                lambda: table.index_select(0, layout.position_ids.to(table.device)),
            )
        else:
            per_token = shard.cached(
                ("rotary_per_token", id(self.rotary_pos_emb), tuple(table.shape), table.dtype),
                lambda: _cp_rotary_table(table, shard),
            )
        return (out[0], per_token) + tuple(out[2:])

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Optional[Tensor] = None,
        position_ids: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        *args,
        layout: Optional[PackedLayout] = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        logits_chunk_rows: Optional[int] = None,
        **kwargs,
    ):
        if layout is None:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        if args:
            raise TypeError("DualKVGPTModel(layout=...) takes input ids from the layout; pass other arguments by name")
        for name in ("packed_seq_params", "labels", "output_processor", "output_processor_context", "padding_mask"):
            if kwargs.get(name) is not None:
                raise TypeError(f"DualKVGPTModel(layout=...) builds {name} itself; do not pass it")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        device = self._device()
        shard = self._cp_shard(layout.to(device))
        rows = shard if shard is not None else layout.to(device)  # what this rank runs
        full = shard.layout if shard is not None else rows
        self._set_router_weights(full if self.replicate_moe_aux_loss else None, None if shard is None else shard.rows)
        num_rows = rows.num_local if shard is not None else rows.num_tokens
        if input_ids is None:
            input_ids = rows.input_ids[None]
        elif tuple(input_ids.shape) != (1, num_rows):
            raise ValueError(f"input_ids must be [1, {num_rows}] (this rank's rows of the packed micro-batch), "
                             f"got {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = rows.position_ids[None]
        return super().forward(
            input_ids,
            position_ids,
            attention_mask,
            packed_seq_params=dualkv_packed_seq_params(rows, host_cu_seqlens=not self.config.apply_rope_fusion),
            padding_mask=rows.padding_mask[None],
            output_processor=_edge_logprobs_output,
            output_processor_context=(full, float(temperature), bool(with_entropy), self.pg_collection.tp, shard,
                                      self.pg_collection.cp if shard is not None else None,
                                      check_chunk_rows(logits_chunk_rows) or self.logits_chunk_rows),
            **{k: v for k, v in kwargs.items() if k not in ("packed_seq_params", "padding_mask")},
        )

    def _cp_shard(self, layout) -> Optional[CPShard]:
        """This rank's CPShard under context parallelism (None without it)."""
        group = getattr(self.pg_collection, "cp", None)
        cp = group.size() if group is not None else 1
        if isinstance(layout, CPShard):
            if layout.cp_size != cp or layout.cp_rank != (group.rank() if group is not None else 0):
                raise ValueError(f"CPShard of rank {layout.cp_rank} of {layout.cp_size} given to CP rank "
                                 f"{group.rank() if group is not None else 0} of {cp}")
            shard = layout
        elif cp == 1:
            return None
        else:
            shard = cp_shard(layout, group.rank(), cp, self.cp_chunks_per_rank, self.cp_chunk_multiple)
        tp = self.pg_collection.tp.size()
        if self.config.sequence_parallel and shard.num_local % tp:
            raise ValueError(f"sequence parallelism splits each CP rank's {shard.num_local} rows over tp={tp}: "
                             f"choose cp_chunk_multiple ({self.cp_chunk_multiple}) as a multiple of {tp}")
        return shard

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _set_router_weights(self, layout: Optional[PackedLayout], rows: Optional[Tensor] = None) -> None:
        for router in self._dualkv_routers:
            router.set_token_weight(layout, rows)


def _cp_rotary_table(table: Tensor, shard: CPShard) -> Tensor:
    """The rotary table Megatron's THD RoPE must receive so that THIS rank's rows get their own
    rotations: to Megatron the micro-batch is one sequence of cp * L rows split zigzag (rank r
    holds chunks r and 2cp-1-r of 2cp chunks of L/2 rows), so it slices a [cp * L] table at
    those positions. Our rows are chosen by attention work instead; we put their rotations at
    the positions Megatron reads (the rest is never read). Checked against Megatron's slicing."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    cp, r, n = shard.cp_size, shard.cp_rank, shard.num_local
    half = n // 2
    if 2 * half != n:
        raise ValueError(f"under context parallelism every rank needs an even number of rows, got {n}")
    total = cp * n
    read = torch.cat([torch.arange(r * half, (r + 1) * half), torch.arange(total - (r + 1) * half, total - r * half)])
    positions = torch.zeros(total, dtype=torch.int64)
    positions[read] = shard.position_ids.cpu()
    out = table.index_select(0, positions.to(table.device))
    got = _get_thd_freqs_on_this_cp_rank(r, cp, out[:n], out, 0)
    if not torch.equal(got, table.index_select(0, shard.position_ids.to(table.device))):
        raise RuntimeError("Megatron's THD RoPE no longer slices context-parallel ranks zigzag; "
                           "megatron_dualkv.megatron.model._cp_rotary_table must follow its new layout")
    return out


def _edge_logprobs_output(*, hidden_states: Tensor, output_layer, output_weight, context, scale_logits, **_) -> EdgeLogprobs:
    """GPTModel output_processor: logits only at the loss edges, then vocab-parallel logprobs."""
    layout, temperature, with_entropy, tp_group, shard, cp_group, chunk_rows = context
    h = hidden_states  # [T (or T/tp under sequence parallelism), 1, hidden]; T = this rank's rows under CP
    sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False))
    if sequence_parallel and tp_group.size() > 1:
        # Gather the shards; backward splits (not reduce-scatters) because the output layer
        # below all-reduces the input gradient over TP itself.
        h = tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False, group=tp_group)
    num_rows = layout.num_tokens if shard is None else shard.num_local
    if h.shape[0] != num_rows:
        raise ValueError(f"decoder returned {h.shape[0]} rows, expected {num_rows}")
    # [E, 1, hidden] (this rank's edges under CP); shared prompt rows repeat
    rows = h.index_select(0, layout.source_rows if shard is None else shard.edge_source)
    targets = layout.target_ids if shard is None else shard.target_ids
    head = OutputHead(output_layer, output_weight, scale_logits, temperature, tp_group, with_entropy)
    logprobs, entropy = edge_logprobs_from_rows(rows, targets, head, chunk_rows)
    if shard is not None:
        logprobs = gather_edges(logprobs, shard, cp_group)
        entropy = None if entropy is None else gather_edges(entropy, shard, cp_group)
    return EdgeLogprobs(logprobs=logprobs, entropy=entropy)


def cp_token_count(count: Tensor, cp_group) -> Tensor:
    """The token count a CP rank reports to Megatron's per-token loss: the micro-batch's count on
    CP rank 0, zero on the others. Every CP rank computes the whole micro-batch's loss (from the
    gathered [E] logprobs) and backpropagates its own edges; Megatron sums the counts over
    DP x CP, so the micro-batch must be counted once."""
    if cp_group is None or cp_group.size() == 1 or cp_group.rank() == 0:
        return count
    return torch.zeros_like(count)
