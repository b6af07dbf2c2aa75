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

from ..layout import PackedLayout
from .core_attention import DualKVPackedSeqParams, dualkv_packed_seq_params
from .logprobs import EdgeLogprobs, vocab_parallel_logprobs
from .router import DualKVTopKRouter


class DualKVGPTModel(GPTModel):
    """GPTModel + DualKV rotary positions, loss-edge logprobs and MoE token weighting.

    replicate_moe_aux_loss: weight tokens in the MoE load-balancing losses so that they equal
    those of the replicated batch (default). False: count the packed tokens as they are.
    """

    def __init__(self, *args, replicate_moe_aux_loss: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.replicate_moe_aux_loss = replicate_moe_aux_loss
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
        table = out[1]
        if layout is None or table is None:
            return out
        # Megatron built the table for positions 0..max_seqlen_q-1 (the layout's position limit);
        # row t of the gathered table is the rotation of packed token t.
        per_token = layout.cached(
            ("rotary_per_token", id(self.rotary_pos_emb), tuple(table.shape), table.dtype),
            lambda: table.index_select(0, layout.position_ids.to(table.device)),
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
        layout = layout.to(device)
        self._set_router_weights(layout if self.replicate_moe_aux_loss else None)
        if input_ids is None:
            input_ids = layout.input_ids[None]
        elif tuple(input_ids.shape) != (1, layout.num_tokens):
            raise ValueError(f"input_ids must be [1, {layout.num_tokens}] (the packed micro-batch), got {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = layout.position_ids[None]
        return super().forward(
            input_ids,
            position_ids,
            attention_mask,
            packed_seq_params=dualkv_packed_seq_params(layout, host_cu_seqlens=not self.config.apply_rope_fusion),
            padding_mask=layout.padding_mask[None],
            output_processor=_edge_logprobs_output,
            output_processor_context=(layout, float(temperature), bool(with_entropy), self.pg_collection.tp),
            **{k: v for k, v in kwargs.items() if k not in ("packed_seq_params", "padding_mask")},
        )

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _set_router_weights(self, layout: Optional[PackedLayout]) -> None:
        for router in self._dualkv_routers:
            router.set_token_weight(layout)


def _edge_logprobs_output(*, hidden_states: Tensor, output_layer, output_weight, context, scale_logits, **_) -> EdgeLogprobs:
    """GPTModel output_processor: logits only at the loss edges, then vocab-parallel logprobs."""
    layout, temperature, with_entropy, tp_group = context
    h = hidden_states  # [T (or T/tp under sequence parallelism), 1, hidden]
    sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False))
    if sequence_parallel and tp_group.size() > 1:
        # Gather the shards; backward splits (not reduce-scatters) because the output layer
        # below all-reduces the input gradient over TP itself.
        h = tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False, group=tp_group)
    if h.shape[0] != layout.num_tokens:
        raise ValueError(f"decoder returned {h.shape[0]} rows, the layout packs {layout.num_tokens}")
    rows = h.index_select(0, layout.source_rows)  # [E, 1, hidden]; shared prompt rows repeat
    output_layer.sequence_parallel = False  # rows are replicated on every TP rank now
    try:
        logits, _ = output_layer(rows, weight=output_weight, runtime_gather_output=False)
    finally:
        output_layer.sequence_parallel = sequence_parallel
    logits = scale_logits(logits).squeeze(1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    logprobs, entropy = vocab_parallel_logprobs(logits, layout.target_ids, tp_group, with_entropy)
    return EdgeLogprobs(logprobs=logprobs, entropy=entropy)
