// Shared helpers of the Hopper (sm_90a) kernels: cp.async tile loads into the 128-byte-swizzled
// panel layout that wgmma reads and the two-stage pipeline around them, wgmma descriptors and
// fences, the tile-wide wgmma loops and the packing / staging of their register operands.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>

#include "device_common.h"
#include "wgmma_ops.h"

namespace mdkv {
namespace sm90 {

// the shared helpers as members of sm90 too, for the `using sm90::...` declarations of the ws kernels
using mdkv::pack2;
using mdkv::quad_max;
using mdkv::quad_sum;
using mdkv::smem_addr;

constexpr int kThreads = 256;  // 2 warpgroups

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// keeps the compiler from moving accumulator reads/writes across the asynchronous MMA
template <int R>
__device__ __forceinline__ void reg_fence(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Tile [ROWS][D] as D/64 panels of [ROWS][64]: 128-byte rows, 16-byte chunk c of row r stored at
// chunk (c ^ (r & 7)) -- the hardware's 128-byte swizzle when each panel starts 1024-aligned.
template <int ROWS>
__device__ __forceinline__ int poff(int r, int c) {
  return (c >> 3) * ROWS * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

// rows [row0, row0 + ROWS) of a [T, H, D] head (zeros from row_end on) into a panel tile, all threads
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* s, const T* g, long stride, int row0, int row_end) {
  load_rows<T, D, ROWS, kThreads>(s, g, stride, row0, row_end, [](int r, int c) { return poff<ROWS>(r, c); });
}

// K and V rows of key tile t of a row item (RowItem) into stage `stage` of the two-stage buffers
// sk, sv (ROWS x D each)
template <typename T, int D, int ROWS, typename Item>
__device__ __forceinline__ void load_kv_tile(T* sk, T* sv, int stage, const T* kg, const T* vg, long ks,
                                             const Item& tile, int t) {
  load_tile<T, D, ROWS>(sk + stage * ROWS * D, kg, ks, tile.kv_start(t), tile.kv_end(t));
  load_tile<T, D, ROWS>(sv + stage * ROWS * D, vg, ks, tile.kv_start(t), tile.kv_end(t));
}

// Two-stage cp.async pipeline: commit the loads just issued (next stage), wait for the current
// stage's, and make them visible to every thread and to wgmma (async proxy)
__device__ __forceinline__ void stage_ready() {
  cp_async_commit();
  cp_async_wait<1>();
  fence_proxy_async();
  __syncthreads();
}

// wgmma shared-memory descriptor, 128-byte swizzle
__device__ __forceinline__ uint64_t desc(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t a = smem_addr(p);
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// desc(p + bytes, same lbo / sbo) from d = desc(p, lbo, sbo): bytes / 16 more in the start-address
// field (bits 0-13). Shared addresses stay below 2^18, so the field never carries into the next one,
// and the MMA loops below add one constant per k-step instead of rebuilding the descriptor (cvta,
// mask, shift, or: a quarter of the ws backward's executed instructions, docs/PERF.md)
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }

// D[64 x N] (+)= A B^T over all D columns (issue only; the caller fences, commits and waits):
// A = rows a_row0 .. a_row0 + 63 of an [RA x D] tile, B the first N rows of an [RB x D] tile, both
// as panels (poff), K-major; the first MMA overwrites D. With N < RB only D's first N / 2 registers
// (columns 0 .. N - 1 of the accumulator layout) are written.
template <typename T, int D, int RA, int N, int RB = N, int ND>
__device__ __forceinline__ void wgmma_rows_x_rows(float (&d)[ND], const T* sA, int a_row0, const T* sB) {
  static_assert(N <= RB && N / 2 <= ND, "the MMA is wider than the B tile or the accumulator");
  float(&dn)[N / 2] = *reinterpret_cast<float(*)[N / 2]>(&d[0]);
  const uint64_t da0 = desc(sA + a_row0 * 64, 16, 1024), db0 = desc(sB, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t da = desc_plus(da0, ((kk >> 2) * RA * 64 + (kk & 3) * 16) * (int)sizeof(T));
    const uint64_t db = desc_plus(db0, ((kk >> 2) * RB * 64 + (kk & 3) * 16) * (int)sizeof(T));
    wgmma_ss<N, T>(dn, da, db, kk > 0 ? 1 : 0);
  }
}

// An accumulator fragment S [64 x K] (fp32) as the K / 16 register A fragments of a wgmma
template <typename T, int K>
__device__ __forceinline__ void pack_frags(uint32_t (&p)[K / 16][4], const float (&s)[K / 2]) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
    for (int x = 0; x < 4; ++x) p[kk][x] = pack2<T>(s[8 * kk + 2 * x], s[8 * kk + 2 * x + 1]);
}
// the same for two fragments (P^T and dS^T of the dK/dV kernels), interleaved
template <typename T, int K>
__device__ __forceinline__ void pack_frags(uint32_t (&p)[K / 16][4], const float (&s)[K / 2], uint32_t (&q)[K / 16][4],
                                           const float (&t)[K / 2]) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      p[kk][x] = pack2<T>(s[8 * kk + 2 * x], s[8 * kk + 2 * x + 1]);
      q[kk][x] = pack2<T>(t[8 * kk + 2 * x], t[8 * kk + 2 * x + 1]);
    }
}

// D[64 x D] += P B (issue only): P [64 x K] in registers (K / 16 A fragments), B a [K x D] tile
// (panels, read N-major); NK < K / 16: only P's first NK 16-key steps (the rest are zero)
template <typename T, int D, int K, int NK = K / 16>
__device__ __forceinline__ void wgmma_regs_x_tile(float (&d)[D / 2], const uint32_t (&p)[K / 16][4], const T* sB) {
  static_assert(NK >= 1 && NK <= K / 16, "k-steps outside the tile");
  const uint64_t db0 = desc(sB, K * 64 * (int)sizeof(T), 1024);
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) wgmma_rs_tb<D, T>(d, p[kk], desc_plus(db0, kk * 16 * 64 * (int)sizeof(T)), 1);
}

// dQ [64 x 64] (+)= dS K over the 16-key steps kk0 .. kk0 + NK - 1 (issue only): dS^T and K both
// read transposed from shared memory, panels of K key rows (sk: K's panel of these 64 dQ columns)
template <typename T, int K, int NK>
__device__ __forceinline__ void wgmma_ds_x_k(float (&dq)[32], const T* sds, const T* sk, int kk0 = 0) {
  const uint64_t a0 = desc(sds + kk0 * 16 * 64, K * 64 * (int)sizeof(T), 1024);
  const uint64_t b0 = desc(sk + kk0 * 16 * 64, K * 64 * (int)sizeof(T), 1024);
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const uint32_t off = kk * 16 * 64 * (int)sizeof(T);
    wgmma_ss_tt<64, T>(dq, desc_plus(a0, off), desc_plus(b0, off), kk > 0 ? 1 : 0);
  }
}

// This thread's dS^T fragment (register A layout, 64 query columns) into rows row0 + (lane >> 2)
// (+ 8) of an [ROWS x 64] shared panel (poff)
template <typename T, int ROWS>
__device__ __forceinline__ void store_ds_t(T* sds, int row0, int lane, const uint32_t (&da)[4][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row0 + (lane >> 2) + hh * 8;
      *reinterpret_cast<uint32_t*>(sds + poff<ROWS>(r, j) + (lane & 3) * 2) = da[j >> 1][(j & 1) * 2 + hh];
    }
}

}  // namespace sm90
}  // namespace mdkv
