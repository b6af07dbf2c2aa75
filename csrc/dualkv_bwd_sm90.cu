// DualKV backward for Hopper (sm_90a): wgmma versions of the dK/dV and dQ kernels.
//
// dK/dV: one CTA = 2 warpgroups = one key tile of 128 rows (64 per warpgroup) and one kv head;
// it walks the query heads of its GQA group and every 64-row query tile that attends the key tile
// (the causal rows of its own segment, then the merged child ranges in full), double-buffering
// Q, dO, lse and delta. Per query tile and warpgroup:
//   S^T = K Q^T, dP^T = V dO^T               (wgmma, both operands in shared memory, K-major)
//   P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta)   (registers)
//   dV += P^T dO, dK += dS^T Q               (wgmma, A from registers, B = dO / Q N-major)
// dQ: one CTA = 2 warpgroups = one 128-row query tile of one query head, key tiles of 128 rows
// (kRK below):
//   S = Q K^T, dP = dO V^T; dS = P (dP - delta); dQ += dS K.
// Both accumulate dK/dV (and dQ in the dQ kernel) in registers in a fixed order: deterministic.
// Fast mode (kAtomicDQ) adds dQ to an fp32 buffer with atomics from the dK/dV kernel instead.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include <type_traits>

#include "dualkv_kernels.h"
#include "env_choice.h"
#include "wgmma_ops.h"
#include "sm90_common.h"
#include "work_items.h"

namespace mdkv {
namespace sm90 {

constexpr int kKV = 128;  // dK/dV: key rows per CTA
constexpr int kQT = 64;   // dK/dV: query rows per step
constexpr int kRQ = 128;  // dQ: query rows per CTA
// dQ: key rows per step, 64 or 128 (the default: half the steps, each with its barrier and waits;
// the same k16 slices in the same key order, so dQ is bitwise the same); MEGATRON_DUALKV_DQ_KTILE=64
// picks 64 (an A/B switch)

// kAtomicDQ: also dQ += dS K for the query tile, added to a.dq_acc with fp32 atomics (fast mode)
template <typename T, int D, bool kAtomicDQ>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(DkvArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
  T* sK = reinterpret_cast<T*>(base);
  T* sV = sK + kKV * D;
  T* sQ = sV + kKV * D;          // 2 stages of kQT x D
  T* sdO = sQ + 2 * kQT * D;     // 2 stages
  float* sL = reinterpret_cast<float*>(sdO + 2 * kQT * D);  // 2 stages of kQT (lse)
  float* sD = sL + 2 * kQT;                                  // 2 stages of kQT (delta)
  // dS^T [kKV x kQT] (one 128-byte-swizzled panel), fast mode only; 1024-aligned
  T* sdS = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(sD + 2 * kQT) + 1023) & ~uintptr_t(1023));

  const int group = a.hq / a.hkv;
  const int item = blockIdx.x / a.hkv;
  const int hk = blockIdx.x % a.hkv;
  const KvItem<kQT> tile(a.work + item * 8, a.ranges);
  const int k0 = tile.k0, k1 = tile.k1, rlo = tile.rlo, rhi = tile.rhi, per_head = tile.per_head;
  const int n_iter = per_head * group;

  // the first child range (a GRPO prompt has exactly one) is kept in registers
  const int r0a = rhi > rlo ? a.ranges[2 * rlo] : 0, r0b = rhi > rlo ? a.ranges[2 * rlo + 1] : 0;
  const int r0n = (r0b - r0a + kQT - 1) / kQT;
  auto query_tile = [&](int i, int& q0, int& qend, bool& causal) {
    if (i < tile.n_own) {
      q0 = k0 + i * kQT;
      qend = tile.seg_end;
      causal = true;
      return;
    }
    i -= tile.n_own;
    if (i < r0n) {
      q0 = r0a + i * kQT;
      qend = r0b;
      causal = false;
      return;
    }
    causal = false;
    child_query_tile<kQT>(a.ranges, rlo + 1, rhi, i - r0n, q0, qend);
  };

  const long qs = (long)a.hq * D, ks = (long)a.hkv * D;
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * D;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * D;

  const int wg = threadIdx.x >> 7;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int krow_a = k0 + wg * 64 + warp * 16 + (lane >> 2);  // key rows krow_a, krow_a + 8

  load_tile<T, D, kKV>(sK, kg, ks, k0, k1);
  load_tile<T, D, kKV>(sV, vg, ks, k0, k1);

  auto issue = [&](int it, int stage) {
    const int h = hk * group + it / per_head;
    int q0, qend;
    bool causal;
    query_tile(it % per_head, q0, qend, causal);
    const T* qg = reinterpret_cast<const T*>(a.q) + h * D;
    const T* dog = reinterpret_cast<const T*>(a.dout) + h * D;
    load_tile<T, D, kQT>(sQ + stage * kQT * D, qg, qs, q0, qend);
    load_tile<T, D, kQT>(sdO + stage * kQT * D, dog, qs, q0, qend);
    load_lse_delta<kQT>(sL + stage * kQT, sD + stage * kQT, a.lse, a.delta, h, a.T, q0, qend);
  };

  if (n_iter > 0) issue(0, 0);
  cp_async_commit();

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const float sl2 = a.scale_log2;

  for (int it = 0; it < n_iter; ++it) {
    const int st = it & 1;
    if (it + 1 < n_iter) issue(it + 1, st ^ 1);
    stage_ready();

    int q0, qend;
    bool causal;
    query_tile(it % per_head, q0, qend, causal);
    const int h = hk * group + it / per_head;
    const T* cQ = sQ + st * kQT * D;
    const T* cdO = sdO + st * kQT * D;
    const float* cL = sL + st * kQT;
    const float* cD = sD + st * kQT;

    float s[32], dp[32];
    wg_fence();
    wgmma_rows_x_rows<T, D, kKV, kQT>(s, sK, wg * 64, cQ);
    wgmma_rows_x_rows<T, D, kKV, kQT>(dp, sV, wg * 64, cdO);
    wg_commit();
    wg_wait<0>();
    reg_fence(s);
    reg_fence(dp);

    const bool msk = (q0 + kQT > qend) || (causal && q0 < k0 + kKV);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = j * 8 + (lane & 3) * 2 + (e & 1);  // query column inside the tile
        float p = exp2f(fmaf(s[4 * j + e], sl2, -cL[c] * kLog2e));
        if (msk) {
          const int qrow = q0 + c;
          const int krow = krow_a + (e >> 1) * 8;
          if (qrow >= qend || (causal && qrow < krow)) p = 0.f;
        }
        s[4 * j + e] = p;
        dp[4 * j + e] = p * (dp[4 * j + e] - cD[c]);
      }

    uint32_t pa[4][4], da[4][4];
    pack_frags<T, kQT>(pa, s, da, dp);
    float dq[32];
    if (kAtomicDQ) {
      // dS^T rows (key) x cols (query) into shared memory for dQ = dS K (contracts over all 128 keys)
      store_ds_t<T, kKV>(sdS, wg * 64 + warp * 16, lane, da);
      fence_proxy_async();
      __syncthreads();
    }
    reg_fence(dv);
    reg_fence(dk);
    wg_fence();
    wgmma_regs_x_tile<T, D, kQT>(dv, pa, cdO);
    wgmma_regs_x_tile<T, D, kQT>(dk, da, cQ);
    // warpgroup wg computes dQ[:, 64 wg : 64 wg + 64] (for D = 64 only warpgroup 0 works)
    const bool dq_here = kAtomicDQ && (D == 128 || wg == 0);  // compile-time true for D = 128
    if (dq_here) wgmma_ds_x_k<T, kKV, kKV / 16>(dq, sdS, sK + wg * kKV * 64);
    wg_commit();
    wg_wait<0>();
    reg_fence(dv);
    reg_fence(dk);
    if (dq_here) {
      reg_fence(dq);
      float* acc = a.dq_acc + (long)h * D + wg * 64;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = q0 + warp * 16 + (lane >> 2) + hh * 8;
        if (row < qend) {
          float* rp = acc + (long)row * a.hq * D + (lane & 3) * 2;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            atomicAdd(reinterpret_cast<float2*>(rp + j * 8), make_float2(dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]));
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  T* dkg = reinterpret_cast<T*>(a.dk) + hk * D;
  T* dvg = reinterpret_cast<T*>(a.dv) + hk * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = krow_a + r * 8;
    if (row < k1) store_dk_dv_row<T, D>(dkg, dvg, ks, row, lane, dk, dv, r, a.scale);
  }
}

template <typename T, int D, int kRK>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(DqArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
  T* sQ = reinterpret_cast<T*>(base);
  T* sdO = sQ + kRQ * D;
  T* sK = sdO + kRQ * D;      // 2 stages of kRK x D
  T* sV = sK + 2 * kRK * D;   // 2 stages

  const int item = blockIdx.x / a.hq;
  const int h = blockIdx.x % a.hq;
  const int hk = h / (a.hq / a.hkv);
  const RowItem<kRK> tile(a.work + item * 8);
  const int q0 = tile.q0, q1 = tile.q1;

  const long qs = (long)a.hq * D, ks = (long)a.hkv * D;
  const T* qg = reinterpret_cast<const T*>(a.q) + h * D;
  const T* dog = reinterpret_cast<const T*>(a.dout) + h * D;
  const T* kg = reinterpret_cast<const T*>(a.k) + hk * D;
  const T* vg = reinterpret_cast<const T*>(a.v) + hk * D;

  const int wg = threadIdx.x >> 7;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_a = q0 + wg * 64 + warp * 16 + (lane >> 2);

  load_tile<T, D, kRQ>(sQ, qg, qs, q0, q1);
  load_tile<T, D, kRQ>(sdO, dog, qs, q0, q1);
  load_kv_tile<T, D, kRK>(sK, sV, 0, kg, vg, ks, tile, 0);
  cp_async_commit();

  const float sl2 = a.scale_log2;
  float lse2[2], dlt[2];
  load_row_lse_delta(lse2, dlt, a.lse, a.delta, h, a.T, row_a, q1);

  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;

  for (int t = 0; t < tile.n_total; ++t) {
    const int st = t & 1;
    if (t + 1 < tile.n_total) load_kv_tile<T, D, kRK>(sK, sV, st ^ 1, kg, vg, ks, tile, t + 1);
    stage_ready();

    const T* cK = sK + st * kRK * D;
    const T* cV = sV + st * kRK * D;
    float s[kRK / 2], dp[kRK / 2];
    wg_fence();
    wgmma_rows_x_rows<T, D, kRQ, kRK>(s, sQ, wg * 64, cK);
    wgmma_rows_x_rows<T, D, kRQ, kRK>(dp, sdO, wg * 64, cV);
    wg_commit();
    wg_wait<0>();
    reg_fence(s);
    reg_fence(dp);

    scores_to_ds<kRK>(tile, t, s, dp, lse2, dlt, sl2, row_a, lane);

    uint32_t da[kRK / 16][4];
    pack_frags<T, kRK>(da, s);
    reg_fence(dq);
    wg_fence();
    wgmma_regs_x_tile<T, D, kRK>(dq, da, cK);
    wg_commit();
    wg_wait<0>();
    reg_fence(dq);
    __syncthreads();
  }
  cp_async_wait<0>();

  T* dqg = reinterpret_cast<T*>(a.dq) + h * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_a + r * 8;
    if (row < q1) store_frag_row<T, D>(dqg, qs, row, lane, dq, r, a.scale);
  }
}

template <typename T, int D, int kRK>
static cudaError_t dq_rk(const DqArgs& qa, cudaStream_t stream) {
  const int smem_q = (2 * kRQ * D + 4 * kRK * D) * (int)sizeof(T) + 1024;
  return launch_kernel(dq_kernel<T, D, kRK>, (unsigned)qa.num_items * qa.hq, kThreads, smem_q, stream, qa);
}

template <typename T, int D>
static cudaError_t dq_t(const DqArgs& qa, cudaStream_t stream) {
  const int kt = dq_key_tile_from_env();
  if (kt == 64) return dq_rk<T, D, 64>(qa, stream);
  if (kt == 128) return dq_rk<T, D, 128>(qa, stream);
  return cudaErrorInvalidValue;  // the ops check the variable first, with a clear message
}

template <typename T, int D>
static cudaError_t bwd_t(const DeltaArgs& da, const DqArgs& qa, const DkvArgs& ka, int dtype, cudaStream_t stream) {
  cudaError_t e = launch_delta(da, dtype, D, stream);
  if (e != cudaSuccess) return e;
  const bool atomic_dq = ka.dq_acc != nullptr;
  const int smem_kv = (2 * kKV * D + 4 * kQT * D) * (int)sizeof(T) + 4 * kQT * (int)sizeof(float) + 1024 +
                      (atomic_dq ? kKV * kQT * (int)sizeof(T) + 1024 : 0);
  e = launch_kernel(atomic_dq ? dkdv_kernel<T, D, true> : dkdv_kernel<T, D, false>, (unsigned)ka.num_items * ka.hkv,
                    kThreads, smem_kv, stream, ka);
  if (e != cudaSuccess || atomic_dq) return e;
  return dq_t<T, D>(qa, stream);
}

}  // namespace sm90

cudaError_t launch_bwd_sm90(const DeltaArgs& da, const DqArgs& qa, const DkvArgs& ka, int dtype, int d,
                            cudaStream_t stream) {
  if (dtype == kBF16 && d == 128) return sm90::bwd_t<__nv_bfloat16, 128>(da, qa, ka, dtype, stream);
  if (dtype == kBF16 && d == 64) return sm90::bwd_t<__nv_bfloat16, 64>(da, qa, ka, dtype, stream);
  if (dtype == kFP16 && d == 128) return sm90::bwd_t<__half, 128>(da, qa, ka, dtype, stream);
  if (dtype == kFP16 && d == 64) return sm90::bwd_t<__half, 64>(da, qa, ka, dtype, stream);
  return cudaErrorInvalidValue;
}

int dq_key_tile_from_env() { return env_choice("MEGATRON_DUALKV_DQ_KTILE", {{"128", 128}, {"64", 64}}); }

cudaError_t launch_dq_sm90(const DqArgs& qa, int dtype, int d, cudaStream_t stream) {
  if (dtype == kBF16 && d == 128) return sm90::dq_t<__nv_bfloat16, 128>(qa, stream);
  if (dtype == kBF16 && d == 64) return sm90::dq_t<__nv_bfloat16, 64>(qa, stream);
  if (dtype == kFP16 && d == 128) return sm90::dq_t<__half, 128>(qa, stream);
  if (dtype == kFP16 && d == 64) return sm90::dq_t<__half, 64>(qa, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mdkv
