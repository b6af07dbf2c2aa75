#!/usr/bin/env bash
# GRPO policy update of Qwen3-30B-A3B (MoE: 128 experts, top-8) with DualKV packing on 2 nodes x 8 H100.
#
#   sbatch examples/launch/qwen3_30b_a3b_slurm.sh ROLLOUTS CKPT_DIR [LOAD_DIR] [extra flags...]
#
#   ROLLOUTS  rollout groups, JSONL or Parquet (docs/DATA.md), on a filesystem every node sees
#   CKPT_DIR  Megatron checkpoints (resumed from when it holds one)
#   LOAD_DIR  initial policy as a Megatron checkpoint (optional, "-": random init)
#
# Parallel layout (16 GPUs): TP=4 with sequence parallelism inside a node, DP=4, EP=8 inside a node
# (expert TP=1, expert DP=2), PP=1, CP=1, full recomputation, 40,960 tokens per micro-batch.
# Chosen with tools/plan_memory.py for the issue-8 workload (N=32 responses of R=2048 tokens on a
# P=8192-token prompt, 128 groups per step); predictions from assumed rates, not measured on a GPU
# (docs/PLANNER.md; numbers from the planner at commit dc30cb8; its calibration against the
# measured GPU runs of 2026-11-22 moved them by 1-3 %, e.g. this layout 64.6 GiB and 121.5 s,
# and did not change the choice):
#     python tools/plan_memory.py --model 30b-a3b --sweep --world 16 --n 32 --p 8192 --r 2048 \
#         --groups-per-step 128 --no-cp --dualkv-only
#   | layout                      | recompute | responses per sub-group | mb/rank | GiB  | step s |
#   | TP4+SP DP4 EP8 EDP2         | full      | 16 of 32                | 64      | 64.4 | 119.8  |  <- this script
#   | TP2+SP DP8 EP8 EDP2         | full      | 11 of 32                | 48      | 74.4 | 123.2  |
#   | TP4+SP DP4 EP4 EDP4         | full      | 8 of 32                 | 128     | 74.6 | 133.8  |
#   | TP2+SP DP8 EP4 ETP2 EDP2    | full      | 11 of 32                | 48      | 74.4 | 138.4  |
#   | TP4+SP DP4 EP16 EDP1        | none      | 8 of 32                 | 128     | 74.6 | 155.1  |
#   | TP4+SP DP4 EP2 ETP4 EDP2    | full      | 16 of 32                | 64      | 64.4 | 161.2  |
#   | TP1 DP16 EP8 EDP2           | full      | 4 of 32                 | 64      | 71.8 | 162.0  |  (previous layout)
#   ("GiB": predicted peak per GPU before the planner's 3 GiB reserve; the budget is 79.1. The best
#   stock, replicated layout, TP4+SP DP4 EP8, is predicted at 261.6 s: 2.18x.)
#     python tools/plan_memory.py --model 30b-a3b --tp 4 --dp 4 --ep 8 --etp 1 --n 32 --p 8192 \
#         --r 2048 --groups-per-step 128 --max-tokens 40960 --recompute full --dualkv-only
#   -> weights 7.5 + fp32 grads 15.0 + Adam 21.4 + activations 2.1 + logits 4.6 + transient 13.9
#      = 64.4 GiB (+3 reserve) of 79; 119.8 s per step (attention 53.8, dense 8.0, experts 21.1,
#      TP communication 7.8, EP all-to-all 27.1), MFU 20.8%.
#   - Why 40,960 tokens: P + 16 R = 8192 + 16 x 2048; the packer splits each 32-response group into
#     2 sub-groups of 16, each carrying the prompt. The previous 8,192-token budget cannot hold the
#     prompt plus one response (10,240 tokens): the packer refuses the workload. At TP=1 the largest
#     budget that fits is 16,384 tokens (sub-groups of 4, the prompt computed 8 times per group):
#     162.0 s, so this layout is predicted 26% less time per step.
#   - Why TP=4 + SP: TP divides the vocabulary-sized logits ([response tokens, 151936 / TP] fp32, the
#     largest activation) and the layer activations, so 4x larger sub-groups fit; with SP each rank
#     also dispatches only its shard of the tokens, which cuts the EP all-to-all volume per GPU.
#     The TP collectives stay on NVLink and are counted above (7.8 s of 119.8). TP2+SP DP8 is
#     within 3% but predicted at 74.4 GiB; TP4 leaves the most headroom of the top rows.
#   - --expert-tensor-parallel-size 1: otherwise Megatron sets expert TP = TP (4), which all-gathers
#     the dispatched tokens (the EP2 ETP4 row, 161.2 s). TP4 x DP4 = 16 for the dense part, EP8 x
#     ETP1 x expert-DP2 = 16 for the experts.
#   - EP=8 inside the node: 16 experts per layer per GPU; EP=16 would send the all-to-all over
#     InfiniBand (the best EP=16 layout ranks 5th, 155.1 s, 79.5 s of it communication). Experts
#     29.0B -> 3.6B per GPU: the dominant static item (Adam sharded over expert-DP 2).
#   - --moe-grouped-gemm: the experts as grouped GEMMs (the planner's expert rate assumes them):
#     Transformer Engine's TEGroupedMLP where TE is installed, else this package's
#     GroupedGemmSequentialMLP (docs/MEGATRON.md). Without it Megatron loops over the local experts.
#   - Full recomputation is the price of a big micro-batch without CP (the same micro-batch without
#     recomputation: 115.1 GiB predicted).
#   - Micro-batches per step: 128 groups x 2 sub-groups / DP 4 = 64 per rank, so
#     --global-batch-size = 4 x 64. Unused slots (shorter responses pack tighter) run no model work.
#   - Other shapes: rerun the sweep with your rollouts' N, P, R and set TP, EP,
#     TOKENS_PER_MICRO_BATCH (and MICRO_BATCHES_PER_RANK or SUBGROUPS_PER_GROUP) before a long run.
#   - PP is not supported with packed micro-batches; CP is refused by the training script for now.
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
TP=${TP:-4}
EP=${EP:-8}
WORLD=$(( NNODES * GPUS_PER_NODE ))
DP=$(( WORLD / TP ))   # PP=1, CP=1
TOKENS_PER_MICRO_BATCH=${TOKENS_PER_MICRO_BATCH:-40960}
GROUPS_PER_STEP=${GROUPS_PER_STEP:-128}
SUBGROUPS_PER_GROUP=${SUBGROUPS_PER_GROUP:-2}   # N=32, P=8K, R=2K at 40,960 tokens: 16 + 16
MICRO_BATCHES_PER_RANK=${MICRO_BATCHES_PER_RANK:-$(( (GROUPS_PER_STEP * SUBGROUPS_PER_GROUP + DP - 1) / DP ))}
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
  --tensor-model-parallel-size "$TP" --sequence-parallel
  --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
  --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-grouped-gemm
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
