# Sourced by the device scripts (tools/gpu_session_check.sh, tools/flash_compare.sh): what both do
# on the GPU machine, written once.

# megatron-core from the carried wheel (.whl/) into /tmp/site; the machine has no network
install_megatron_wheel() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
}

# Sample SM clock, power, temperature and throttle reasons into FILE every MS milliseconds in the
# background (SMI_PID), for tools/smi_summary.py: at the power cap a time is only comparable beside
# its clock (docs/PERF.md, tenth session). smi_stop ends the sampler.
smi_start() {
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms "$2" > "$1" 2>/dev/null &
  SMI_PID=$!
}
smi_stop() {
  kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; return 0
}
