#!/bin/bash
# Ours against FlexAttention's FLASH backend (flash-attn-4) in one device run, both orders. The
# side-by-side table of ratios (tools/compare_backends.py) goes to stdout at the end: a device call
# returns at most 8 files (docs/PERF.md, eighteenth session).
# On the device machine, repo root, after `tools/fa4_carry.sh stage` (carry .gpu/fa4a) in the call
# before, carrying .gpu/fa4b, .whl and the build under test:
#   MEGATRON_DUALKV_CUDA_LIB=$PWD/.gpu/head/_C.so bash tools/flash_compare.sh          # fwd+bwd and
#       forward-only, one pass in each order, median of $REPS (7); all ten published shapes
#   SHAPES=28x4096x2048,28x16384x2048 PASSES=4 bash tools/flash_compare.sh fwd       # forward only,
#       $PASSES passes alternating the order
#   MATMUL=1 ...                                      # also the card's bf16 matmul rate before and after
#       (tools/bench_matmul.py) and every row as a fraction of its sustained rate
#   INTERLEAVE=1 ...                                  # the two backends take turns run by run
#       (bench_kernel.py --interleave): the same clocks and inputs for both on a card at its power cap
#   SHOW_RUNS=1 ...                                   # every timed run's ms in the fbN / foN logs
#       (with INTERLEAVE=1 also the per-round ratios of tools/paired_runs.py at the end)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
bash tools/fa4_carry.sh unpack || exit 3
install_megatron_wheel 2>/dev/null || exit 1
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export MEGATRON_DUALKV_CUDA_LIB=${MEGATRON_DUALKV_CUDA_LIB:-$PWD/.gpu/final/_C.so}
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
smi_start "$OUT/smi.csv" 100
S=${SHAPES:+--shapes $SHAPES}
MODE=${1:-all}
rm -f "$OUT"/f[bo][0-9]*.md "$OUT"/f[bo][0-9]*.log "$OUT"/mm[0-9]*.md  # the summaries read every table and log left in $OUT
[ -n "$MATMUL" ] && python3 tools/bench_matmul.py --out "$OUT/mm1.md" > "$OUT/mm1.log" 2>&1
if [ "$MODE" = fwd ]; then
  runs=(); for p in $(seq ${PASSES:-4}); do
    be=cuda,flex-flash; [ $((p % 2)) = 0 ] && be=flex-flash,cuda; runs+=("fo$p $be --fwd-only"); done
else
  runs=("fb1 cuda,flex-flash" "fb2 flex-flash,cuda" "fo1 cuda,flex-flash --fwd-only" "fo2 flex-flash,cuda --fwd-only")
fi
for spec in "${runs[@]}"; do
  set -- $spec; name=$1; be=$2; shift 2
  t0=$(date +%s)
  python3 tools/bench_kernel.py --backends "$be" --reps "${REPS:-7}" --warmup 2 $S ${INTERLEAVE:+--interleave} ${SHOW_RUNS:+--show-runs} "$@" --out "$OUT/$name.md" \
    > "$OUT/$name.log" 2>&1
  rc=$?; echo "$name rc=$rc $(( $(date +%s) - t0 ))s"; [ $rc = 0 ] || tail -5 "$OUT/$name.log"
done
[ -n "$MATMUL" ] && python3 tools/bench_matmul.py --idle 1 --out "$OUT/mm2.md" > "$OUT/mm2.log" 2>&1
smi_stop
[ -n "$MATMUL" ] && cat "$OUT/mm1.md" "$OUT/mm2.md" && python3 tools/bench_matmul.py --yardstick "$OUT"
python3 tools/compare_backends.py "$OUT" $([ "$MODE" = fwd ] && echo --fwd)
# per-round ratios (same clocks within a round) where every run was printed
[ -n "$INTERLEAVE" ] && [ -n "$SHOW_RUNS" ] && for k in fb fo; do
  ls "$OUT"/$k[0-9]*.log > /dev/null 2>&1 && python3 tools/paired_runs.py "$OUT"/$k[0-9]*.log; done
python3 tools/smi_summary.py "$OUT/smi.csv"
