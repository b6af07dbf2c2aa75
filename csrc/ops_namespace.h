// The torch op namespace the extension registers its ops under: megatron_dualkv, or another given
// at build time (csrc/build_ext.py --ops-namespace NAME, i.e. -DMDKV_OPS_NS=NAME), so that a second
// build loads into the same process beside the first (MEGATRON_DUALKV_CUDA_LIB_EXTRA) and a benchmark
// times the two builds run by run, on the same clocks and the same memory (MEGATRON_DUALKV_OPS=NAME
// picks the build of a call; tools/bench_kernel.py cuda[MEGATRON_DUALKV_OPS=NAME]).
#pragma once
#include <torch/library.h>

#ifndef MDKV_OPS_NS
#define MDKV_OPS_NS megatron_dualkv
#endif

// One level of indirection: TORCH_LIBRARY* paste their namespace argument into names, which would
// keep the token MDKV_OPS_NS unexpanded
#define MDKV_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define MDKV_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define MDKV_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
