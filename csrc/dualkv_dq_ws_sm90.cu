// DualKV dQ for Hopper (sm_90a), warp-specialized: the deterministic backward's dQ kernel
// (launch_dq_ws_sm90; the ws backward's dK/dV kernel, without dQ, runs before it or beside it on a second stream).
// Local queries (q, dout, lse, delta, dq hold Tq < T rows; row item field 6 is q0's row there):
// the kLocal instance, the same walk and sums, so a held row's dQ is bitwise the whole batch's.
//
// Same math, items and accumulation order as dq_kernel in dualkv_bwd_sm90.cu (one CTA per 128-row
// query tile and query head; the parent's key tiles, then the segment's own, each adding the same
// k16 slices in key order), so dQ is bitwise the same (with MEGATRON_DUALKV_DQ_NARROW=0: by
// default a ragged prompt's last key tile is walked first, see the kernel); the structure is the ws forward's
// (dualkv_fwd_ws_sm90.cu), with dP = dO V^T beside S = Q K^T and dQ += dS K in place of O += P V:
//   warpgroup 0, producer: one thread loads Q and dO once and every key tile's K and V (kBK = 64
//     rows) with TMA into a ring of kStages stages.
//   warpgroups 1, 2, consumers: 64 query rows each, dQ in registers. Per key tile t a consumer
//     issues S_t and dP_t (one group) and dQ += dS_{t-1} K_{t-1} (a second group) back to back,
//     waits for the first only, and computes dS_t = P_t (dP_t - delta) under the dQ MMA. Their
//     issue sections take turns (named barriers, as in the forward), so one consumer's dS runs
//     while the other's MMAs hold the tensor cores.
// 64-key tiles: the overlap keeps dS_{t-1} (packed) and dQ live while S_t and dP_t are written,
// 64 + 2 x 32 + 16 registers of fragments instead of 224 at 128 keys. K_t is read twice (S_t, then
// dQ one step later) and is released after its dQ MMA; V_t after dP_t.
//
// mbarrier phases (key tile t in stage t % kStages, u = t / kStages its stage's use):
//   q_full: 1 arrival + the Q and dO bytes, parity 0.
//   k_full[s], v_full[s]: 1 arrival + the tile's bytes; consumers wait for parity u & 1.
//   k_empty[s], v_empty[s]: 8 arrivals (lane 0 of each consumer warp); the producer waits for
//     parity (u - 1) & 1 before refilling. K_t is released at the top of step t + 2 at the
//     latest, so kStages >= 3 keeps one tile loading ahead; a consumer cannot release a stage's
//     next use before the other released this one (that tile is not loaded before), so the 8
//     arrivals of a phase belong to one tile.
// Named barriers 1, 2: consumer 1 arrives once up front, then each passes the turn after each of
// its n issue sections except consumer 1 after its last (equal sync and arrive counts).
// At a query tile's causal diagonal the last 64-key tile starts at q0 + 64, past consumer 0's
// rows: all its scores are masked, so consumer 0 stops one tile early (nc = n - 1: it neither waits
// for that tile nor releases it; nothing loads after it) and takes that step's turn as an empty
// issue section. Its dQ loses only adds of zero products, which change no value.
// The wgmmas of consumer 1 then run alone (~4 % of the kernel's MMA work on a GRPO group of
// 1024-token responses; docs/PERF.md, twenty-ninth session).
// A query tile of 64 rows or fewer leaves consumer 1 without rows: it issues nothing, and per key
// tile waits for the loads, takes its turn empty and releases the stage.
// csrc/ws_pipeline_model.py (run_dq) replays this protocol under random interleavings.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
#include <math.h>

#include "dualkv_kernels.h"
#include "env_choice.h"
#include "sm90_common.h"
#include "sm90_ws_common.h"
#include "wgmma_ops.h"
#include "work_items.h"

namespace mdkv {
namespace dqws {

using namespace sm90ws;
using sm90::pack_frags;
using sm90::reg_fence;
using sm90::wg_commit;
using sm90::wg_fence;
using sm90::wg_wait;
using sm90::wgmma_regs_x_tile;
using sm90::wgmma_rows_x_rows;

constexpr int kBQ = 128;  // query rows per CTA (2 consumers x 64)
constexpr int kBK = 64;   // key rows per tile
constexpr int kThreadsWS = 384;
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(regs_fit_384(kProducerRegs, kConsumerRegs), "consumer registers would never be granted");
constexpr int kSchedBar = 1;  // named barriers 1, 2 (0 is __syncthreads)

// shared memory: Q, dO [kBQ x D], K and V [kStages][kBK x D] (D / 64 swizzled panels each), the
// mbarriers; 1024-aligned base. D = 128: 64 KB + 4 x 32 KB; D = 64: 32 KB + 6 x 16 KB.
template <typename T, int D>
struct Smem {
  static constexpr int kStages = D == 128 ? 4 : 6;
  static constexpr int kQ = 0;
  static constexpr int kdO = kQ + kBQ * D * (int)sizeof(T);
  static constexpr int kK = kdO + kBQ * D * (int)sizeof(T);
  static constexpr int kV = kK + kStages * kBK * D * (int)sizeof(T);
  static constexpr int kBar = kV + kStages * kBK * D * (int)sizeof(T);
  static constexpr int kBytes = kBar + 8 * KvRing<kStages>::kBarCount + 1024;
  static_assert(kBytes <= 227 * 1024, "shared memory of the ws dQ kernel exceeds the 227 KB an sm_90 CTA can have");
};

// kLocal: q, dout, lse, delta and dq hold Tq < T rows (local queries), row item field 6 the row of
// q0 there; its own instance, so that the whole-batch kernel's code is not rescheduled by the shift
template <typename T, int D, bool kLocal>
__global__ void __launch_bounds__(kThreadsWS, 1)
    dq_ws_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                 const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v, DqArgs a) {
  using L = Smem<T, D>;
  constexpr int kStages = L::kStages;
  extern __shared__ unsigned char smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
  T* sQ = reinterpret_cast<T*>(base + L::kQ);
  T* sdO = reinterpret_cast<T*>(base + L::kdO);
  T* sK = reinterpret_cast<T*>(base + L::kK);
  T* sV = reinterpret_cast<T*>(base + L::kV);
  using Ring = KvRing<kStages>;
  const Ring ring{smem_addr(reinterpret_cast<void*>(base + L::kBar))};
  const KvHeadMajorBlock blk(a.num_items, a.hq, a.hkv);  // the forward's block order
  const int hk = blk.hk, h = blk.h;
  const RowItem<kBK> tile(a.work + blk.item * 8);
  const int n = tile.n_total;  // >= 1: the segment's own rows
  // A ragged prompt's last key tile holds P mod 64 of the prompt's keys (the rest are other
  // segments' rows, masked). Where 16 or 32 keys hold them, the walk takes that tile first and
  // computes its S and dP at that width (the first step runs outside the pipelined loop, so no
  // width is chosen inside it: a branch around wgmma issue there made ptxas fence or serialize the
  // wgmmas, docs/PERF.md nineteenth, twenty-ninth and thirtieth sessions). dq's sum order then
  // differs from the sm90 dQ kernel's (still fixed: deterministic). MEGATRON_DUALKV_DQ_NARROW=0: in
  // key order at full width.
  const int p_tail = tile.n_par > 0 ? tile.par1 - tile.kv_start(tile.n_par - 1) : kBK;
  const int pw = !a.narrow_parent_tail ? kBK : p_tail <= 16 ? 16 : p_tail <= 32 ? 32 : kBK;
  // walk step t -> key tile of the row item
  auto key_tile = [&](int t) { return pw == kBK || t >= tile.n_par ? t : (t == 0 ? tile.n_par - 1 : t - 1); };

  const int role = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);  // warp-uniform

  if (threadIdx.x == 0) ring.init();
  __syncthreads();

  if (role == 0) {
    // ------------------------------- producer -------------------------------
    regs_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_map(&tm_q);
      prefetch_map(&tm_do);
      prefetch_map(&tm_k);
      prefetch_map(&tm_v);
      mbar_expect_tx(ring.q_full(), 2 * kBQ * D * sizeof(T));
      const int qloc = kLocal ? __ldg(a.work + blk.item * 8 + 6) : tile.q0;  // q0's row in q
#pragma unroll
      for (int p = 0; p < D / 64; ++p) {
        tma_load(smem_addr(sQ + p * kBQ * 64), &tm_q, ring.q_full(), p * 64, h, qloc);
        tma_load(smem_addr(sdO + p * kBQ * 64), &tm_do, ring.q_full(), p * 64, h, qloc);
      }
      ring.template load_kv<T, D, kBK>(&tm_k, &tm_v, sK, sV, n, hk, [&](int t) { return tile.kv_start(key_tile(t)); });
    }
    return;
  }

  // ------------------------------- consumers -------------------------------
  regs_inc<kConsumerRegs>();
  const int cw = role - 1;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_a = tile.q0 + cw * 64 + warp * 16 + (lane >> 2);  // this thread's rows: row_a, row_a + 8
  const T* sQw = sQ + cw * 64 * 64;
  const T* sdOw = sdO + cw * 64 * 64;
  const float sl2 = a.scale_log2;
  const int my_bar = kSchedBar + cw, other_bar = kSchedBar + (cw ^ 1);

  // consumer 0's last tile, when every key of it lies past its rows (see the top)
  const bool skip_last = a.skip_masked_last && cw == 0 && n >= 2 && n - 1 >= tile.n_par && tile.kv_start(n - 1) >= tile.q0 + 64;
  const int nc = skip_last ? n - 1 : n;  // tiles this consumer walks

  // q, dout, lse, delta and dq hold the rows from row item field 6 on (local queries): packed row
  // q0 lands there. The dq stores need only h + shift * hq (one int live through the loop, as h
  // was): an int more, a long, the field in the row item or read again at the end each made ptxas
  // serialize the wgmmas (C7511)
  const int shift = kLocal ? __ldg(a.work + blk.item * 8 + 6) - tile.q0 : 0;
  float lse2[2], dlt[2];
  load_row_lse_delta(lse2, dlt, a.lse, a.delta, h, kLocal ? a.Tq : a.T, row_a + shift, tile.q1 + shift);
  const int dq_head_row = kLocal ? h + shift * a.hq : h;  // dq row r of head h at (r * hq + dq_head_row) * D
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
  float s[kBK / 2], dp[kBK / 2];
  uint32_t da[kBK / 16][4];

  // dS_t in place of S_t
  auto ds_step = [&](int t) { scores_to_ds<kBK>(tile, key_tile(t), s, dp, lse2, dlt, sl2, row_a, lane); };

  // A programmatic dependent of the dK/dV kernel may finish before it; the stream's next work
  // waits only for this grid, so the CTA that takes the last ticket waits for the dK/dV grid
  // before it exits (the grid completes only when every CTA has exited).
  auto wait_for_dkdv_if_last = [&]() {
    if (a.pdl_ticket != nullptr) {
      named_sync(kSchedBar + 2, 256);  // one ticket per CTA, taken once both consumers have stored
      if (threadIdx.x == 128 && atomicAdd(a.pdl_ticket, 1) == (int)gridDim.x - 1)
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
    }
  };

  mbar_wait(ring.q_full(), 0);
  if (cw == 1) named_arrive(other_bar, 256);  // consumer 0 takes the first turn

  // Consumer 1 without rows (a query tile of 64 rows or fewer: a segment's last) computes
  // nothing: per key tile it waits for the loads, takes its turn empty and releases the stage, so
  // consumer 0's MMAs have the tensor cores to themselves (MEGATRON_DUALKV_DQ_IDLE=0: it walks)
  if (a.idle_empty_rows && cw == 1 && tile.q1 <= tile.q0 + 64) {
    for (int t = 0; t < n; ++t) {
      mbar_wait(ring.k_full(Ring::stage(t)), Ring::parity(t));
      mbar_wait(ring.v_full(Ring::stage(t)), Ring::parity(t));
      named_sync(my_bar, 256);
      if (t + 1 < n) named_arrive(other_bar, 256);
      if (lane == 0) {
        mbar_arrive(ring.v_empty(Ring::stage(t)));
        mbar_arrive(ring.k_empty(Ring::stage(t)));
      }
    }
    wait_for_dkdv_if_last();
    return;
  }

  // tile 0: S and dP only, at SW keys (pw; the columns past it are zeros, masked by
  // the select in scores_to_ds, so their dS is 0). One whole step per width: a width chosen
  // around the wgmmas alone made ptxas inject arrives and serialize them (C7519, C7515).
  auto first_step = [&](auto s_width) {
    constexpr int SW = decltype(s_width)::value;
#pragma unroll
    for (int i = SW / 2; i < kBK / 2; ++i) s[i] = dp[i] = 0.f;
    mbar_wait(ring.k_full(0), 0);
    mbar_wait(ring.v_full(0), 0);
    named_sync(my_bar, 256);
    wg_fence();
    wgmma_rows_x_rows<T, D, kBQ, SW, kBK>(s, sQw, 0, sK);
    wgmma_rows_x_rows<T, D, kBQ, SW, kBK>(dp, sdOw, 0, sV);
    wg_commit();
    if (cw == 0 || n > 1) named_arrive(other_bar, 256);
    wg_wait<0>();
    reg_fence(s);
    reg_fence(dp);
  };
  if (pw == 16)
    first_step(std::integral_constant<int, 16>());
  else if (pw == 32)
    first_step(std::integral_constant<int, 32>());
  else
    first_step(std::integral_constant<int, kBK>());
  if (lane == 0) mbar_arrive(ring.v_empty(0));
  ds_step(0);

  // steady state: S_t, dP_t and dQ += dS_{t-1} K_{t-1} in flight together; dS_t under the dQ MMA
  for (int t = 1; t < nc; ++t) {
    const int st = Ring::stage(t), sp = Ring::stage(t - 1);
    wg_wait<0>();  // dQ += dS_{t-2} K_{t-2} complete (nothing pending when t = 1)
    reg_fence(dq);
    reg_fence_u(da);
    if (lane == 0 && t >= 2) mbar_arrive(ring.k_empty(Ring::stage(t - 2)));
    pack_frags<T, kBK>(da, s);
    mbar_wait(ring.k_full(st), Ring::parity(t));
    mbar_wait(ring.v_full(st), Ring::parity(t));
    named_sync(my_bar, 256);
    reg_fence(dq);
    reg_fence_u(da);
    wg_fence();
    wgmma_rows_x_rows<T, D, kBQ, kBK>(s, sQw, 0, sK + st * kBK * D);
    wgmma_rows_x_rows<T, D, kBQ, kBK>(dp, sdOw, 0, sV + st * kBK * D);
    wg_commit();
    wgmma_regs_x_tile<T, D, kBK>(dq, da, sK + sp * kBK * D);
    wg_commit();
    if (cw == 0 || t + 1 < n) named_arrive(other_bar, 256);
    wg_wait<1>();  // S_t and dP_t complete, the dQ MMA still running
    reg_fence(s);
    reg_fence(dp);
    if (lane == 0) mbar_arrive(ring.v_empty(st));
    ds_step(t);
  }

  if (skip_last) {  // the skipped tile's turn, so that consumer 1 takes its last one
    named_sync(my_bar, 256);
    named_arrive(other_bar, 256);
  }

  // the last dQ product
  {
    wg_wait<0>();
    reg_fence(dq);
    reg_fence_u(da);
    if (lane == 0 && nc >= 2) mbar_arrive(ring.k_empty(Ring::stage(nc - 2)));
    pack_frags<T, kBK>(da, s);
    const int sl = Ring::stage(nc - 1);
    reg_fence(dq);
    reg_fence_u(da);
    wg_fence();
    wgmma_regs_x_tile<T, D, kBK>(dq, da, sK + sl * kBK * D);
    wg_commit();
    wg_wait<0>();
    reg_fence(dq);
    if (lane == 0) mbar_arrive(ring.k_empty(sl));
  }

  const long qs = (long)a.hq * D;
  // (the whole batch's int product as before: its instances' SASS is unchanged)
  T* dqg = reinterpret_cast<T*>(a.dq) + (kLocal ? (long)dq_head_row * D : dq_head_row * D);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_a + r * 8;
    store_frag_row_x4<T, D>(dqg, qs, row, lane, dq, r, a.scale, row < tile.q1);
  }
  wait_for_dkdv_if_last();
}

template <typename T, int D>
static cudaError_t dq_ws_t(const DqArgs& a, CUtensorMapDataType dt, cudaStream_t stream, bool pdl) {
  using L = Smem<T, D>;
  auto k = a.Tq < a.T ? dq_ws_kernel<T, D, true> : dq_ws_kernel<T, D, false>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (e != cudaSuccess) return e;
  if (a.num_items == 0 || a.T == 0 || a.Tq == 0) return cudaSuccess;
  CUtensorMap mq, mdo, mk, mv;
  const int es = (int)sizeof(T);
  if (!make_map(&mq, a.q, dt, D, a.hq, a.Tq, kBQ, es) || !make_map(&mdo, a.dout, dt, D, a.hq, a.Tq, kBQ, es) ||
      !make_map(&mk, a.k, dt, D, a.hkv, a.T, kBK, es) || !make_map(&mv, a.v, dt, D, a.hkv, a.T, kBK, es))
    return cudaErrorInvalidResourceHandle;  // tensor map encoding failed (driver entry point or arguments)
  if (!pdl) {
    k<<<(unsigned)a.num_items * a.hq, kThreadsWS, L::kBytes, stream>>>(mq, mdo, mk, mv, a);
    return cudaGetLastError();
  }
  // its CTAs may start once every CTA of the kernel before it has started (griddepcontrol.launch_dependents)
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)a.num_items * a.hq);
  cfg.blockDim = dim3(kThreadsWS);
  cfg.dynamicSmemBytes = L::kBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, k, mq, mdo, mk, mv, a);
}

}  // namespace dqws

int dq_kernel_from_env() { return env_choice("MEGATRON_DUALKV_DQ_KERNEL", {{"ws", 1}, {"sm90", 0}}); }

int dq_skip_from_env() { return env_choice("MEGATRON_DUALKV_DQ_SKIP", {{"1", 1}, {"0", 0}}); }
int dq_idle_from_env() { return env_choice("MEGATRON_DUALKV_DQ_IDLE", {{"1", 1}, {"0", 0}}); }
int dq_narrow_from_env() { return env_choice("MEGATRON_DUALKV_DQ_NARROW", {{"1", 1}, {"0", 0}}); }

int dq_side_stream_from_env() {
  return env_choice("MEGATRON_DUALKV_DQ_STREAM", {{"auto", 2}, {"1", 1}, {"0", 0}, {"pdl", 3}});
}

cudaError_t launch_dq_ws_sm90(const DqArgs& a, int dtype, int d, cudaStream_t stream, bool pdl) {
  constexpr auto bf = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, hf = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (dtype == kBF16 && d == 128) return dqws::dq_ws_t<__nv_bfloat16, 128>(a, bf, stream, pdl);
  if (dtype == kBF16 && d == 64) return dqws::dq_ws_t<__nv_bfloat16, 64>(a, bf, stream, pdl);
  if (dtype == kFP16 && d == 128) return dqws::dq_ws_t<__half, 128>(a, hf, stream, pdl);
  if (dtype == kFP16 && d == 64) return dqws::dq_ws_t<__half, 64>(a, hf, stream, pdl);
  return cudaErrorInvalidValue;
}

}  // namespace mdkv
