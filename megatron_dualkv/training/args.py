"""Command-line arguments of the GRPO/DualKV training script, on top of Megatron's own.

    parser = add_dualkv_args(parser)            # Megatron's extra_args_provider
    argv = preset_argv("8b") + sys.argv[1:]      # Qwen3 shape as Megatron flags; user flags win
    check_parallelism(args)                      # PP refused with the reason; CP checked (DualKV only)
    loss_config_from_args(args), packing_options_from_args(args)

Our options (group "dualkv"):
  --rollouts FILE            JSONL/Parquet rollout groups (docs/DATA.md); default: the shipped demo file
  --groups-per-step G        rollout groups per optimizer step (one GRPO rollout batch)
  --max-tokens-per-micro-batch, --max-attention-pairs-per-micro-batch   packing budgets
  --clip-low/--clip-high/--dual-clip/--kl-beta/--loss-aggregation/--temperature   GRPO/DAPO loss
  --advantage-baseline/--no-advantage-std   advantages from rewards when a record has none
  --updates-per-batch K      optimizer steps per rollout batch (old logprobs recorded at its first pass)
  --kl-reference data|initial   reference logprobs from the file, or a frozen copy of the initial policy
  --no-dualkv                the replicated batch through stock Megatron (A/B baseline)
  --model-size               Qwen3 preset (tiny, tiny-moe, 8b, 30b-a3b): expands to Megatron shape flags
  --peak-tflops              per-device peak for MFU (default: known GPUs, else MFU is not printed)
  --step-log FILE            the step records as JSON lines (full precision), besides the printed line
  --logits-chunk-rows N      opt-in: output layer + log-softmax over chunks of N loss edges, recomputed in
                             backward (no [edges, vocab/tp] logits kept; docs/MEGATRON.md); default: one pass
  --cp-chunks-per-rank, --cp-chunk-multiple   how a micro-batch is split over --context-parallel-size ranks
                             (megatron_dualkv.cp.cp_partition; docs/CONTEXT_PARALLEL.md)

Context parallelism (--context-parallel-size c > 1, DualKV only): every CP rank of a data-parallel
replica receives the same packed micro-batch and the model shards it itself (rows balanced by
attention work, K/V all-gathered or heads split by all-to-all: --cp-comm-type all_gather | a2a).
--max-tokens-per-micro-batch stays the budget of the WHOLE micro-batch: a rank holds about 1/c of
it (plus the partition's padding).

A Megatron "sample" is one packed micro-batch: --micro-batch-size must be 1, and
--global-batch-size / data-parallel size is the most micro-batches a rank may get per step (the
packer uses fewer when the step's groups fit; the remaining slots run no model work).
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

from ..data.advantages import AdvantageEstimator
from ..loss import AGGREGATIONS, PolicyLossConfig

MODEL_SIZES = ("tiny", "tiny-moe", "8b", "30b-a3b")
# --no-dualkv's core attention (megatron_dualkv.megatron.specs.STOCK_ATTENTIONS; not imported here, so
# that argument handling needs no megatron.core)
STOCK_ATTENTIONS = ("megatron", "sdpa")


def add_dualkv_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron extra_args_provider: adds the "dualkv" argument group."""
    g = parser.add_argument_group("dualkv", "GRPO policy update on deduplicated (DualKV) packed rollouts")
    g.add_argument("--rollouts", default=None, help="rollout groups, JSONL or Parquet (default: the shipped demo file)")
    g.add_argument("--groups-per-step", type=int, default=8, help="rollout groups per optimizer step")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=4096,
                   help="token budget of one packed micro-batch (padded length)")
    g.add_argument("--max-attention-pairs-per-micro-batch", type=int, default=None,
                   help="DualKV-mask (query, key) pair budget of one micro-batch (default: none)")
    g.add_argument("--packing-seed", type=int, default=0, help="seed of the group shuffle (per epoch and step)")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clipped below at 1 - clip_low")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clipped above at 1 + clip_high (DAPO)")
    g.add_argument("--dual-clip", type=float, default=None, help="dual-clip bound c > 1 for negative advantages")
    g.add_argument("--kl-beta", type=float, default=0.0, help="weight of the k3 KL to the reference policy")
    g.add_argument("--loss-aggregation", choices=AGGREGATIONS, default="token",
                   help="token: mean over every loss token of the global batch; sequence: mean of per-response means")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature the logprobs are taken at")
    g.add_argument("--advantage-baseline", choices=("mean", "leave_one_out"), default="mean")
    g.add_argument("--no-advantage-std", action="store_true", help="do not divide advantages by the group std")
    g.add_argument("--updates-per-batch", type=int, default=1,
                   help="optimizer steps per rollout batch; old logprobs missing from the rollouts are recorded at "
                        "the batch's first pass")
    g.add_argument("--kl-reference", choices=("data", "initial"), default="data",
                   help="reference logprobs for the KL: from the rollout file, or from a frozen copy of the initial "
                        "policy when the file has none")
    g.add_argument("--no-dualkv", action="store_true",
                   help="replicated baseline: every [prompt | response] its own row through stock Megatron")
    g.add_argument("--stock-attention", choices=STOCK_ATTENTIONS, default=STOCK_ATTENTIONS[0],
                   help="--no-dualkv's core attention: megatron (the spec's own: TE's fused attention with TE, the "
                        "local unfused DotProductAttention without) or sdpa (torch scaled_dot_product_attention: "
                        "flash-style without TE)")
    g.add_argument("--model-size", choices=MODEL_SIZES, default=None,
                   help="Qwen3 preset: expands to Megatron's shape flags (flags given after it win)")
    g.add_argument("--peak-tflops", type=float, default=None, help="per-device peak TFLOP/s for MFU")
    g.add_argument("--step-log", default=None, help="also append every step's record to this file, one JSON object a line")
    g.add_argument("--demo", action="store_true", help="the embedded default job (also what no arguments run)")
    g.add_argument("--logits-chunk-rows", type=int, default=None,
                   help="opt-in: compute the output layer and log-softmax over chunks of this many loss edges, "
                        "recomputed in backward, so no [edges, vocab/tp] logits are kept (DualKV model only)")
    g.add_argument("--cp-chunks-per-rank", type=int, default=8,
                   help="context parallelism: contiguous chunks each CP rank holds at least (finer attention-work "
                        "balance with more; the partition tries up to twice as many for less padding)")
    g.add_argument("--cp-chunk-multiple", type=int, default=128,
                   help="context parallelism: chunk length is a multiple of this (128: FlexAttention's block; "
                        "made a multiple of the TP size under sequence parallelism)")
    return parser


def preset_argv(size: str, vocab_size: Optional[int] = None) -> list[str]:
    """Megatron flags describing the Qwen3 preset `size` (same shapes as megatron.qwen3_config)."""
    from ..megatron.config import qwen3_config

    cfg = qwen3_config(size)
    t = cfg.transformer
    argv = [
        "--num-layers", str(t.num_layers), "--hidden-size", str(t.hidden_size),
        "--ffn-hidden-size", str(t.ffn_hidden_size), "--num-attention-heads", str(t.num_attention_heads),
        "--group-query-attention", "--num-query-groups", str(t.num_query_groups),
        "--kv-channels", str(t.kv_channels), "--normalization", "RMSNorm", "--norm-epsilon", str(t.layernorm_epsilon),
        "--qk-layernorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--rotary-base", str(cfg.rotary_base),
        "--max-position-embeddings", str(cfg.max_sequence_length),
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size or cfg.vocab_size),
    ]
    if t.num_moe_experts:
        argv += [
            "--num-experts", str(t.num_moe_experts), "--moe-ffn-hidden-size", str(t.moe_ffn_hidden_size),
            "--moe-router-topk", str(t.moe_router_topk), "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", str(t.moe_aux_loss_coeff), "--moe-token-dispatcher-type", "alltoall",
        ]
    return argv


def check_parallelism(args) -> None:
    """Refuse what the packed micro-batches do not support (yet), saying why."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        raise ValueError(
            "pipeline parallelism (--pipeline-model-parallel-size > 1) is not supported: every packed "
            "micro-batch has its own length and its own layout, while Megatron's pipeline schedules send "
            "activations of one fixed shape (seq_length x micro_batch_size) between stages; variable shapes "
            "(variable_seq_lengths) and handing the layout to every stage are not implemented or tested. "
            "Use tensor, expert and data parallelism.")
    check_context_parallelism(args)
    if getattr(args, "micro_batch_size", 1) != 1:
        raise ValueError(f"--micro-batch-size must be 1: one Megatron micro-batch is one packed DualKV micro-batch "
                         f"(its size is --max-tokens-per-micro-batch), got {args.micro_batch_size}")
    if args.groups_per_step < 1:
        raise ValueError(f"--groups-per-step must be >= 1, got {args.groups_per_step}")
    if args.updates_per_batch < 1:
        raise ValueError(f"--updates-per-batch must be >= 1, got {args.updates_per_batch}")
    chunk = getattr(args, "logits_chunk_rows", None)
    if chunk is not None and chunk < 1:
        raise ValueError(f"--logits-chunk-rows must be >= 1 (or left out for one pass), got {chunk}")
    stock = getattr(args, "stock_attention", STOCK_ATTENTIONS[0])
    if stock != STOCK_ATTENTIONS[0] and not getattr(args, "no_dualkv", False):
        raise ValueError(f"--stock-attention {stock} chooses the core attention of the --no-dualkv baseline; the DualKV "
                         f"model runs its own (MEGATRON_DUALKV_ATTENTION_BACKEND picks its backend)")


# Megatron's --cp-comm-type values that DualKV implements (megatron_dualkv.cp): K/V all-gather with
# local queries, and Ulysses all-to-all. "p2p" (the ring) and "a2a+p2p" exist only inside
# Transformer Engine's attention, which the DualKV core attention replaces.
DUALKV_CP_COMM_TYPES = ("all_gather", "a2a")


def check_context_parallelism(args) -> None:
    """--context-parallel-size > 1: what the script supports, refused otherwise with the reason."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp == 1:
        return
    if getattr(args, "no_dualkv", False):
        raise ValueError(
            "--no-dualkv does not support context parallelism (--context-parallel-size > 1): the replicated "
            "baseline is the stock GPTModel, whose context parallelism exists only in Transformer Engine's "
            "attention (Megatron's local DotProductAttention asserts context_parallel_size == 1), and the "
            "replicated batch (one padded row per response) is not split over CP ranks by this script. "
            "Run the A/B baseline at --context-parallel-size 1 (same micro-batches, more memory per GPU) or "
            "use the DualKV path, which shards every micro-batch itself")
    comm = getattr(args, "cp_comm_type", None) or ["all_gather"]
    comm = [comm] if isinstance(comm, str) else list(comm)
    bad = sorted({c for c in comm if c not in DUALKV_CP_COMM_TYPES})
    if bad:
        raise ValueError(
            f"--cp-comm-type {' '.join(comm)}: DualKV context parallelism implements {DUALKV_CP_COMM_TYPES} "
            f"(K/V all-gather, the default, or heads split by all-to-all); {bad} exist only inside Transformer "
            f"Engine's attention, which the DualKV core attention replaces")
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ValueError("--hierarchical-context-parallel-sizes is Transformer Engine's a2a+p2p context parallelism; "
                         "DualKV CP uses one CP group (--cp-comm-type all_gather or a2a)")
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError("--hybrid-context-parallel (Megatron's per-sequence dynamic CP) is not supported: DualKV "
                         "CP splits every packed micro-batch over the whole CP group")
    for flag in ("cp_chunks_per_rank", "cp_chunk_multiple"):
        value = getattr(args, flag, 1)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def cp_chunk_multiple(args) -> int:
    """Chunk length multiple of the CP partition: --cp-chunk-multiple, made a multiple of TP under
    sequence parallelism (SP splits each CP rank's rows over the TP ranks)."""
    multiple = getattr(args, "cp_chunk_multiple", 128)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    return math.lcm(multiple, tp) if getattr(args, "sequence_parallel", False) else multiple


def loss_config_from_args(args) -> PolicyLossConfig:
    return PolicyLossConfig(
        clip_low=args.clip_low, clip_high=args.clip_high, dual_clip=args.dual_clip, kl_beta=args.kl_beta,
        aggregation=args.loss_aggregation,
    )


def advantage_estimator_from_args(args) -> AdvantageEstimator:
    return AdvantageEstimator(baseline=args.advantage_baseline, normalize_std=not args.no_advantage_std)


def pad_to_multiple(args) -> int:
    """Packed length multiple the packer pads each micro-batch to: TP under sequence parallelism
    (SP splits the rows over TP). Under context parallelism nothing: the model's CP partition pads
    each micro-batch itself to cp * k * C rows (C a multiple of lcm(cp_chunk_multiple(args), 2), so
    every CP rank's rows split over TP), and packer padding would only add rows."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        return 1
    return tp if getattr(args, "sequence_parallel", False) and tp > 1 else 1


def round_budget(max_tokens: int, multiple: int) -> int:
    """The token budget rounded down to the padding multiple (the packer requires a multiple)."""
    out = (max_tokens // multiple) * multiple
    if out < 1:
        raise ValueError(f"--max-tokens-per-micro-batch {max_tokens} is below the padding multiple {multiple}")
    return out

