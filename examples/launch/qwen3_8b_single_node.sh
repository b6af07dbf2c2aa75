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
# Parallel layout (8 GPUs): TP=2 with sequence parallelism, DP=4, PP=1, CP=1.
#   - Memory per GPU with TP=2 and the distributed optimizer over DP=4: bf16 weights 8.2 GB,
#     fp32 main grads 16.4 GB, Adam state (fp32 master + 2 moments, 12 B/param) 98 GB / (2*4) = 12.3 GB:
#     ~37 GB before activations. TP=1 would need ~60 GB before activations.
#   - Micro-batch budget 12K tokens with selective recomputation. tools/plan_memory.py (N=8, P=4096,
#     R=1536, groups split into sub-groups that carry the prompt) predicts 66.9 GiB + 3 reserve of
#     79 per GPU; 16K tokens needs full recomputation (50.7 GiB, predicted a little slower), 16K
#     with selective does not fit (89 GiB):
#       python tools/plan_memory.py --model 8b --tp 2 --dp 4 --n 8 --p 4096 --r 1536 \
#           --max-tokens 12288 --recompute selective
#     Rerun it with your rollouts' N, P, R before a long run.
#   - TP=2 keeps TP inside NVLink pairs; sequence parallelism shards norms/dropout activations
#     (the packer pads every micro-batch to a multiple of TP for it).
#   - PP is not supported with packed micro-batches (variable length per micro-batch), CP comes
#     with its own issue.
set -euo pipefail

ROLLOUTS=${1:?usage: $0 ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]}
CKPT_DIR=${2:?usage: $0 ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]}
LOAD_DIR=${3:--}
shift $(( $# >= 3 ? 3 : $# ))

REPO=$(cd "$(dirname "$0")/../.." && pwd)
NPROC=${NPROC:-8}
TP=${TP:-2}
DP=$(( NPROC / TP ))
MICRO_BATCHES_PER_RANK=${MICRO_BATCHES_PER_RANK:-8}   # most packed micro-batches a rank runs per step
TOKENS_PER_MICRO_BATCH=${TOKENS_PER_MICRO_BATCH:-12288}
GROUPS_PER_STEP=${GROUPS_PER_STEP:-64}

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
  --bf16 --recompute-granularity selective \
  --micro-batch-size 1 --global-batch-size $(( DP * MICRO_BATCHES_PER_RANK )) \
  --seq-length "$TOKENS_PER_MICRO_BATCH" \
  --train-iters "${TRAIN_ITERS:-1000}" --lr 1e-6 --min-lr 1e-6 --lr-decay-style constant \
  --weight-decay 0.01 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 \
  --save "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-100}" \
  --log-interval 1 --seed 1234 \
  "${LOAD_ARGS[@]}" "$@"
