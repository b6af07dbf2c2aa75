// Launch interface of the warp-specialized Hopper forward (csrc/dualkv_fwd_ws_sm90.cu); no torch
// headers. Registered as the torch op megatron_dualkv::fwd_ws_sm90 by csrc/dualkv_ws_ops.cpp.
#pragma once
#include <cuda_runtime.h>

#include "dualkv_kernels.h"

namespace mdkv {

// Same contract and row items (128-row query tiles) as launch_fwd_sm90. Q/K/V are read by TMA:
// q, k, v must be 16-byte aligned (any torch allocation is). kv_tile: keys per K/V tile, 128, or
// 176 at d = 128 (cudaErrorInvalidValue otherwise). Returns cudaErrorInvalidResourceHandle when a
// TMA tensor map cannot be encoded.
// narrow_tail: a parent's partial last key tile runs after the row's own tiles with its MMAs
// narrowed to 16, 32, 64 or 128 keys where they cover its keys (16 and 32 unless
// MEGATRON_DUALKV_WS_FWD_TAIL_MIN=64); false: in key order at full width.
// a.tile_counter (a zeroed int) set: persistent CTAs, one per SM, take the query tiles in turn
// (the same results bitwise); null: one CTA per query tile.
cudaError_t launch_fwd_ws_sm90(const FwdArgs& a, int dtype, int d, int kv_tile, bool narrow_tail,
                               cudaStream_t stream);
// The narrowest width of that tail, from MEGATRON_DUALKV_WS_FWD_TAIL_MIN (read at every launch): 16
// (unset or empty too), 64, or -1 for any other value (the launch then returns cudaErrorInvalidValue)
int ws_fwd_tail_min_from_env();
// Whether consumer 0 runs a causal diagonal's key tile at 64 keys after its loop (128-key tiles),
// from MEGATRON_DUALKV_WS_FWD_DIAG: 1 (unset or empty too), 0 (in the loop at full width: an A/B
// switch), -1 for any other value (the launch then returns cudaErrorInvalidValue)
int ws_fwd_diag_from_env();
// Whether consumer 1 of a query tile of 64 rows or fewer (it has no rows) skips its MMAs, from
// MEGATRON_DUALKV_WS_FWD_IDLE: 1 (unset or empty too), 0, -1 for any other value (as above)
int ws_fwd_idle_from_env();

}  // namespace mdkv

namespace mdkv {

// Warp-specialized backward (csrc/dualkv_bwd_ws_sm90.cu): delta = rowsum(dO * O) - dlse, then the
// dK/dV kernel. Fast mode: it also adds unscaled dQ into ka.dq_acc (fp32 [T, Hq, D], zeroed by the
// caller). ka.dq_acc null: dK and dV only, each key tile's in list order (no phase-aligned walks;
// split parts stored to a slot each, summed in part order), bitwise reproducible; the deterministic mode then runs
// launch_dq_ws_sm90 (or launch_dq_sm90). kv items of 128-row key tiles.
// delta_done: delta was computed already (launch_delta), the dK/dV kernel alone is launched.
cudaError_t launch_bwd_ws_sm90(const DeltaArgs& da, const DkvArgs& ka, int dtype, int d, cudaStream_t stream,
                               bool delta_done = false);
// How that kernel adds dQ, from MEGATRON_DUALKV_WS_DQ (read at every launch): 1 = "tma" (unset or
// empty too: one TMA reduce-add per 32-column half of a query tile), 0 = "atomic" (per-thread
// float2 atomics), -1 = any other value (launch_bwd_ws_sm90 then returns cudaErrorInvalidValue).
int ws_dq_mode_from_env();
// Query rows per step of that kernel at head dim 128 with dQ by TMA, from MEGATRON_DUALKV_WS_BWD_QTILE:
// 80 (unset or empty too), 64, or -1 for any other value (launch_bwd_ws_sm90 then returns
// cudaErrorInvalidValue). Head dim 64 and the atomic dQ always step by 64 rows.
int ws_bwd_query_tile_from_env();
// Whether a split kv list (split_slots > 0) walks each head's query tiles last first
// (DkvArgs::reverse_rows), from MEGATRON_DUALKV_WS_REVERSE_ROWS: 1 = "auto" (unset or empty too),
// 0 = "0" (list order, for A/B timings), -1 for any other value.
int ws_reverse_rows_from_env();
// The deterministic dK/dV kernel with the intra-warpgroup overlap (its kOverlap instance, 64-row
// steps), from MEGATRON_DUALKV_DET_OVERLAP: 1 (unset or empty too), 0 = without (the default
// query tile), -1 = any other value (launch_bwd_ws_sm90 then returns cudaErrorInvalidValue)
int det_overlap_from_env();

}  // namespace mdkv
