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
#include "sm90_common.h"
#include "work_items.h"

namespace mdkv {
namespace sm90 {

constexpr int kBQ = 128;  // query rows per CTA (2 warpgroups x 64)

// kBK: key rows per tile (128: one CTA per SM; 64: two CTAs per SM, registers capped at 128)
template <typename T, int D, int kBK, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) fwd_kernel(FwdArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
  T* sQ = reinterpret_cast<T*>(base);
  T* sK = sQ + kBQ * D;      // 2 stages
  T* sV = sK + 2 * kBK * D;  // 2 stages

  const int item = blockIdx.x / a.hq;
  const int h = blockIdx.x % a.hq;
  const int hk = h / (a.hq / a.hkv);
  const RowItem<kBK> tile(a.work + item * 8);
  const int q0 = tile.q0, q1 = tile.q1;

  const long qs = (long)a.hq * D, ks = (long)a.hkv * D;
  const T* qg = reinterpret_cast<const T*>(a.q) + h * D;
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * D;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * D;

  const int wg = threadIdx.x >> 7;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_a = q0 + wg * 64 + warp * 16 + (lane >> 2);  // rows row_a and row_a + 8

  load_tile<T, D, kBQ>(sQ, qg, qs, q0, q1);
  load_kv_tile<T, D, kBK>(sK, sV, 0, kg, vg, ks, tile, 0);
  cp_async_commit();

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = a.scale_log2;

  for (int t = 0; t < tile.n_total; ++t) {
    const int st = t & 1;
    if (t + 1 < tile.n_total) load_kv_tile<T, D, kBK>(sK, sV, st ^ 1, kg, vg, ks, tile, t + 1);
    stage_ready();

    const T* cK = sK + st * kBK * D;
    const T* cV = sV + st * kBK * D;

    // S [64 x kBK] per warpgroup
    float s[kBK / 2];
    wg_fence();
    wgmma_rows_x_rows<T, D, kBQ, kBK>(s, sQ, wg * 64, cK);
    wg_commit();
    wg_wait<0>();
    reg_fence(s);

    mask_scores<kBK>(s, tile.kv_start(t), t < tile.n_par, tile.par1, row_a, q0, lane);
    softmax_update<kBK>(s, m, l, sl2, [&](int r, float alpha) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[4 * j + 2 * r] *= alpha;
        o[4 * j + 2 * r + 1] *= alpha;
      }
    });

    uint32_t pa[kBK / 16][4];
    pack_frags<T, kBK>(pa, s);
    reg_fence(o);
    wg_fence();
    wgmma_regs_x_tile<T, D, kBK>(o, pa, cV);
    wg_commit();
    wg_wait<0>();
    reg_fence(o);
    __syncthreads();  // stage st is refilled next iteration
  }
  cp_async_wait<0>();

  store_out_lse<T, D>(reinterpret_cast<T*>(a.out) + h * D, qs, a.lse + (long)h * a.T, row_a, q1, lane, o, m, l);
}

template <typename T, int D, int kBK, int kMinBlocks>
static cudaError_t fwd_t(const FwdArgs& a, cudaStream_t stream) {
  const int smem = (kBQ * D + 4 * kBK * D) * (int)sizeof(T) + 1024;
  return launch_kernel(fwd_kernel<T, D, kBK, kMinBlocks>, (unsigned)a.num_items * a.hq, kThreads, smem, stream, a);
}

}  // namespace sm90

template <typename T, int D>
static cudaError_t fwd_pick(const FwdArgs& a, int variant, cudaStream_t stream) {
  if (variant == 1) return sm90::fwd_t<T, D, 64, 2>(a, stream);
  return sm90::fwd_t<T, D, 128, 1>(a, stream);
}

// variant 0: 128-row key tiles, one CTA per SM; 1: 64-row key tiles, two CTAs per SM
cudaError_t launch_fwd_sm90(const FwdArgs& a, int dtype, int d, cudaStream_t stream, int variant) {
  if (dtype == kBF16 && d == 128) return fwd_pick<__nv_bfloat16, 128>(a, variant, stream);
  if (dtype == kBF16 && d == 64) return fwd_pick<__nv_bfloat16, 64>(a, variant, stream);
  if (dtype == kFP16 && d == 128) return fwd_pick<__half, 128>(a, variant, stream);
  if (dtype == kFP16 && d == 64) return fwd_pick<__half, 64>(a, variant, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mdkv
