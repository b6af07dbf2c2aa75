#!/bin/bash
# One two-GPU device run (nvidia-h200-x2, NCCL) for issue 5 point 6 and issue 4 point 7, in priority
# order, every step under `timeout` and a whole-run budget (a step that no longer fits is skipped and
# says so), logs under $LOGS packed into $OUT/logs.tar.gz after every step, and a summary table
# printed and written to $OUT/multi_gpu_table.md:
#  1. context parallelism, one group N=16, P=32768, R=2048, CP=1 vs CP=2 (K/V all-gather, all-to-all):
#     cp_attention  the core attention alone, per rank (tools/gpu_cp_attention_cost.py)
#     cp_model      a training step of 4 Qwen3-8B-shaped layers, vocab 32768, per rank
#                   (tools/gpu_cp_check.py --skip-check: its cost phase only)
#     each row names the attention backend that ran (auto: the entry point's choice; the CUDA kernel
#     takes the all-gather variant's local queries where cuda_backend.supports_q_rows() says so, else
#     that variant runs flex); a run with the automatic choice that fails is repeated on flex
#  2. pretrain() over NCCL, DualKV vs --no-dualkv on the same rollouts (8 groups, N=8, P=2048,
#     R 256..1024), 4 iterations each:
#     tp2_*  4 Qwen3-8B-shaped layers, vocab 151936, TP=2 + sequence parallelism
#     ep2_*  4 Qwen3-30B-A3B-shaped layers (128 experts, top-8), vocab 151936, EP=2 (dense part DP=2)
#     --no-dualkv is the stock GPTModel on the replicated batch: without Transformer Engine that is
#     Megatron's local spec, i.e. the unfused DotProductAttention ([rows, heads, S, S] scores).
#     Then, if the budget allows, *_reprollouts: the DualKV model on the same rollouts written with
#     --replicate (exactly the replicated batch on the same DualKV kernel: the same-kernel A/B).
#
# Usage on the device machine, repo root, carrying .whl (megatron-core wheel) and the CUDA extension
# built from this checkout (.gpu/final/_C.so, or $MEGATRON_DUALKV_CUDA_LIB):
#   bash tools/gpu_multi_check.sh           # everything (~6-7 min expected, BUDGET_S caps it)
#   bash tools/gpu_multi_check.sh table     # only rebuild the table from the logs in $LOGS
# Environment: OUT (/tmp/out), LOGS (/tmp/multi_gpu_logs), BUDGET_S (450 s for the steps),
# CP_BACKEND (auto | cuda | flex), MEGATRON_DUALKV_CUDA_LIB (see above), ONLY (a bash regex: run
# only the steps whose name matches, e.g. ONLY='^tp2_'; the others leave no row),
# TORCHRUN (launcher of 2 local ranks; default: python3 -m torch.distributed.run --standalone).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/multi_gpu_logs}
BUDGET_S=${BUDGET_S:-450}
CP_BACKEND=${CP_BACKEND:-auto}
read -r -a TORCHRUN <<< "${TORCHRUN:-python3 -m torch.distributed.run --standalone --nproc_per_node 2}"
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# the extension built from this checkout's csrc (`python csrc/build_ext.py .gpu/final`; the work
# lists are Python-side, so a build from older sources does not match them)
export MEGATRON_DUALKV_CUDA_LIB=${MEGATRON_DUALKV_CUDA_LIB:-$PWD/.gpu/final/_C.so}

# ------------------------------------------------------------------------------------------------
# The summary: stdlib only, reads $LOGS, prints the tables and writes them as markdown.
# ------------------------------------------------------------------------------------------------
HERE=$(cd "$(dirname "$0")" && pwd)
table() {
python3 - "$LOGS" "$OUT/multi_gpu_table.md" "$HERE" <<'PY'
import glob, json, os, re, statistics, sys

logs, out_path = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
from policy_update_table import read_steps, read_text, run_result, step_status  # noqa: E402

md = []
emit = md.append


def load_json(name):
    try:
        with open(os.path.join(logs, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def text(name):
    return read_text(os.path.join(logs, name))


STEPS = read_steps(logs)


def status(name):
    return step_status(STEPS, logs, name)


fmt = lambda x, spec=".1f": "-" if x is None else format(x, spec)

env = load_json("environment.json") or {}
emit("# Two-GPU checks (tools/gpu_multi_check.sh)")
emit("")
for k in ("gpus", "torch", "commit", "cuda_lib", "cuda_takes_local_queries", "cp_backend_requested",
          "backend_full_queries", "backend_local_queries"):
    if k in env:
        emit(f"- {k}: {env[k]}")
emit("")

# -- 1a. core attention ------------------------------------------------------------------------
def diff_cell(r):
    """Max abs and norm-wise relative difference of the output rows vs cp1's: bf16 kernels agree to a
    relative ~1e-2 at most; far more (a wrong row, a wrong key range) is flagged."""
    d, rel = r.get("out_max_abs_diff_vs_cp1"), r.get("out_rel_norm_diff_vs_cp1")
    if d is None:
        return "-"
    return f"{d:.2e}" + ("" if rel is None else f" / rel {rel:.1e}" + (" MISMATCH" if rel > 0.02 else ""))


def attention_section(name):
    att = load_json(name + ".json")
    emit(f"### {name} (step: {status(name)}{'' if att or STEPS.get(name, {}).get('rc') in (None, 'skipped') else ', no result file'})")
    emit("")
    if not att:
        return
    sh, hd = att["shape"], att["heads"]
    emit(f"N={sh['N']}, P={sh['P']}, R={sh['R']} ({sh['tokens']} tokens), Hq {hd['q']}, Hkv {hd['kv']}, D {hd['dim']}, "
         f"{att['dtype']}, {att['device']}, requested backend {att['requested_backend']}; CP=2: "
         f"{att['cp2_rows_per_rank']} rows per rank, {att['cp2_padding_rows']} padding rows, attention-work "
         f"imbalance {att['cp2_attention_imbalance']:.4f}; median of {att['iters']} after a warm-up call. Peak GiB: "
         f"the attention's own tensors (inputs, outputs, gathered K/V, gradients, workspace) above what was "
         f"allocated before them.{' FAILED: ' + att['failed'] if att.get('failed') else ''}")
    emit("")
    emit("| config | rank | backend (entry point) | query rows | fwd ms | fwd+bwd ms | fwd+bwd speedup vs cp1 "
         "(vs cp1 on the same backend) | peak GiB | peak / cp1 | useful TFLOP/s | output vs cp1: max abs / norm-wise rel | warm-up s |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config in att["per_rank"][0]:
        for rank, res in enumerate(att["per_rank"]):
            r, cp1 = res[config], res.get("cp1")
            speed = peak = "-"
            if cp1 and config != "cp1":
                speed = f"{cp1['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x"
                same = cp1 if cp1["backend"] == r["backend"] else res.get(f"cp1@{r['backend']}")
                if same is not None and same is not cp1 and same is not r:
                    speed += f" ({same['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x)"
                if cp1["peak_gib"] and r["peak_gib"]:
                    peak = f"{r['peak_gib'] / cp1['peak_gib']:.2f}"
            emit(f"| {config} | {rank} | {r['backend']}{' (local q)' if r['local_queries'] else ''} | {r['rows']} | "
                 f"{r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | {speed} | {fmt(r['peak_gib'], '.2f')} | {peak} | "
                 f"{r['useful_fwd_bwd_tflops']:.0f} | {diff_cell(r)} | {r['warmup_s']:.1f} |")
    reasons = sorted({f"{n}: {r['backend']} ({r['backend_reason']})" for res in att["per_rank"] for n, r in res.items()})
    emit("")
    emit("Backend choices: " + "; ".join(reasons))
    emit("")


emit("## 1a. CP: DualKV core attention per rank (fwd+bwd, random q/k/v and output gradient)")
emit("")
for name in ("cp_attention", "cp_attention_flex"):
    if name in STEPS or os.path.exists(os.path.join(logs, name + ".json")):
        attention_section(name)


# -- 1b. training step of the model ---------------------------------------------------------------
def model_section(name):
    model = load_json(name + ".json")
    c = (model or {}).get("cost_bf16")
    emit(f"### {name} (step: {status(name)}{'' if c or STEPS.get(name, {}).get('rc') in (None, 'skipped') else ', no result file'})")
    emit("")
    if not c:
        return
    if model["backend"] in ("auto", "None"):  # the entry point's choice, probed with the same request
        chosen = {"cp1": env.get("backend_full_queries"), "cp2_all_gather": env.get("backend_local_queries"),
                  "cp2_a2a": env.get("backend_full_queries")}
    else:
        chosen = dict.fromkeys(("cp1", "cp2_all_gather", "cp2_a2a"), f"{model['backend']} (requested)")
    emit(f"{model['model']}, bf16, {model['device']}, requested backend {model['backend']}; shape {c['shape']} "
         f"({c['tokens']} tokens), CP=2 rows per rank {c['rows_per_rank_cp2']}, attention-work imbalance "
         f"{c['attention_imbalance_cp2']:.4f}. Step = DDP forward_backward (GRPO loss) + finalize_model_grads, "
         f"median after a warm-up step; peak = max allocated during the timed steps (weights, grads, activations).")
    emit("")
    emit("| config | rank | backend | step s | speedup vs cp1, same rank | peak GiB | peak / cp1 | warm-up s |")
    emit("|---|---|---|---|---|---|---|---|")
    for config in ("cp1", "cp2_all_gather", "cp2_a2a"):
        for rank, r in enumerate(c["per_rank"]):
            step, peak = r.get(f"{config}_step_s"), r.get(f"{config}_peak_gib")
            speed = f"{r['cp1_step_s'] / step:.2f}x" if step and config != "cp1" else "-"
            ratio = f"{peak / r['cp1_peak_gib']:.2f}" if peak and r.get("cp1_peak_gib") and config != "cp1" else "-"
            emit(f"| {config} | {rank} | {chosen[config] or '?'} | {fmt(step, '.3f')} | {speed} | "
                 f"{fmt(peak, '.1f')} | {ratio} | {fmt(c['warmup_s'].get(config), '.1f')} |")
    comm = [r.get("cp2_all_gather_comm") for r in c["per_rank"]]
    if all(comm):
        emit("")
        emit("One layer's K/V all-gather vs the rank's attention forward (incl. the gather): " + "; ".join(
            f"rank {i}: {1e3 * x['kv_all_gather_s']:.2f} ms / {1e3 * x['attention_fwd_incl_gather_s']:.2f} ms "
            f"({100 * x['gather_fraction']:.1f}%)" for i, x in enumerate(comm)))
    d = c.get("bf16_vs_cp1", {})
    if d:
        emit("")
        emit("bf16 CP=2 vs CP=1 (informational): " + "; ".join(
            f"{k}: logprobs max abs diff {v['logprobs_max_abs_diff']:.3g}, worst gradient rel {v['grad_rel_max']:.3g}"
            for k, v in d.items()))
    emit("")


emit("## 1b. CP: one training step of Qwen3-8B-shaped layers per rank (tools/gpu_cp_check.py --skip-check)")
emit("")
for name in ("cp_model", "cp_model_flex"):
    if name in STEPS or os.path.exists(os.path.join(logs, name + ".json")):
        model_section(name)

# -- 2. training ----------------------------------------------------------------------------------
RUNS = [
    ("tp2_dualkv", "TP=2+SP, 8B x4 layers", "DualKV"),
    ("tp2_nodualkv", "TP=2+SP, 8B x4 layers", "--no-dualkv (stock GPTModel, replicated batch)"),
    ("tp2_reprollouts", "TP=2+SP, 8B x4 layers", "DualKV on --replicate rollouts (same-kernel replicated)"),
    ("ep2_dualkv", "EP=2 (DP=2), 30B-A3B x4 layers", "DualKV"),
    ("ep2_nodualkv", "EP=2 (DP=2), 30B-A3B x4 layers", "--no-dualkv (stock GPTModel, replicated batch)"),
    ("ep2_reprollouts", "EP=2 (DP=2), 30B-A3B x4 layers", "DualKV on --replicate rollouts (same-kernel replicated)"),
]


def training_row(name):
    r = run_result(logs, name)  # medians after iteration 1, peak per rank, attention backend
    if name.endswith("nodualkv"):
        impl = r["impl"]
        attention = f"stock ({impl or '?'} spec" + (", unfused DotProductAttention)" if impl == "local" else ")")
    else:
        attention = r["attention"] or "?"
    return {"recs": r["recs"], "mem": r["peak"], "attention": attention, "s": r["s"], "tok": r["tok"],
            "packed": r["packed"], "tflops": r["tflops"],
            "dedup": r["recs"][-1]["dedup_ratio"] if r["recs"] else None,
            "mbs": r["totals"]["micro_batches_per_rank"] if r["totals"] else None}


emit("## 2. pretrain() on two GPUs (NCCL): DualKV vs the replicated batch, same rollouts")
emit("")
emit("Rollouts: 8 groups, N=8, P=2048, R uniform 256..1024 (seed 1), bf16, Adam, 4 iterations; timings are "
     "medians of iterations 2-4 (iteration 1 compiles). tok/s = replicated-equivalent tokens (sum of P+R over "
     "responses) per second, the same count for every row. Peak = Megatron's 'max allocated' after the last "
     "iteration, per rank that reports it (Megatron prints it on data-parallel rank 0 only: both TP ranks, "
     "rank 0 alone under EP=2/DP=2).")
emit("")
emit("| run | layout | path | attention | status | s/step | tok/s (repl.-equiv.) | packed tok/s | dedup | useful TFLOP/s/GPU | micro-batches/rank | peak GiB per rank | loss per iteration |")
emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
rows = {}
for name, layout_desc, path in RUNS:
    if name not in STEPS and not os.path.exists(os.path.join(logs, name + ".log")):
        continue
    r = rows[name] = training_row(name)
    mem = ", ".join(f"r{k}: {v:.1f}" for k, v in sorted(r["mem"].items())) or "-"
    losses = " ".join(f"{x['loss']:.5f}" for x in r["recs"]) or "-"
    st = status(name) + (", no step records" if not r["recs"] and STEPS.get(name, {}).get("rc") == "0" else "")
    emit(f"| {name} | {layout_desc} | {path} | {r['attention']} | {st} | {fmt(r['s'], '.3f')} | "
         f"{fmt(r['tok'], ',.0f')} | {fmt(r['packed'], ',.0f')} | {fmt(r['dedup'], '.2f')} | {fmt(r['tflops'], '.0f')} | "
         f"{fmt(r['mbs'], 'd')} | {mem} | {losses} |")
emit("")
for par in ("tp2", "ep2"):
    a = rows.get(f"{par}_dualkv")
    for other, label in (("nodualkv", "--no-dualkv"), ("reprollouts", "replicated rollouts, same kernel")):
        b = rows.get(f"{par}_{other}")
        if a and b and a["s"] and b["s"]:
            pairs = list(zip(a["recs"], b["recs"]))
            worst = max(abs(x["loss"] - y["loss"]) for x, y in pairs)
            emit(f"- {par.upper()}: time per update {label} / DualKV = {b['s'] / a['s']:.2f}x ({b['s']:.3f} vs "
                 f"{a['s']:.3f} s/step; tok/s {b['tok']:,.0f} vs {a['tok']:,.0f}); loss of iterations 1-{len(pairs)}: "
                 f"max abs difference {worst:.2e} (bf16)")
emit("")

# -- steps -------------------------------------------------------------------------------------------
emit("## Steps")
emit("")
emit("| step | status |")
emit("|---|---|")
for name in STEPS:
    emit(f"| {name} | {status(name)} |")
emit("")
report = "\n".join(md) + "\n"
print(report)
with open(out_path, "w") as f:
    f.write(report)
PY
}

if [ "$1" = table ]; then table; exit $?; fi

# ------------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------------
T0=$(date +%s)
rm -rf "$LOGS" && mkdir -p "$LOGS" && : > "$LOGS/steps.tsv"  # no result of an earlier run in the table

source "$(dirname "$0")/gpu_steps.sh"  # step, snapshot

if ls .whl/*.whl > /dev/null 2>&1; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
timeout 30 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ] || { echo "needs 2 GPUs (nvidia-smi -L)"; exit 1; }
timeout 90 python3 - "$LOGS/environment.json" "$CP_BACKEND" <<'PY'
# what the runs will use: GPUs, versions, and the backend the attention entry point picks for full
# and for local (context-parallel all-gather) queries, bf16, the CP runs' request
import json, os, subprocess, sys
import torch
from megatron_dualkv.ops.attention import backend_status, select_backend

requested = None if sys.argv[2] in ("auto", "None") else sys.argv[2]
env = {"gpus": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
       "torch": torch.__version__, "cp_backend_requested": sys.argv[2]}
try:
    env["commit"] = subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                                   timeout=10).stdout.strip()[:100] or "unknown"
except Exception:
    env["commit"] = "unknown"
env["cuda_lib"] = os.environ.get("MEGATRON_DUALKV_CUDA_LIB")
q = torch.empty(1, 32, 128, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
ok, why = backend_status("cuda", q, local_queries=True)
env["cuda_takes_local_queries"] = "yes" if ok else f"no ({why})"
for key, local in (("backend_full_queries", False), ("backend_local_queries", True)):
    try:
        env[key] = "%s (%s)" % select_backend(q, requested, local_queries=local)
    except RuntimeError as exc:
        env[key] = f"none: {exc}"
print(json.dumps(env, indent=1))
json.dump(env, open(sys.argv[1], "w"), indent=1)
PY

# 1. context parallelism (issue 5 point 6). The all-gather variant's local queries run on the CUDA
# kernel only where cuda_backend supports them (new, first GPU run here): when a run with the automatic
# choice fails, it is repeated on flex (same kernel for every row) so that the step still has numbers.
step cp_attention 130 60 "${TORCHRUN[@]}" tools/gpu_cp_attention_cost.py --backend "$CP_BACKEND" \
  --out "$LOGS/cp_attention.json"
MODEL_BACKEND=$CP_BACKEND
if [ "$LAST_RC" != 0 ] && [ "$LAST_RC" != skipped ] && [ "$CP_BACKEND" != flex ]; then
  step cp_attention_flex 110 60 "${TORCHRUN[@]}" tools/gpu_cp_attention_cost.py --backend flex \
    --out "$LOGS/cp_attention_flex.json"
  MODEL_BACKEND=flex
fi
step cp_model 170 90 "${TORCHRUN[@]}" tools/gpu_cp_check.py --skip-check --backend "$MODEL_BACKEND" --layers 4 \
  --out "$LOGS/cp_model.json"
if [ "$LAST_RC" != 0 ] && [ "$LAST_RC" != skipped ] && [ "$MODEL_BACKEND" != flex ]; then
  step cp_model_flex 150 90 "${TORCHRUN[@]}" tools/gpu_cp_check.py --skip-check --backend flex --layers 4 \
    --out "$LOGS/cp_model_flex.json"
fi
for f in "$LOGS"/cp_attention*.json "$LOGS"/cp_model*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done

# 2. pretrain() with TP=2 and EP=2 (issue 4 point 7)
R=/tmp/multi_rollouts.parquet; R_REP=/tmp/multi_rollouts_replicated.parquet
SHAPE=(--groups 8 --responses 8 --prompt-len 2048 --response-len 1024 --response-len-min 256 --seed 1)
timeout 60 python3 tools/make_synthetic_rollouts.py --out "$R" "${SHAPE[@]}" | tee -a "$LOGS/rollouts.log"
timeout 60 python3 tools/make_synthetic_rollouts.py --out "$R_REP" "${SHAPE[@]}" --replicate | tee -a "$LOGS/rollouts.log"
COMMON=(--bf16 --micro-batch-size 1 --train-iters 4 --lr 1e-6 --seq-length 4096 --max-position-embeddings 40960
        --log-interval 1 --log-memory-interval 1 --seed 1234)
TP2=(--model-size 8b --num-layers 4 --tensor-model-parallel-size 2 --sequence-parallel
     --max-tokens-per-micro-batch 16384 --global-batch-size 16)
EP2=(--model-size 30b-a3b --num-layers 4 --expert-model-parallel-size 2
     --max-tokens-per-micro-batch 8192 --global-batch-size 32)
train() {  # train NAME [env assignments] -- script arguments
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  step "$name" 100 60 env "${envs[@]}" "${TORCHRUN[@]}" examples/pretrain_grpo_dualkv.py "${COMMON[@]}" "$@" \
    --step-log "$LOGS/$name.jsonl"
}
TPENV=(CUDA_DEVICE_MAX_CONNECTIONS=1)  # Megatron requires it for TP > 1 before Blackwell
train tp2_dualkv "${TPENV[@]}" -- "${TP2[@]}" --rollouts "$R" --groups-per-step 8
train tp2_nodualkv "${TPENV[@]}" -- "${TP2[@]}" --rollouts "$R" --groups-per-step 8 --no-dualkv
train ep2_dualkv -- "${EP2[@]}" --rollouts "$R" --groups-per-step 8
train ep2_nodualkv -- "${EP2[@]}" --rollouts "$R" --groups-per-step 8 --no-dualkv
train tp2_reprollouts "${TPENV[@]}" -- "${TP2[@]}" --rollouts "$R_REP" --groups-per-step 64
train ep2_reprollouts -- "${EP2[@]}" --rollouts "$R_REP" --groups-per-step 64

echo "=== total $(( $(date +%s) - T0 ))s of steps"
table
snapshot
