// Shared helpers of the warp-specialized Hopper kernels (csrc/dualkv_*_ws_sm90.cu): mbarriers,
// TMA loads and tensor maps, named barriers, register reallocation (PTX, sm_90a).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "device_common.h"

namespace mdkv {
namespace sm90ws {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ uint32_t mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done;
}
// Spins until the phase of parity `parity` has completed. (Tried: a clock64 timeout with __trap
// to turn a phase bug into a launch error; it made ptxas drop the consumers to ~170 registers
// and spill, so a hang is left to the caller's timeout.)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// 3-D tiled TMA load (coordinates innermost first: column, head, token) completing on `bar`
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// the same with the id an immediate: nothing to compute before the arrive
template <int kId>
__device__ __forceinline__ void named_arrive_id(int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "r"(count) : "memory");
}

// Whether a 384-thread CTA (1 producer + 2 consumer warpgroups, launch bounds 1 block) can run
// regs_dec<producer> / regs_inc<consumer>: it starts with 168 registers per thread, and
// setmaxnreg.inc waits for registers that a dec gave back, so asking for more hangs the
// consumers (it did: 32 / 240 in the wide-key-tile forward experiment, docs/PERF.md).
constexpr bool regs_fit_384(int producer, int consumer) { return (168 - producer) * 128 >= (consumer - 168) * 256; }

template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void reg_fence_u(uint32_t (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

// The K/V ring of the ws forward and dQ kernels (one CTA per query tile and query head): its
// mbarriers, 8 bytes apart from bar0: q_full, then k_full, v_full, k_empty, v_empty [kStages]
// each; key tile t lives in stage t % kStages, the parity of its use of the stage is (t / kStages) & 1.
// full: 1 arrival (the producer's arrive.expect_tx) + the TMA bytes; empty: 8 arrivals (lane 0 of
// each consumer warp).
template <int kStages>
struct KvRing {
  static constexpr int kBarCount = 1 + 4 * kStages;
  uint32_t bar0;
  __device__ __forceinline__ uint32_t q_full() const { return bar0; }
  __device__ __forceinline__ uint32_t k_full(int s) const { return bar0 + 8u * (1 + s); }
  __device__ __forceinline__ uint32_t v_full(int s) const { return bar0 + 8u * (1 + kStages + s); }
  __device__ __forceinline__ uint32_t k_empty(int s) const { return bar0 + 8u * (1 + 2 * kStages + s); }
  __device__ __forceinline__ uint32_t v_empty(int s) const { return bar0 + 8u * (1 + 3 * kStages + s); }
  __device__ __forceinline__ static int stage(int t) { return t % kStages; }
  __device__ __forceinline__ static uint32_t parity(int t) { return (uint32_t)((t / kStages) & 1); }
  // thread 0, before the CTA's first barrier
  __device__ __forceinline__ void init() const {
    mbar_init(q_full(), 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), 8);
      mbar_init(v_empty(s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The producer thread: key tiles 0 .. n - 1 (rows kv_start(t) .. + kBK of kv head hk), K then V of
  // each into its stage once both consumers released the stage's previous tile. g0: the tiles this
  // ring carried before (a persistent CTA's earlier query tiles); tile t is the ring's g0 + t.
  template <typename T, int D, int kBK, typename KvStart>
  __device__ __forceinline__ void load_kv(const CUtensorMap* tm_k, const CUtensorMap* tm_v, T* sK, T* sV, int n,
                                          int hk, const KvStart& kv_start, int g0 = 0) const {
    constexpr uint32_t kTileBytes = kBK * D * sizeof(T);
    for (int t = 0; t < n; ++t) {
      const int g = g0 + t, st = stage(g), k0 = kv_start(t);
      if (g >= kStages) mbar_wait(k_empty(st), parity(g) ^ 1);
      mbar_expect_tx(k_full(st), kTileBytes);
#pragma unroll
      for (int p = 0; p < D / 64; ++p) tma_load(smem_addr(sK + st * kBK * D + p * kBK * 64), tm_k, k_full(st), p * 64, hk, k0);
      if (g >= kStages) mbar_wait(v_empty(st), parity(g) ^ 1);
      mbar_expect_tx(v_full(st), kTileBytes);
#pragma unroll
      for (int p = 0; p < D / 64; ++p) tma_load(smem_addr(sV + st * kBK * D + p * kBK * 64), tm_v, v_full(st), p * 64, hk, k0);
    }
  }
};

// kv-head-major block order of the ws forward and dQ kernels (kv head, row item, query head of its
// group): the CTAs resident at once stream one kv head's K/V, so L2 keeps it (item-major, all 8 kv
// heads' K/V competed: on (16, 65536, 2048) 131 GB of DRAM reads instead of 5, the forward 5 %
// slower; docs/PERF.md). A persistent forward CTA takes its query tiles b in the same order.
struct KvHeadMajorBlock {
  int hk, item, h;
  __device__ __forceinline__ KvHeadMajorBlock(int num_items, int hq, int hkv) : KvHeadMajorBlock(blockIdx.x, num_items, hq, hkv) {}
  __device__ __forceinline__ KvHeadMajorBlock(unsigned b, int num_items, int hq, int hkv) {
    const int group = hq / hkv;
    const int per_hk = num_items * group;
    hk = (int)(b / per_hk);
    item = (int)(b % per_hk) / group;
    h = hk * group + (int)(b % group);
  }
};

// ---------------------------------------------------------------------------------------------
// host: TMA tensor maps
// ---------------------------------------------------------------------------------------------

inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

// [T, heads, D] contiguous as a 3-D tensor (D, heads, T); box = one 64-column panel of `rows` tokens
inline bool make_map(CUtensorMap* map, const void* ptr, CUtensorMapDataType dt, int d, int heads, int T, int rows,
                     int elem) {
  auto fn = encode_tiled();
  if (!fn) return false;
  const cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)heads, (cuuint64_t)T};
  const cuuint64_t strides[2] = {(cuuint64_t)d * elem, (cuuint64_t)heads * d * elem};
  const cuuint32_t box[3] = {64, 1, (cuuint32_t)rows};
  const cuuint32_t estr[3] = {1, 1, 1};
  return fn(map, dt, 3, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90ws
}  // namespace mdkv
