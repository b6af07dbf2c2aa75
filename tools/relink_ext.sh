#!/bin/bash
# Rebuild only some CUDA sources of an already built extension and relink it (seconds instead of
# a full csrc/build_ext.py run): for kernel experiments that touch one translation unit.
#   tools/relink_ext.sh FROM_DIR OUT_DIR SRC.cu|SRC.cpp [...]
# FROM_DIR holds a complete build (build.ninja + objects, e.g. .gpu/final); OUT_DIR gets its
# objects, the given sources recompiled with the same flags (their object = basename.cuda.o, so
# a source from another checkout replaces the one of the same name) and a newly linked _C.so.
# OPS_NS=NAME: the op sources (.cpp) compiled for namespace NAME and the library linked -Bsymbolic,
# a build to load beside a default one (csrc/build_ext.py --ops-namespace; give both .cpp files):
#   OPS_NS=old tools/relink_ext.sh /tmp/b_old /tmp/b_old_ns csrc/dualkv_ops.cpp csrc/dualkv_ws_ops.cpp
set -euo pipefail
from=$1 out=$2; shift 2
mkdir -p "$out"
cp "$from"/*.o "$out"/
flags=$(sed -n 's/^cuda_cflags = //p' "$from/build.ninja")
cxxflags=$(sed -n 's/^cflags = //p' "$from/build.ninja")
ldflags=$(sed -n 's/^ldflags = //p' "$from/build.ninja")
objs=$(sed -n 's/^build _C.so: link //p' "$from/build.ninja")
inc=$(cd "$(dirname "$0")/../csrc" && pwd)
ns=""; [ -n "${OPS_NS:-}" ] && { ns="-DMDKV_OPS_NS=$OPS_NS"; ldflags="$ldflags -Wl,-Bsymbolic"; }
for src in "$@"; do
  if [[ $src == *.cpp ]]; then  # the torch op glue: host compiler, object basename.o
    eval c++ $cxxflags $ns -I"$inc" -c "$src" -o "$out/$(basename "${src%.cpp}").o" || { echo "compile failed: $src"; exit 1; }
    continue
  fi
  obj="$out/$(basename "${src%.cu}").cuda.o"
  log="$out/$(basename "$src").log"
  if ! eval /usr/local/cuda/bin/nvcc $flags -I"$inc" -c "$src" -o "$obj" > "$log" 2>&1; then
    grep -E "error" "$log"; echo "compile failed: $src (log $log)"; exit 1
  fi
  grep -E "spill|warning" "$log" | sort | uniq -c || true
done
(cd "$out" && c++ $objs $ldflags -o _C.so)
echo "linked $out/_C.so"
