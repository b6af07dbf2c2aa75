#!/usr/bin/env bash
# GRPO policy update of Qwen3-8B with DualKV packing on one node of 8 GPUs (H100/H200 80+ GB).
#
#   examples/launch/qwen3_8b_single_node.sh ROLLOUTS CKPT_DIR [LOAD_DIR] [extra Megatron/DualKV flags...]
#
#   ROLLOUTS  rollout groups, JSONL or Parquet (docs/DATA.md)
#   CKPT_DIR  where Megatron saves checkpoints (and resumes from, when it holds one)
#   LOAD_DIR  initial policy as a Megatron checkpoint (optional; "-" or absent: random init).
#             An HF -> Megatron import is its own tool (not part of this script).
#
# Parallel layout (8 GPUs): TP=2 with sequence parallelism, DP=4, PP=1, CP=1, full recomputation,
# 30,720 tokens per micro-batch. Chosen with tools/plan_memory.py for the issue-8 workload
# (N=32 responses of R=2048 tokens on a P=8192-token prompt, 64 groups per step); predictions from
# assumed rates, not measured on a GPU (docs/PLANNER.md; numbers from the planner at commit dc30cb8;
# its calibration against the measured GPU runs of 2026-11-22 moved them by 1-3 %, e.g. this layout
# 64.6 GiB and 122.7 s, and did not change the choice):
#     python tools/plan_memory.py --model 8b --sweep --world 8 --n 32 --p 8192 --r 2048 \
#         --groups-per-step 64 --no-cp --dualkv-only
#   | layout      | recompute | micro-batch (responses per sub-group) | mb/rank | GiB  | step s |
#   | TP4+SP DP2  | none      | 11 of 32                               | 96      | 71.0 | 106.0  |
#   | TP8+SP DP1  | none      | 16 of 32                               | 128     | 50.2 | 120.5  |
#   | TP2+SP DP4  | full      | 11 of 32                               | 48      | 64.4 | 121.0  |  <- this script
#   | TP1 DP8     | full      | 3 of 32                                | 88      | 75.2 | 177.2  |
#   ("GiB": predicted peak per GPU before the planner's 3 GiB reserve; the budget is 79.1.)
#     python tools/plan_memory.py --model 8b --tp 2 --dp 4 --n 32 --p 8192 --r 2048 \
#         --groups-per-step 64 --max-tokens 30720 --recompute full --dualkv-only
#   -> weights 7.6 + fp32 grads 15.3 + Adam 11.4 + activations 4.5 + logits 6.4 + transient 19.1
#      = 64.4 GiB (+3 reserve) of 79; 121.0 s per step, MFU 31.0%.
#   - Why TP2 + full recomputation, not the top row: TP4 without recomputation is predicted 12%
#     faster but leaves 5.1 GiB of headroom (71.0 + 3 of 79.1, 7%), less than the planner's own error
#     on the live peak (within 15% on the CPU, seen up to +13%; never measured on a GPU). TP2 + full
#     leaves 11.7 GiB.
#     To run the top row instead: TP=4 RECOMPUTE=none (MICRO_BATCHES_PER_RANK follows DP).
#   - On 141 GB H200s: TP=4 RECOMPUTE=none TOKENS_PER_MICRO_BATCH=40960 SUBGROUPS_PER_GROUP=2 (what
#     tools/gpu_policy_update.sh ran on 8 x H200: 93.5 GiB peak, 92.4 predicted; docs/PERF.md "Eight GPUs").
#   - Why 30,720 tokens: P + 11 R = 8192 + 11 x 2048. The packer splits each 32-response group into
#     sub-groups of 11, 11 and 10 responses, each carrying the prompt (3 prompt passes per group).
#     The previous 12,288-token budget (selective recomputation) held sub-groups of 2 responses
#     (16 prompt passes per group): 67.1 GiB, 194.5 s predicted, i.e. this layout is predicted to
#     take 38% less time per step. Selective (core_attn) recomputation saves almost nothing with a flash-style attention
#     (only the LSE); full recomputation is what lets the sub-groups grow.
#   - Micro-batches per step: 64 groups x 3 sub-groups / DP 4 = 48 per rank, so
#     --global-batch-size = 4 x 48. Unused slots (shorter responses pack tighter) run no model work.
#   - Static memory with TP=2 and the distributed optimizer over DP=4: bf16 weights 7.6 GiB, fp32 main
#     grads 15.3 GiB, Adam (fp32 master + 2 moments, 12 B/param) sharded 8 ways 11.4 GiB.
#   - Other shapes: rerun the sweep with your rollouts' N, P, R and set TOKENS_PER_MICRO_BATCH
#     (and MICRO_BATCHES_PER_RANK, or SUBGROUPS_PER_GROUP) before a long run; a prompt plus one
#     response longer than the budget is refused by the packer.
#   - TP stays inside the node (NVLink); sequence parallelism shards the norm/dropout activations
#     (the packer pads every micro-batch to a multiple of TP for it).
#   - PP is not supported with packed micro-batches (variable length per micro-batch); CP is
#     refused by the training script for now (the planner's CP rows: docs/PLANNER.md).
set -euo pipefail

ROLLOUTS=${1:?usage: $0 ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]}
CKPT_DIR=${2:?usage: $0 ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]}
LOAD_DIR=${3:--}
shift $(( $# >= 3 ? 3 : $# ))

REPO=$(cd "$(dirname "$0")/../.." && pwd)
NPROC=${NPROC:-8}
TP=${TP:-2}
DP=$(( NPROC / TP ))
RECOMPUTE=${RECOMPUTE:-full}                           # full | selective | none
TOKENS_PER_MICRO_BATCH=${TOKENS_PER_MICRO_BATCH:-30720}
GROUPS_PER_STEP=${GROUPS_PER_STEP:-64}
SUBGROUPS_PER_GROUP=${SUBGROUPS_PER_GROUP:-3}         # N=32, P=8K, R=2K at 30,720 tokens: 11 + 11 + 10
# most packed micro-batches a rank runs per step
MICRO_BATCHES_PER_RANK=${MICRO_BATCHES_PER_RANK:-$(( (GROUPS_PER_STEP * SUBGROUPS_PER_GROUP + DP - 1) / DP ))}

case "$RECOMPUTE" in
  full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
  selective) RECOMPUTE_ARGS=(--recompute-granularity selective) ;;
  none) RECOMPUTE_ARGS=() ;;
  *) echo "RECOMPUTE must be full, selective or none, got '$RECOMPUTE'" >&2; exit 2 ;;
esac

LOAD_ARGS=()
if [[ "$LOAD_DIR" != "-" ]]; then
  LOAD_ARGS=(--load "$LOAD_DIR" --finetune --no-load-optim --no-load-rng)
fi
if [[ -e "$CKPT_DIR/latest_checkpointed_iteration.txt" ]]; then
  LOAD_ARGS=(--load "$CKPT_DIR")   # resume our own run
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --standalone --nproc-per-node "$NPROC" "$REPO/examples/pretrain_grpo_dualkv.py" \
  --model-size 8b --make-vocab-size-divisible-by 64 \
  --rollouts "$ROLLOUTS" --groups-per-step "$GROUPS_PER_STEP" \
  --max-tokens-per-micro-batch "$TOKENS_PER_MICRO_BATCH" \
  --clip-low 0.2 --clip-high 0.28 --kl-beta 0.0 --loss-aggregation token \
  --tensor-model-parallel-size "$TP" --sequence-parallel \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --bf16 "${RECOMPUTE_ARGS[@]}" \
  --micro-batch-size 1 --global-batch-size $(( DP * MICRO_BATCHES_PER_RANK )) \
  --seq-length "$TOKENS_PER_MICRO_BATCH" \
  --train-iters "${TRAIN_ITERS:-1000}" --lr 1e-6 --min-lr 1e-6 --lr-decay-style constant \
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 \
  --save "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-100}" \
  --log-interval 1 --seed 1234 \
  "${LOAD_ARGS[@]}" "$@"
