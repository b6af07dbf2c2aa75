// DualKV forward for Hopper (sm_90a): warpgroup MMA (wgmma) with operands in shared memory.
//
// One CTA = 2 warpgroups = 128 query rows of one query tile and one query head; key tiles of 128
// rows, two shared-memory stages filled by cp.async. S = Q K^T runs as wgmma with both operands
// in shared memory (K-major, 128-byte swizzle); the probabilities stay in registers and feed
// O += P V as the register A operand, with V read N-major (transposed) from shared memory.
// Same contract and work-list format as the row kernels in dualkv_kernels.cu (row items built
// with 128-row query tiles).

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>

#include "dualkv_kernels.h"
#include "wgmma_ops.h"

namespace mdkv {
namespace sm90 {

constexpr int kBQ = 128;  // query rows per CTA (2 warpgroups x 64)
constexpr int kBK = 128;  // key rows per tile
constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
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

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Tile [ROWS][D] as D/64 panels of [ROWS][64]: 128-byte rows, 16-byte chunk c of row r stored at
// chunk (c ^ (r & 7)) -- the hardware's 128-byte swizzle when each panel starts 1024-aligned.
template <int ROWS>
__device__ __forceinline__ int poff(int r, int c) {
  return (c >> 3) * ROWS * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* s, const T* g, long stride, int row0, int row_end) {
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r;
    const bool valid = row < row_end;
    const T* src = g + (valid ? (long)row * stride + c * 8 : 0);
    cp_async16(smem_addr(s + poff<ROWS>(r, c)), src, valid);
  }
}

// wgmma shared-memory descriptor, 128-byte swizzle
__device__ __forceinline__ uint64_t desc(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t a = smem_addr(p);
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) fwd_kernel(FwdArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
  T* sQ = reinterpret_cast<T*>(base);
  T* sK = sQ + kBQ * D;      // 2 stages
  T* sV = sK + 2 * kBK * D;  // 2 stages

  const int item = blockIdx.x / a.hq;
  const int h = blockIdx.x % a.hq;
  const int hk = h / (a.hq / a.hkv);
  const int* w = a.work + item * 8;
  const int q0 = w[0], q1 = w[1], self0 = w[2], par0 = w[3], par1 = w[4];
  const int n_par = (par1 - par0 + kBK - 1) / kBK;
  const int n_total = n_par + (q1 - self0 + kBK - 1) / kBK;
  auto kv_start = [&](int t) { return t < n_par ? par0 + t * kBK : self0 + (t - n_par) * kBK; };
  auto kv_end = [&](int t) { return t < n_par ? par1 : q1; };

  const long qs = (long)a.hq * D, ks = (long)a.hkv * D;
  const T* qg = reinterpret_cast<const T*>(a.q) + h * D;
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * D;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * D;

  const int wg = threadIdx.x >> 7;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_a = q0 + wg * 64 + warp * 16 + (lane >> 2);  // rows row_a and row_a + 8

  load_tile<T, D, kBQ>(sQ, qg, qs, q0, q1);
  load_tile<T, D, kBK>(sK, kg, ks, kv_start(0), kv_end(0));
  load_tile<T, D, kBK>(sV, vg, ks, kv_start(0), kv_end(0));
  cp_async_commit();

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = a.scale_log2;

  for (int t = 0; t < n_total; ++t) {
    const int st = t & 1;
    if (t + 1 < n_total) {
      load_tile<T, D, kBK>(sK + (st ^ 1) * kBK * D, kg, ks, kv_start(t + 1), kv_end(t + 1));
      load_tile<T, D, kBK>(sV + (st ^ 1) * kBK * D, vg, ks, kv_start(t + 1), kv_end(t + 1));
    }
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();

    const T* cK = sK + st * kBK * D;
    const T* cV = sV + st * kBK * D;

    // S [64 x 128] per warpgroup
    float s[64];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t da = desc(sQ + (kk >> 2) * kBQ * 64 + wg * 64 * 64 + (kk & 3) * 16, 16, 1024);
      const uint64_t db = desc(cK + (kk >> 2) * kBK * 64 + (kk & 3) * 16, 16, 1024);
      wgmma_ss<128, T>(s, da, db, kk > 0 ? 1 : 0);
    }
    wg_commit();
    wg_wait<0>();
    reg_fence(s);

    const int k0 = kv_start(t);
    const bool is_par = t < n_par;
    const bool msk = is_par ? (k0 + kBK > par1) : (k0 + kBK - 1 > q0);
    if (msk) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
          const int row = row_a + (e >> 1) * 8;
          const bool ok = is_par ? (col < par1) : (col <= row);
          if (!ok) s[4 * j + e] = -INFINITY;
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      mx = quad_max(mx) * sl2;
      const float mnew = fmaxf(m[r], mx);
      const float b = mnew == -INFINITY ? 0.f : mnew;
      const float alpha = exp2f(m[r] - b);
      m[r] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float p0 = exp2f(fmaf(s[4 * j + 2 * r], sl2, -b));
        const float p1 = exp2f(fmaf(s[4 * j + 2 * r + 1], sl2, -b));
        s[4 * j + 2 * r] = p0;
        s[4 * j + 2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[4 * j + 2 * r] *= alpha;
        o[4 * j + 2 * r + 1] *= alpha;
      }
    }

    uint32_t pa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
    reg_fence(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint64_t db = desc(cV + kk * 16 * 64, kBK * 64 * (int)sizeof(T), 1024);
      wgmma_rs_tb<D, T>(o, pa[kk], db, 1);
    }
    wg_commit();
    wg_wait<0>();
    reg_fence(o);
    __syncthreads();  // stage st is refilled next iteration
  }
  cp_async_wait<0>();

  T* og = reinterpret_cast<T*>(a.out) + h * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const int row = row_a + r * 8;
    if (row < q1) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const uint32_t v = pack2<T>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        *reinterpret_cast<uint32_t*>(og + (long)row * qs + j * 8 + (lane & 3) * 2) = v;
      }
      if ((lane & 3) == 0)
        a.lse[(long)h * a.T + row] = lsum > 0.f ? (m[r] + log2f(lsum)) * 0.69314718055994531f : -INFINITY;
    }
  }
}

template <typename T, int D>
static cudaError_t fwd_t(const FwdArgs& a, cudaStream_t stream) {
  const int smem = (kBQ * D + 4 * kBK * D) * (int)sizeof(T) + 1024;
  auto k = fwd_kernel<T, D>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  if (a.num_items == 0) return cudaSuccess;
  k<<<(unsigned)a.num_items * a.hq, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace sm90

cudaError_t launch_fwd_sm90(const FwdArgs& a, int dtype, int d, cudaStream_t stream) {
  if (dtype == kBF16 && d == 128) return sm90::fwd_t<__nv_bfloat16, 128>(a, stream);
  if (dtype == kBF16 && d == 64) return sm90::fwd_t<__nv_bfloat16, 64>(a, stream);
  if (dtype == kFP16 && d == 128) return sm90::fwd_t<__half, 128>(a, stream);
  if (dtype == kFP16 && d == 64) return sm90::fwd_t<__half, 64>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mdkv
