// Launch interface of the warp-specialized Hopper forward (csrc/dualkv_fwd_ws_sm90.cu); no torch
// headers. Registered as the torch op megatron_dualkv::fwd_ws_sm90 by csrc/dualkv_ws_ops.cpp.
#pragma once
#include <cuda_runtime.h>

#include "dualkv_kernels.h"

namespace mdkv {

// Same contract and row items (128-row query tiles) as launch_fwd_sm90. Q/K/V are read by TMA:
// q, k, v must be 16-byte aligned (any torch allocation is). Returns cudaErrorInvalidResourceHandle
// when a TMA tensor map cannot be encoded.
cudaError_t launch_fwd_ws_sm90(const FwdArgs& a, int dtype, int d, cudaStream_t stream);

}  // namespace mdkv
