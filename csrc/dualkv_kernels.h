// Launch interface of the DualKV kernels (csrc/dualkv_kernels.cu); no torch headers here so the
// .cu compiles quickly with nvcc. The torch op registration lives in csrc/dualkv_ops.cpp.
#pragma once
#include <cuda_runtime.h>

namespace mdkv {

enum DType { kBF16 = 0, kFP16 = 1 };

struct FwdArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;      // [Tq, Hq, D]
  float* lse;     // [Hq, Tq], natural log
  const int* work;  // row items, 8 int32 each
  int num_items;
  int T, hq, hkv;
  int Tq;  // rows of q / out / lse: T, or fewer for local queries (ws forward only: item field 6)
  float scale, scale_log2;
  // ws forward: a zeroed int, the tiles taken by persistent CTAs (one per SM); null: one CTA per tile
  int* tile_counter = nullptr;
};

struct DeltaArgs {
  const void* out;
  const void* dout;
  const float* dlse;  // [Hq, T] or nullptr
  float* delta;       // [Hq, T]
  int T, hq;
};

// What every backward kernel reads: q [Tq, Hq, D], k, v [T, Hkv, D], dout like q, lse and delta
// [Hq, Tq]: the first members of DqArgs and DkvArgs.
struct BwdInputs {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;
  const float* delta;
};

struct DqArgs : BwdInputs {
  void* dq;
  const int* work;  // row items (same list as the forward)
  // ws dQ kernel launched as a programmatic dependent of the dK/dV kernel: a zeroed int; the CTA
  // that takes the last ticket waits for the dK/dV grid, so the dQ grid never completes first
  int* pdl_ticket = nullptr;
  // ws dQ kernel: consumer 0 skips a last key tile whose keys all lie past its rows
  // (MEGATRON_DUALKV_DQ_SKIP, dq_skip_from_env; an A/B switch)
  int skip_masked_last = 1;
  // ws dQ kernel: consumer 1 of a query tile of 64 rows or fewer issues no MMAs
  // (MEGATRON_DUALKV_DQ_IDLE, dq_idle_from_env; an A/B switch)
  int idle_empty_rows = 1;
  // ws dQ kernel: the parent's partial last key tile walked first, its S and dP at 16 or 32 keys
  // where they hold its keys
  // (MEGATRON_DUALKV_DQ_NARROW, dq_narrow_from_env; an A/B switch)
  int narrow_parent_tail = 1;
  int num_items;
  int T, hq, hkv;
  float scale, scale_log2;
  // rows of q / dout / lse / delta / dq: T, or fewer for local queries (ws dQ kernel only: row
  // item field 6 is the row of q0 there)
  int Tq = 0;
};

// int32 fields of a ws backward kv item (cuda_backend.ws_kv_work)
constexpr int kWsKvItemInts = 10;

struct DkvArgs : BwdInputs {
  void* dk;
  void* dv;
  const int* work;    // kv items, 8 int32 each (ws: kWsKvItemInts)
  const int* ranges;  // 2 int32 per range (ws: 4, see dualkv_bwd_ws_sm90.cu)
  float* dq_acc;      // fast mode (sm90): fp32 [Tq, Hq, D] dQ accumulator (unscaled), atomics; else null
  // ws backward, key tiles split by query rows (kv item field 7 > 0): zeroed fp32 dK/dV sums
  // [slots, hkv, 2, 128, D] and int tickets [slots, hkv]; null when no item is split
  float* split_acc = nullptr;
  int* split_count = nullptr;
  // ws backward, kv items with field 7 < 0: int [slots, hkv], the child step each phase slot's
  // walks are at (any initial value: it only picks where a walk starts)
  int* phase = nullptr;
  // ws backward: every walk takes each query head's tiles last first (a split list, whose items
  // are grouped by the response whose rows they walk: they then all start at the response's end)
  int reverse_rows = 0;
  // deterministic dK/dV kernel (kOverlap): the diagonal steps last, consumer 1 stopping before
  // them (MEGATRON_DUALKV_DET_SKIP, det_skip_from_env; an A/B switch)
  int skip_masked_steps = 1;
  // ws backward: the first long_items kv items (the long band, item field 5) run as head_parts CTAs
  // per kv head, the others as rest_parts, each walking group / parts of the group's query heads,
  // their dK/dV summed in split_acc slots from head_slot_base (fast mode: base + item * (m - 1) +
  // ticket, m = max(head_parts, rest_parts), stored by every part but the last to finish and not
  // zeroed, the item's split_count counting tickets and ready parts; deterministic: base + item * m
  // + part); 1: one CTA walks them all. long_items is item field 5 wherever either parts > 1, else 0. Not on lists
  // with split parts (a prompt tail's part keeps its own slot, walked whole;
  // cuda_backend.ws_head_parts, ws_rest_parts)
  int head_parts = 1, rest_parts = 1, long_items = 0, head_slot_base = 0;
  int num_items;
  int T, hq, hkv;
  int Tq;  // rows of q / dout / lse / delta / dq_acc: T, or fewer for local queries (ws only)
  float scale, scale_log2;
};

cudaError_t launch_fwd(const FwdArgs& a, int dtype, int d, cudaStream_t stream);
// Hopper forward (wgmma; row items built with 128-row query tiles)
cudaError_t launch_fwd_sm90(const FwdArgs& a, int dtype, int d, cudaStream_t stream, int variant = 0);
// delta = rowsum(dO * O) - dlse
cudaError_t launch_delta(const DeltaArgs& da, int dtype, int d, cudaStream_t stream);
// dq = T(dq_acc * scale), n elements (a multiple of 4, both pointers 16-byte aligned): the fp32
// dQ workspace of the fast backwards scaled and rounded in one pass
cudaError_t launch_dq_from_acc(const float* dq_acc, void* dq, long n, float scale, int dtype, cudaStream_t stream);
// Hopper backward (wgmma; row items of 128-row query tiles, kv items of 128-row key tiles)
// ka.dq_acc != nullptr: dQ accumulated by the dK/dV kernel with fp32 atomics (no dQ kernel;
// the caller converts dq_acc), else the deterministic dQ kernel runs.
cudaError_t launch_bwd_sm90(const DeltaArgs& da, const DqArgs& qa, const DkvArgs& ka, int dtype, int d,
                            cudaStream_t stream);
// its deterministic dQ kernel alone (delta already computed): the ws backward's deterministic mode
// with MEGATRON_DUALKV_DQ_KERNEL=sm90 (launch_dq_ws_sm90 otherwise)
cudaError_t launch_dq_sm90(const DqArgs& qa, int dtype, int d, cudaStream_t stream);
// Key rows per step of that dQ kernel, from MEGATRON_DUALKV_DQ_KTILE (read at every launch): 128
// (unset or empty too), 64, or -1 for any other value (the launch then returns cudaErrorInvalidValue)
int dq_key_tile_from_env();
// MEGATRON_DUALKV_DQ_SKIP and MEGATRON_DUALKV_DET_SKIP (read at every launch): 1 (unset or empty
// too), 0, -1 for any other value
int dq_skip_from_env();
int det_skip_from_env();
// MEGATRON_DUALKV_DQ_IDLE, the same way: DqArgs::idle_empty_rows
int dq_idle_from_env();
// MEGATRON_DUALKV_DQ_NARROW, the same way: DqArgs::narrow_parent_tail
int dq_narrow_from_env();
// The deterministic dQ kernel, warp-specialized (csrc/dualkv_dq_ws_sm90.cu): same items, math and
// accumulation order as launch_dq_sm90's (bitwise the same dQ); q, dout, k, v 16-byte aligned (TMA).
// qa.Tq < qa.T: local queries (launch_dq_sm90 takes all T rows only).
// Returns cudaErrorInvalidResourceHandle when a TMA tensor map cannot be encoded.
// pdl: launched as a programmatic dependent launch of the kernel before it in the stream (the
// deterministic dK/dV kernel, which lets it start once all its CTAs have started); qa.pdl_ticket set.
cudaError_t launch_dq_ws_sm90(const DqArgs& qa, int dtype, int d, cudaStream_t stream, bool pdl = false);
// Which dQ kernel the ws backward's deterministic mode runs, from MEGATRON_DUALKV_DQ_KERNEL (read at
// every launch): 1 = "ws" (unset or empty too), 0 = "sm90", -1 = any other value
int dq_kernel_from_env();
// Whether the ws backward's deterministic mode runs its dQ kernel beside the dK/dV kernel (both
// need only delta), from MEGATRON_DUALKV_DQ_STREAM: 2 = "auto" (unset or empty too: where the kv
// list splits key tiles, as "pdl", or as "1" under CUDA_DEVICE_MAX_CONNECTIONS=1), 1 = on a second
// stream, 3 = "pdl" (a programmatic dependent launch behind the dK/dV kernel on the same stream),
// 0 = after it, -1 = any other value
int dq_side_stream_from_env();
cudaError_t launch_bwd(const DeltaArgs& da, const DqArgs& qa, const DkvArgs& ka, int dtype, int d,
                       cudaStream_t stream);

}  // namespace mdkv
