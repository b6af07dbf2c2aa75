#!/bin/bash
# Policy-update runs on one node of GPUs (issue 8): a Qwen3 shape at real size, random init, the same
# rollouts four ways, each step under `timeout` and one whole-run budget:
#   <m>_dualkv       DualKV packing (P + sum R tokens per group), our CUDA kernels
#   <m>_reprollouts  the same rollouts written with --replicate (every response its own group with its
#                    own prompt copy) through the same model and kernel: the replicated batch with the
#                    fastest attention available here (flash-style, no padding)
#   <m>_nodualkv_sdpa  --no-dualkv --stock-attention sdpa: Megatron's stock GPTModel on the replicated
#                    batch (right-padded rows) with torch SDPA as its core attention (flash-style without TE)
#   <m>_nodualkv     --no-dualkv: the same with the spec's own attention; without Transformer Engine
#                    that is the local spec's unfused DotProductAttention
# then the table (tools/policy_update_table.py) printed and written to $OUT/policy_update_table.md.
#
# Usage on the device machine, repo root, carrying .whl (megatron-core wheel) and the CUDA extension
# built from this checkout (.gpu/final/_C.so, or $MEGATRON_DUALKV_CUDA_LIB):
#   MODEL=8b bash tools/gpu_policy_update.sh          # Qwen3-8B, TP=4 + SP, DP=2
#   MODEL=30b-a3b bash tools/gpu_policy_update.sh     # Qwen3-30B-A3B, TP=2 + SP, DP=4, EP=8
#   bash tools/gpu_policy_update.sh table             # only rebuild the table from $LOGS
# Environment: MODEL, NPROC (8), NGROUPS (rollout groups, all in every step: 4), N (32), P (8192),
# R_MAX (2048), R_MIN (512), VOCAB (151936), ROLLOUT_DIR (/tmp: the two rollout files), ITERS (3), TOKENS (tokens per micro-batch), BUDGET_S (540), ONLY (bash
# regex of step names), OUT (/tmp/out), LOGS (/tmp/policy_update_logs), PEAK_TFLOPS (989: H100/H200
# dense bf16), NODUALKV_MAX_S (300: the --no-dualkv step's timeout), EXTRA (more flags for every run, after the model preset: they win), DRY_CPU=1 (check the
# script's glue on a CPU: gloo through tests/pretrain_on_cpu.py, float32, no distributed optimizer, no
# GPU check; with EXTRA shrinking the model and small N, P, R).
#
# Layouts (chosen with tools/plan_memory.py --memory-gib 139 for 141 GB H200s, docs/PERF.md):
#   8b       TP4+SP DP2, no recomputation, 40,960 tokens: 92.4 GiB predicted (DualKV)
#   30b-a3b  TP2+SP DP4 EP8 ETP1, full recomputation, 40,960 tokens: 107.9 GiB predicted
# The stock --no-dualkv path keeps [heads, S, S] probabilities per row and layer: it runs with full
# recomputation and P + R_MAX-token micro-batches (10,240: a prompt and one or two responses).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron asks for it with TP > 1 before Blackwell
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/policy_update_logs}
BUDGET_S=${BUDGET_S:-540}
MODEL=${MODEL:-8b}
NPROC=${NPROC:-8}
NGROUPS=${NGROUPS:-4}; N=${N:-32}; P=${P:-8192}; R_MAX=${R_MAX:-2048}; R_MIN=${R_MIN:-512}
ITERS=${ITERS:-3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export MEGATRON_DUALKV_CUDA_LIB=${MEGATRON_DUALKV_CUDA_LIB:-$PWD/.gpu/final/_C.so}

table() { python3 "$HERE/policy_update_table.py" "$LOGS" "$OUT/policy_update_table.md"; }
if [ "$1" = table ]; then table; exit $?; fi

case "$MODEL" in
  8b)
    TOKENS=${TOKENS:-40960}; DP=$(( NPROC / 4 ))
    LAYOUT="TP4+SP DP$DP, recompute none, $TOKENS tok/mb"
    PAR=(--tensor-model-parallel-size 4 --sequence-parallel) ; RECOMPUTE=() ;;
  30b-a3b)
    TOKENS=${TOKENS:-40960}; DP=$(( NPROC / 2 ))
    LAYOUT="TP2+SP DP$DP EP$NPROC ETP1, recompute full, $TOKENS tok/mb"
    PAR=(--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size "$NPROC"
         --expert-tensor-parallel-size 1)
    RECOMPUTE=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
  *) echo "MODEL must be 8b or 30b-a3b, got '$MODEL'" >&2; exit 2 ;;
esac
FULL=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
M=${MODEL%%-*}; M=q${M}  # step prefix: q8b, q30b

T0=$(date +%s)
rm -rf "$LOGS" && mkdir -p "$LOGS" && : > "$LOGS/steps.tsv" && : > "$LOGS/runs.jsonl"
source "$HERE/gpu_steps.sh"  # step, snapshot

if ls .whl/*.whl > /dev/null 2>&1; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
timeout 30 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
if [ -n "$DRY_CPU" ]; then
  LAUNCH=tests/pretrain_on_cpu.py; GPU_FLAGS=()
else
  [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge "$NPROC" ] || { echo "needs $NPROC GPUs (nvidia-smi -L)"; exit 1; }
  LAUNCH=examples/pretrain_grpo_dualkv.py; GPU_FLAGS=(--bf16 --use-distributed-optimizer --overlap-grad-reduce)
fi
timeout 90 python3 - "$LOGS/environment.json" <<'PY'
import json, os, subprocess, sys
import torch
env = {"gpus": ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})),
       "gpu_count": torch.cuda.device_count(), "torch": torch.__version__,
       "cuda_lib": os.environ.get("MEGATRON_DUALKV_CUDA_LIB")}
try:
    env["commit"] = subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                                   timeout=10).stdout.strip()[:100] or "unknown"
except Exception:
    env["commit"] = "unknown"
print(json.dumps(env))
json.dump(env, open(sys.argv[1], "w"), indent=1)
PY

ROLLOUT_DIR=${ROLLOUT_DIR:-/tmp}; R=$ROLLOUT_DIR/pu_rollouts.parquet; R_REP=$ROLLOUT_DIR/pu_rollouts_replicated.parquet
SHAPE=(--groups "$NGROUPS" --responses "$N" --prompt-len "$P" --response-len "$R_MAX" --response-len-min "$R_MIN"
       --vocab-size "${VOCAB:-151936}" --seed 1)
timeout 120 python3 tools/make_synthetic_rollouts.py --out "$R" "${SHAPE[@]}" | tee -a "$LOGS/rollouts.log"
timeout 120 python3 tools/make_synthetic_rollouts.py --out "$R_REP" "${SHAPE[@]}" --replicate | tee -a "$LOGS/rollouts.log"

# every step sees all GROUPS groups (the same data each iteration and in every run); lr 1e-6 moves no
# bf16 weight, so the runs compare paths on the same work and do not train
COMMON=(--model-size "$MODEL" "${GPU_FLAGS[@]}" --micro-batch-size 1 --train-iters "$ITERS" --lr 1e-6 --min-lr 1e-6
        --lr-decay-style constant --log-interval 1 --log-memory-interval 1 --seed 1234
        --peak-tflops "$PEAK_TFLOPS" $EXTRA)

train() {  # train NAME MAX_S MIN_S PATH BASELINE_OF -- script arguments
  local name=$1 max=$2 min=$3 path=$4 base=$5; shift 6
  local cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$LAUNCH"
             "${COMMON[@]}" "$@" --step-log "$LOGS/$name.jsonl")
  python3 - "$LOGS/runs.jsonl" "$name" "$MODEL" "$LAYOUT" "$path" "$base" "${cmd[@]}" <<'PY'
import json, shlex, sys
f, name, model, layout, path, base, *cmd = sys.argv[1:]
with open(f, "a") as out:
    out.write(json.dumps({"name": name, "model": model, "layout": layout, "path": path,
                          "baseline_of": base or None, "command": shlex.join(cmd)}) + "\n")
PY
  step "$name" "$max" "$min" "${cmd[@]}"
}

TOK=(--max-tokens-per-micro-batch "$TOKENS" --seq-length "$TOKENS")
train "${M}_dualkv" 200 90 "DualKV" "" -- "${PAR[@]}" "${RECOMPUTE[@]}" "${TOK[@]}" \
  --rollouts "$R" --groups-per-step "$NGROUPS" --global-batch-size $(( DP * 8 ))
if [ "$LAST_RC" != 0 ] && [ "$LAST_RC" != skipped ] && grep -q "out of memory" "$LOGS/${M}_dualkv.log"; then
  LAYOUT="$LAYOUT (retry: $(( TOKENS * 3 / 4 )) tok/mb)"
  train "${M}_dualkv_smaller" 200 90 "DualKV" "" -- "${PAR[@]}" "${RECOMPUTE[@]}" \
    --max-tokens-per-micro-batch $(( TOKENS * 3 / 4 )) --seq-length $(( TOKENS * 3 / 4 )) \
    --rollouts "$R" --groups-per-step "$NGROUPS" --global-batch-size $(( DP * 12 ))
  BASE="${M}_dualkv_smaller"
else
  BASE="${M}_dualkv"
fi
train "${M}_reprollouts" 300 120 "DualKV model on --replicate rollouts" "$BASE" -- "${PAR[@]}" "${RECOMPUTE[@]}" \
  "${TOK[@]}" --rollouts "$R_REP" --groups-per-step $(( NGROUPS * N )) --global-batch-size $(( DP * 24 ))
STOCK_TOKENS=$(( P + R_MAX ))  # a prompt and one longest response
BASE_LAYOUT=$LAYOUT
LAYOUT="${BASE_LAYOUT%%, recompute*}, recompute $( (( ${#RECOMPUTE[@]} )) && echo full || echo none), $STOCK_TOKENS tok/mb"
train "${M}_nodualkv_sdpa" 240 90 "--no-dualkv --stock-attention sdpa (stock GPTModel)" "$BASE" -- "${PAR[@]}" \
  "${RECOMPUTE[@]}" --max-tokens-per-micro-batch "$STOCK_TOKENS" --seq-length "$STOCK_TOKENS" \
  --rollouts "$R" --groups-per-step "$NGROUPS" --global-batch-size $(( DP * 96 )) --no-dualkv --stock-attention sdpa
LAYOUT="${BASE_LAYOUT%%, recompute*}, recompute full, $STOCK_TOKENS tok/mb"
train "${M}_nodualkv" "${NODUALKV_MAX_S:-300}" 150 "--no-dualkv (stock GPTModel)" "$BASE" -- "${PAR[@]}" "${FULL[@]}" \
  --max-tokens-per-micro-batch "$STOCK_TOKENS" --seq-length "$STOCK_TOKENS" --train-iters 2 \
  --rollouts "$R" --groups-per-step "$NGROUPS" --global-batch-size $(( DP * 96 )) --no-dualkv

echo "=== total $(( $(date +%s) - T0 ))s of steps"
table
snapshot
