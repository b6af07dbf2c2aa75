#!/usr/bin/env bash
# GRPO policy update of Qwen3-30B-A3B (MoE: 128 experts, top-8) with DualKV packing on 2 nodes x 8 H100.
#
#   sbatch examples/launch/qwen3_30b_a3b_slurm.sh ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]
#
#   ROLLOUTS  rollout groups, JSONL or Parquet (docs/DATA.md), on a filesystem every node sees
#   CKPT_DIR  Megatron checkpoints (resumed from when it holds one)
#   LOAD_DIR  initial policy as a Megatron checkpoint (optional, "-": random init)
#
# Parallel layout (16 GPUs): EP=8 inside a node, TP=1, DP=16 for the dense part (expert DP=2),
# PP=1, CP=1.
#   - Parameters: 29.0B in experts (48 layers x 128 x 3 x 2048 x 768), 1.54B dense (attention
#     0.91B, embeddings + output 0.62B, routers, norms). Per GPU with EP=8: 16 experts per layer,
#     3.6B expert params -> bf16 7.3 GB + fp32 main grads 14.5 GB + Adam 12 B/param sharded over
#     expert-DP=2: 21.8 GB; dense 1.54B -> 3.1 + 6.2 + 12*1.54/16 = 10.5 GB. ~54 GB before activations:
#     the rest holds a packed micro-batch of 8K tokens with full recomputation. tools/plan_memory.py
#     (N=8, P=2048, R=768) predicts 65.7 GiB + 3 reserve of 79 per GPU:
#       python tools/plan_memory.py --model 30b-a3b --tp 1 --ep 8 --dp 16 --n 8 --p 2048 --r 768 \
#           --max-tokens 8192 --recompute full
#     Rerun it (or its --sweep --world 16) with your rollouts' N, P, R before a long run.
#     EP=16 (across nodes) would halve the expert memory but send every token's all-to-all over
#     InfiniBand instead of NVLink; EP=8 keeps the dispatcher inside the node.
#   - TP=1: hidden 2048 and 32 heads / 4 KV groups make the dense matmuls too small to split
#     profitably; TP would add two all-reduces per layer for little memory (dense is 1.5B).
#   - DP=16 over both nodes: only gradients (dense all-reduce, expert reduce over 2 ranks) cross
#     the nodes, overlapped with the backward (--overlap-grad-reduce).
#   - PP is not supported with packed micro-batches; CP comes with its own issue.
#
#SBATCH --job-name=grpo-dualkv-30b-a3b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
set -euo pipefail

ROLLOUTS=${1:?usage: $0 ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]}
CKPT_DIR=${2:?usage: $0 ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]}
LOAD_DIR=${3:--}
shift $(( $# >= 3 ? 3 : $# ))

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
NNODES=${SLURM_NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
EP=${EP:-8}
WORLD=$(( NNODES * GPUS_PER_NODE ))
DP=$WORLD   # TP=1, PP=1, CP=1
MICRO_BATCHES_PER_RANK=${MICRO_BATCHES_PER_RANK:-8}
TOKENS_PER_MICRO_BATCH=${TOKENS_PER_MICRO_BATCH:-8192}
GROUPS_PER_STEP=${GROUPS_PER_STEP:-128}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}

LOAD_ARGS=()
if [[ "$LOAD_DIR" != "-" ]]; then
  LOAD_ARGS=(--load "$LOAD_DIR" --finetune --no-load-optim --no-load-rng)
fi
if [[ -e "$CKPT_DIR/latest_checkpointed_iteration.txt" ]]; then
  LOAD_ARGS=(--load "$CKPT_DIR")
fi

ARGS=(
  --model-size 30b-a3b
  --rollouts "$ROLLOUTS" --groups-per-step "$GROUPS_PER_STEP"
  --max-tokens-per-micro-batch "$TOKENS_PER_MICRO_BATCH"
  --clip-low 0.2 --clip-high 0.28 --kl-beta 0.0 --loss-aggregation token
  --tensor-model-parallel-size 1 --expert-model-parallel-size "$EP"
  --moe-token-dispatcher-type alltoall --moe-router-dtype fp32
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --micro-batch-size 1 --global-batch-size $(( DP * MICRO_BATCHES_PER_RANK ))
  --seq-length "$TOKENS_PER_MICRO_BATCH"
  --train-iters "${TRAIN_ITERS:-1000}" --lr 1e-6 --min-lr 1e-6 --lr-decay-style constant
  --weight-decay 0.01 --clip-grad 1.0
  --save "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-100}"
  --log-interval 1 --seed 1234
  "${LOAD_ARGS[@]}" "$@"
)

export CUDA_DEVICE_MAX_CONNECTIONS=1
srun --kill-on-bad-exit=1 bash -c "torchrun \
  --nnodes $NNODES --nproc-per-node $GPUS_PER_NODE --node-rank \$SLURM_NODEID \
  --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id \$SLURM_JOB_ID \
  $REPO/examples/pretrain_grpo_dualkv.py $(printf '%q ' "${ARGS[@]}")"
