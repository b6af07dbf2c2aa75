// Helpers of every DualKV kernel (the mma.sync kernels of dualkv_kernels.cu and the Hopper ones):
// cp.async loads, bf16/fp16 packing, quad reductions, score masks and the online softmax over
// accumulator fragments, fragment stores, and the host launch. Nothing here needs more than sm_80.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
#include <math.h>

namespace mdkv {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Copy rows [row0, row0 + ROWS) of one head of a [T, H, D] tensor (`stride` elements from row to
// row) into a shared-memory tile, 16-byte chunk c of tile row r at s + off(r, c), spread over
// THREADS threads; rows at or past row_end are zero-filled.
template <typename T, int D, int ROWS, int THREADS, typename Off>
__device__ __forceinline__ void load_rows(T* s, const T* g, long stride, int row0, int row_end, Off off) {
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = row0 + r;
    const bool valid = row < row_end;
    const T* src = g + (valid ? (long)row * stride + c * 8 : 0);
    cp_async16(smem_addr(s + off(r, c)), src, valid);
  }
}

// two floats rounded to one packed pair of T (the low half is a)
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

// max / sum over the 4 lanes of a quad (the threads that share a row of an MMA accumulator)
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

// natural-log LSE of a row from its running max m (log2 units of the scaled scores) and its
// quad-summed l; -inf for a row that saw no key
__device__ __forceinline__ float row_lse(float m, float lsum) {
  return lsum > 0.f ? (m + log2f(lsum)) * 0.69314718055994531f : -INFINITY;
}

// Element e (0..3) of 8-column block j of an accumulator fragment (mma.sync m16n8 / wgmma m64:
// row + (e >> 1) * 8, column 8 j + 2 (lane & 3) + (e & 1)), held as [blocks][4] or flat.
template <typename F, int N>
__device__ __forceinline__ F& frag(F (&acc)[N][4], int j, int e) {
  return acc[j][e];
}
template <typename F, int N>
__device__ __forceinline__ F& frag(F (&acc)[N], int j, int e) {
  return acc[4 * j + e];
}

// the two elements of row half r in 8-column block j (times scale), as one packed pair of T
template <typename T, typename Acc>
__device__ __forceinline__ uint32_t frag_pack(const Acc& acc, int j, int r) {
  return pack2<T>(frag(acc, j, 2 * r), frag(acc, j, 2 * r + 1));
}
template <typename T, typename Acc>
__device__ __forceinline__ uint32_t frag_pack(const Acc& acc, int j, int r, float scale) {
  return pack2<T>(frag(acc, j, 2 * r) * scale, frag(acc, j, 2 * r + 1) * scale);
}

// Row half r (its row `row`) of the fragment times `scale`, as T into g[row * stride + column]
template <typename T, int D, typename Acc>
__device__ __forceinline__ void store_frag_row(T* g, long stride, long row, int lane, const Acc& acc, int r,
                                               float scale) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
    *reinterpret_cast<uint32_t*>(g + (row * stride + j * 8 + (lane & 3) * 2)) = frag_pack<T>(acc, j, r, scale);
}

// One shuffle round of a quad's 4 x 4 transpose: the pair (lo, hi) of pieces differs in the index
// bit that `mask` flips in the lane; the lane whose bit is set (`upper`) gives lo and takes its
// partner's hi into it, the other gives hi and takes the partner's lo into it.
__device__ __forceinline__ void quad_exchange(uint32_t& lo, uint32_t& hi, bool upper, int mask) {
  const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? lo : hi, mask);
  if (upper)
    lo = got;
  else
    hi = got;
}

// The same in 16-byte stores: a quad's 4-byte pieces of four 8-column blocks are transposed with
// two shuffle rounds, so that lane q holds block 4 g + q whole (a warp's store then covers 8 rows
// x 64 contiguous bytes instead of 8 rows x 16). Every lane of the warp calls it (shuffles);
// `store`: whether this lane's row is written.
template <typename T, int D, typename Acc>
__device__ __forceinline__ void store_frag_row_x4(T* g, long stride, long row, int lane, const Acc& acc, int r,
                                                  float scale, bool store) {
  static_assert(D % 32 == 0, "16-byte row stores take 32 columns per quad");
  const bool b0 = lane & 1, b1 = lane & 2;
#pragma unroll
  for (int grp = 0; grp < D / 32; ++grp) {
    // v[i]: this lane's piece of block 4 grp + i; after the rounds, lane q's v[k]: lane k's piece of block 4 grp + q
    uint32_t v0 = frag_pack<T>(acc, 4 * grp, r, scale), v1 = frag_pack<T>(acc, 4 * grp + 1, r, scale);
    uint32_t v2 = frag_pack<T>(acc, 4 * grp + 2, r, scale), v3 = frag_pack<T>(acc, 4 * grp + 3, r, scale);
    quad_exchange(v0, v1, b0, 1);
    quad_exchange(v2, v3, b0, 1);
    quad_exchange(v0, v2, b1, 2);
    quad_exchange(v1, v3, b1, 2);
    if (store) *reinterpret_cast<uint4*>(g + (row * stride + (4 * grp + (lane & 3)) * 8)) = make_uint4(v0, v1, v2, v3);
  }
}

// Row half r of an fp32 fragment times `scale`, added into g[row * stride + column] in 16-byte
// atomics (sm_90): lanes 2m and 2m + 1 of a quad trade one float2 per pair of 8-column blocks, so
// the even lane holds 4 columns of the even block whole and the odd lane 4 of the odd block (half
// the atomics of float2 adds). Every lane calls it (shuffles); `add`: whether this lane's row is added.
template <int D, typename Acc>
__device__ __forceinline__ void red_frag_row_x4(float* g, long stride, long row, int lane, const Acc& acc, int r,
                                                float scale, bool add) {
  const bool odd = lane & 1;
#pragma unroll
  for (int j = 0; j < D / 8; j += 2) {
    const float2 ev = make_float2(frag(acc, j, 2 * r) * scale, frag(acc, j, 2 * r + 1) * scale);
    const float2 od = make_float2(frag(acc, j + 1, 2 * r) * scale, frag(acc, j + 1, 2 * r + 1) * scale);
    const float2 give = odd ? ev : od;
    const float2 got = make_float2(__shfl_xor_sync(0xffffffffu, give.x, 1), __shfl_xor_sync(0xffffffffu, give.y, 1));
    const float4 v = odd ? make_float4(got.x, got.y, od.x, od.y) : make_float4(ev.x, ev.y, got.x, got.y);
    if (add) atomicAdd(reinterpret_cast<float4*>(g + (row * stride + (j + odd) * 8 + (lane & 2) * 2)), v);
  }
}

// The forward's outputs of this thread's rows row_a, row_a + 8 (those below q_end): O / l (l: the
// quad-summed row sum) as T into og[row * stride + column], the natural-log LSE into lse[row].
// kWide: 16-byte stores (store_frag_row_x4; og 16-byte aligned, stride a multiple of 8).
template <typename T, int D, bool kWide = false, typename Acc>
__device__ __forceinline__ void store_out_lse(T* og, long stride, float* lse, int row_a, int q_end, int lane,
                                              const Acc& o, const float (&m)[2], const float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const int row = row_a + r * 8;
    if constexpr (kWide) store_frag_row_x4<T, D>(og, stride, row, lane, o, r, inv, row < q_end);
    if (row < q_end) {
      if constexpr (!kWide) store_frag_row<T, D>(og, stride, row, lane, o, r, inv);
      if ((lane & 3) == 0) lse[row] = row_lse(m[r], lsum);
    }
  }
}

// The same for a key row of dK (times scale) and dV, stored interleaved
template <typename T, int D, typename Acc>
__device__ __forceinline__ void store_dk_dv_row(T* dkg, T* dvg, long stride, long row, int lane, const Acc& dk,
                                                const Acc& dv, int r, float scale) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const long off = row * stride + j * 8 + (lane & 3) * 2;
    *reinterpret_cast<uint32_t*>(dkg + off) = frag_pack<T>(dk, j, r, scale);
    *reinterpret_cast<uint32_t*>(dvg + off) = frag_pack<T>(dv, j, r);
  }
}

// lse and delta of query rows [q0, q0 + kRows) of head h ([heads, T] each) into sL, sD with
// cp.async, one row per thread of the first kRows; rows at or past qend read as zeros
template <int kRows>
__device__ __forceinline__ void load_lse_delta(float* sL, float* sD, const float* lse, const float* delta, int h,
                                               int T, int q0, int qend) {
  if (threadIdx.x < kRows) {  // asynchronous too: a plain load here would stall this warp every step
    const int row = q0 + threadIdx.x;
    const bool ok = row < qend;
    const long idx = (long)h * T + (ok ? row : 0);
    cp_async4(smem_addr(sL + threadIdx.x), lse + idx, ok);
    cp_async4(smem_addr(sD + threadIdx.x), delta + idx, ok);
  }
}

// lse (in log2 units) and delta of this thread's query rows row_a, row_a + 8 (zeros from q_end on)
__device__ __forceinline__ void load_row_lse_delta(float (&lse2)[2], float (&dlt)[2], const float* lse,
                                                   const float* delta, int h, int T, int row_a, int q_end) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_a + r * 8;
    const bool ok = row < q_end;
    lse2[r] = ok ? lse[(long)h * T + row] * kLog2e : 0.f;
    dlt[r] = ok ? delta[(long)h * T + row] : 0.f;
  }
}

// -inf into the scores S [rows x N] (a fragment; this thread's rows: row_a, row_a + 8) of key tile
// [k0, k0 + N) where a query row may not see the key: from the parent's end par1 on (is_par), or
// past the row itself (causal). Skipped for a tile that holds neither (first_row: the smallest
// query row).
template <int N, typename Acc>
__device__ __forceinline__ void mask_scores(Acc& s, int k0, bool is_par, int par1, int row_a,
                                            int first_row, int lane) {
  const bool msk = is_par ? (k0 + N > par1) : (k0 + N - 1 > first_row);
  if (msk) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
        const int row = row_a + (e >> 1) * 8;
        const bool ok = is_par ? (col < par1) : (col <= row);
        if (!ok) frag(s, j, e) = -INFINITY;
      }
  }
}

// The backward's dS = P (dP - delta) in place of the scores S [rows x N] of key tile t of a row
// item (RowItem; this thread's rows row_a, row_a + 8), P = exp2(S sl2 - lse2) from the forward's
// LSE in log2 units, and P = 0 where the row may not see the key (from the parent's end on, or
// past the row itself). The mask runs only on a tile that needs it: one branch per tile, the
// masked and unmasked loops as two copies (a compare and branch per element otherwise:
// docs/PERF.md, the ws backward's same change). Both dQ kernels use it, so their dQ is bitwise
// the same.
template <int N, typename Item>
__device__ __forceinline__ void scores_to_ds(const Item& tile, int t, float (&s)[N / 2], const float (&dp)[N / 2],
                                             const float (&lse2)[2], const float (&dlt)[2], float sl2, int row_a,
                                             int lane) {
  const int k0 = tile.kv_start(t);
  const bool is_par = t < tile.n_par;
  auto run = [&](auto masked) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float p = exp2f(fmaf(s[4 * j + e], sl2, -lse2[r]));
        if constexpr (decltype(masked)::value) {
          const int col = k0 + j * 8 + (lane & 3) * 2 + (e & 1);
          const int row = row_a + r * 8;
          if (!(is_par ? (col < tile.par1) : (col <= row))) p = 0.f;
        }
        s[4 * j + e] = p * (dp[4 * j + e] - dlt[r]);
      }
  };
  if (tile.needs_mask(t))
    run(std::true_type{});
  else
    run(std::false_type{});
}

// Online softmax step over the scores S [rows x N] (a fragment; log2 scale sl2): S becomes the
// unnormalised P in place, the running max m (log2 units) and sum l are updated; then, per row
// half r, rescaled(r, alpha) with the factor its output rows must be multiplied by.
template <int N, typename Acc, typename Rescale>
__device__ __forceinline__ void softmax_update(Acc& s, float (&m)[2], float (&l)[2], float sl2,
                                               Rescale rescaled) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) mx = fmaxf(mx, fmaxf(frag(s, j, 2 * r), frag(s, j, 2 * r + 1)));
    mx = quad_max(mx) * sl2;
    const float mnew = fmaxf(m[r], mx);
    const float b = mnew == -INFINITY ? 0.f : mnew;
    const float alpha = exp2f(m[r] - b);
    m[r] = mnew;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      const float p0 = exp2f(fmaf(frag(s, j, 2 * r), sl2, -b));
      const float p1 = exp2f(fmaf(frag(s, j, 2 * r + 1), sl2, -b));
      frag(s, j, 2 * r) = p0;
      frag(s, j, 2 * r + 1) = p1;
      sum += p0 + p1;
    }
    l[r] = l[r] * alpha + sum;
    rescaled(r, alpha);
  }
}

// host: allow `kernel` smem bytes of dynamic shared memory, then launch it on `blocks` CTAs (none:
// no launch) and return the launch error
template <typename Kernel, typename Args>
cudaError_t launch_kernel(Kernel kernel, unsigned blocks, int threads, int smem, cudaStream_t stream,
                          const Args& args) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  if (blocks > 0) kernel<<<blocks, threads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace mdkv
