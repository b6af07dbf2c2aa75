#!/bin/bash
# flash-attn-4 (FlexAttention's FLASH kernels) for the lent GPU machine, which has no network and
# takes at most 64 MiB per call: its wheels unpack to ~265 MB and compress (xz) to ~69 MB, so
# they travel in two calls while the machine stays warm (docs/PERF.md, eleventh session).
#   here:    bash tools/fa4_carry.sh pack        -> .gpu/fa4a/site.part0 (50 MB), .gpu/fa4b/site.part1
#   call 1:  carry [".gpu/fa4a"]:  bash tools/fa4_carry.sh stage
#   call 2:  carry [".gpu/fa4b", ...], at once:  bash tools/fa4_carry.sh unpack && export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
# The versions pinned below ran with torch 2.11.0+cu130 on the H100 (einops, cuda-bindings and
# protobuf, also needed, are in the machine's image).
set -euo pipefail
FA4=${FA4_VERSION:-4.0.0b36} DSL=${DSL_VERSION:-4.8.1}
case ${1:-} in
  pack)
    tmp=$(mktemp -d)
    plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any"
    # nvidia-cutlass-dsl >= 4.4 is a metadata shim: the DSL itself is in the libs-core/base/cu13 wheels
    python3 -m pip download -q --no-deps $plat -d "$tmp/w" flash-attn-4==$FA4 nvidia-cutlass-dsl==$DSL \
      nvidia-cutlass-dsl-libs-core==$DSL nvidia-cutlass-dsl-libs-base==$DSL nvidia-cutlass-dsl-libs-cu13==$DSL \
      apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
    python3 -m pip install -q --no-deps --no-compile $plat --target "$tmp/site" "$tmp"/w/*.whl
    rm -rf "$tmp/site/bin"
    mkdir -p .gpu/fa4a .gpu/fa4b
    tar cf - -C "$tmp/site" . | xz -9 -T2 > "$tmp/site.tar.xz"
    head -c 50000000 "$tmp/site.tar.xz" > .gpu/fa4a/site.part0
    tail -c +50000001 "$tmp/site.tar.xz" > .gpu/fa4b/site.part1
    rm -rf "$tmp"
    ls -l .gpu/fa4a .gpu/fa4b ;;
  stage)
    mkdir -p /tmp/fa4parts && cp .gpu/fa4a/site.part0 /tmp/fa4parts/ ;;
  unpack)
    [ -d /tmp/site/flash_attn ] && exit 0
    [ -f /tmp/fa4parts/site.part0 ] || { echo "part 0 is gone (the machine went cold): run 'stage' again first"; exit 3; }
    mkdir -p /tmp/site && cat /tmp/fa4parts/site.part0 .gpu/fa4b/site.part1 | xz -dc -T8 | tar x -C /tmp/site ;;
  *) echo "usage: $0 pack|stage|unpack"; exit 2 ;;
esac
