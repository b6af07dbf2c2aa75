#!/bin/bash
# One device run: GPU tests of the CUDA kernels, then timings. Usage (device machine, repo root):
#   bash csrc/gpu_check.sh [build]      (build: compile the extension there instead of carrying .gpu)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
if [ "$1" = build ] || [ ! -f .gpu/build/_C.so ]; then
  MAX_JOBS=16 python3 csrc/build_ext.py 2>&1 | grep -E "error|registers|spill|built" | tee $OUT/build.log
fi
export MEGATRON_DUALKV_CUDA_LIB=$PWD/.gpu/build/_C.so
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_cuda_kernel.py 2>&1 | tee $OUT/test.log
timeout ${BENCH_TIMEOUT:-200} python3 csrc/bench_cuda.py ${BENCH_ARGS} 2>&1 | tee $OUT/bench.log
if [ -n "$FLEX_COMPARE" ]; then
  timeout ${FLEX_TIMEOUT:-150} python3 tools/bench_kernel.py --quick --backends cuda,flex-triton 2>&1 | tee $OUT/bench_kernel.log
fi
