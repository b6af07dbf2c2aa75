"""Model and dataset providers for Megatron's pretrain() (and for the CPU runner).

    model = model_provider(pre_process=True, post_process=True, config=None, pg_collection=pgs)
    train_iter, _, _ = datasets_provider(num_samples)     # is_distributed: every rank builds its own

The model is the Qwen3-shaped DualKVGPTModel (or, with --no-dualkv, the stock GPTModel with the
same parameter names), dense or MoE, built from Megatron's arguments (`--model-size` expands to
the shape flags, see args.preset_argv) through `core_transformer_config_from_args`, so every
Megatron flag (TP/SP/EP/CP, bf16, recomputation, dispatcher...) applies as usual. The dataset is a
`data.RolloutStepStream` over the rollout file, resumed at Megatron's iteration counter.

Context parallelism: the CP group is Megatron's (`pg_collection.cp`, from parallel_state), and
the DualKV model splits each packed micro-batch over it itself (megatron_dualkv.cp); the stream
is planned per DATA-parallel rank (parallel_state's DP size and rank exclude CP), so every CP
rank of a replica gets the same micro-batches, as Megatron's own data path does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..data import DEFAULT_ROLLOUTS, read_rollouts
from ..megatron.config import ModelConfig, build_dualkv_model, build_replicated_model
from ..model_shape import ModelShape
from ..packing import PackingConfig, flop_work_weights
from .args import advantage_estimator_from_args, check_parallelism, cp_chunk_multiple, pad_to_multiple, round_budget
from .data import RolloutStepStream


def padded_vocab_size(args) -> int:
    if getattr(args, "padded_vocab_size", None):
        return args.padded_vocab_size
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    return calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                       args.tensor_model_parallel_size, logging_enabled=False)


def model_config_from_args(args, transformer_config=None) -> ModelConfig:
    """ModelConfig (TransformerConfig + GPTModel arguments) from Megatron's parsed arguments."""
    if transformer_config is None:
        from megatron.training.arguments import core_transformer_config_from_args

        transformer_config = core_transformer_config_from_args(args)
    # Megatron divides every gradient by the summed loss counts: our loss_func's convention.
    transformer_config.calculate_per_token_loss = True
    return ModelConfig(
        transformer=transformer_config,
        vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings,
        rotary_base=int(args.rotary_base),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )


def build_policy_model(cfg: ModelConfig, *, dualkv: bool, pg_collection=None, pre_process: bool = True,
                       post_process: bool = True, vp_stage: Optional[int] = None,
                       use_transformer_engine: Optional[bool] = None, stock_attention: str = "megatron",
                       **dualkv_kw):
    """DualKVGPTModel, or the stock GPTModel for the replicated baseline (same parameters; its core
    attention per stock_attention, build_replicated_model).
    dualkv_kw: DualKV-only build_dualkv_model options (e.g. cp_chunks_per_rank, cp_chunk_multiple)."""
    kw = dict(pg_collection=pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
              use_transformer_engine=use_transformer_engine)
    if dualkv:
        return build_dualkv_model(cfg, **kw, **dualkv_kw)
    return build_replicated_model(cfg, **kw, stock_attention=stock_attention)


def dualkv_model_options(args) -> dict:
    """build_dualkv_model options from the arguments: how micro-batches split under CP."""
    return dict(cp_chunks_per_rank=getattr(args, "cp_chunks_per_rank", 8), cp_chunk_multiple=cp_chunk_multiple(args))


def policy_model_options(args) -> dict:
    """build_policy_model options from the arguments: DualKV's CP split, or the baseline's core attention."""
    if args.no_dualkv:
        return {"stock_attention": getattr(args, "stock_attention", "megatron")}
    return dualkv_model_options(args)


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None):
    """Megatron's model_provider signature (megatron.training.get_model)."""
    from megatron.training import get_args

    args = get_args()
    check_parallelism(args)
    cfg = model_config_from_args(args, config)
    use_te = None if args.transformer_impl == "transformer_engine" else False
    # pg_collection (from Megatron's get_model) carries the CP group: the DualKV model shards each
    # micro-batch over it; no Transformer Engine needed (its own core attention does the CP).
    model = build_policy_model(cfg, dualkv=not args.no_dualkv, pg_collection=pg_collection,
                               pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                               use_transformer_engine=use_te, **policy_model_options(args))
    if not args.no_dualkv:  # opt-in chunked output layer (--logits-chunk-rows; None: one pass)
        model.logits_chunk_rows = getattr(args, "logits_chunk_rows", None)
    else:
        log_stock_attention(model)
    return model


def log_stock_attention(model) -> None:
    """One line (first rank) naming the replicated baseline's core attention, what --stock-attention
    chose: the DualKV path logs its attention backend itself, the stock model would say nothing."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    core = model.decoder.layers[0].self_attention.core_attention
    print(f"stock GPTModel core attention: {type(core).__name__}", flush=True)


def model_shape_from_args(args, transformer_config=None) -> ModelShape:
    cfg = model_config_from_args(args, transformer_config)
    return ModelShape.of(cfg.transformer, cfg.vocab_size)


def rollout_stream_from_args(args, *, dp_size: int, dp_rank: int, micro_batches_per_step: int,
                             shape: Optional[ModelShape] = None, updates_per_batch: int = 1,
                             device: torch.device | str = "cpu") -> RolloutStepStream:
    """The rank's micro-batch stream: rollout file, packing budgets and balance from the arguments."""
    path = args.rollouts or DEFAULT_ROLLOUTS
    vocab = args.vocab_size
    records = read_rollouts(path, vocab_size=vocab)
    if args.kl_beta != 0 and args.kl_reference == "data":
        missing = next((r.group_id for r in records if r.ref_logprobs is None), None)
        if missing is not None:
            raise ValueError(f"--kl-beta {args.kl_beta} needs reference logprobs, but group {missing!r} of {path} has "
                             f"none: add ref_logprobs to the rollouts (docs/DATA.md), set --kl-beta 0, or use "
                             f"--kl-reference initial")
    pad = pad_to_multiple(args)
    weights = {}
    if shape is not None:  # balance ranks by fwd+bwd FLOPs (tokens and attention pairs)
        weights = flop_work_weights(shape.num_layers, shape.num_attention_heads, shape.kv_channels,
                                    shape.token_matmul_flops() / 2.0)
    packing = PackingConfig(
        max_tokens=round_budget(args.max_tokens_per_micro_batch, pad),
        max_attention_pairs=args.max_attention_pairs_per_micro_batch,
        dp_size=dp_size, pad_to_multiple=pad, vocab_size=vocab, seed=args.packing_seed,
        advantage=advantage_estimator_from_args(args), **weights,
    )
    return RolloutStepStream(records, groups_per_step=args.groups_per_step,
                             micro_batches_per_step=micro_batches_per_step, packing=packing, dp_rank=dp_rank,
                             seed=args.packing_seed, updates_per_batch=updates_per_batch, device=device)


def datasets_provider(train_val_test_num_samples):
    """Megatron's train_valid_test_datasets_provider: (train iterator, None, None).

    Use with --dataloader-type external; every rank builds its own stream (is_distributed)."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    args = get_args()
    stream = rollout_stream_from_args(
        args, dp_size=parallel_state.get_data_parallel_world_size(), dp_rank=parallel_state.get_data_parallel_rank(),
        micro_batches_per_step=get_num_microbatches(), shape=model_shape_from_args(args),
        updates_per_batch=args.updates_per_batch,
        device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu",
    )
    return stream.iterate(start_step=args.iteration), None, None


datasets_provider.is_distributed = True
