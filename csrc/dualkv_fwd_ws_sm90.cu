// DualKV forward for Hopper (sm_90a), warp-specialized ("ws"): opt-in, fwd_impl="ws".
//
// One CTA = 3 warpgroups for one 128-row query tile of one query head (same row items and
// contract as dualkv_fwd_sm90.cu, plus local queries: item field 6 is the row of q0 in q / out /
// lse, which hold a.Tq rows; masks use the packed rows q0.., so a context-parallel rank's queries
// attend the gathered K/V exactly as in the whole micro-batch):
//   warpgroup 0, producer: one thread issues TMA loads (cp.async.bulk.tensor, 128-byte swizzle)
//     of Q once and of every K/V tile (128 rows) into a 3-stage ring; registers cut to 40
//     (setmaxnreg) so the consumers can have 232. At head dim 128 the caller may ask for 176-key
//     tiles instead (kv_tile; cuda_backend.ws_fwd_tile takes them for layouts whose query tiles
//     attend >= 7680 keys on average): a 2-stage ring, 24 / 240 registers (no spills since the turn
//     passes take immediate barrier ids; the persistent instance spills 20 bytes), 2-4 % faster
//     from (28, 8192, R) up, 1.6-3 % slower on (28, 4096, R) (docs/PERF.md, fifteenth and twentieth
//     sessions).
//   A parent's partial last key tile (P = 16384 in 176-key tiles: 16 real keys of 176) runs after
//     the row's own tiles with its MMAs narrowed to 16, 32, 64 or 128 keys when the caller asks
//     (narrow_tail; cuda_backend.ws_fwd_narrow_tail: on every layout unless forced to key order).
//   warpgroups 1, 2, consumers: 64 query rows each. They never meet at a CTA barrier: each
//     waits on the stage's "full" mbarriers and arrives (lane 0 of each warp) on the stage's
//     "empty" mbarriers once its MMAs reading K (S = Q K^T) or V (O += P V) have completed.
//     Each stores its O rows straight from registers in 16-byte pieces (store_out_lse's kWide).
// Scheduling (the two ideas of the FlashAttention-3 paper, implemented here from its description):
//   - intra-warpgroup overlap: per key tile t a consumer issues S_t = Q K_t^T and
//     O += P_{t-1} V_{t-1} back to back, waits for S_t only, and computes the softmax of S_t
//     while the P V MMA runs; O is rescaled after that MMA completes.
//   - ping-pong between the two consumers: issuing the MMAs of a step is a turn passed with
//     two named barriers (bar.sync on my barrier, bar.arrive on the other's), so one
//     warpgroup's softmax runs while the other's MMAs occupy the tensor cores.
//
// mbarrier phases (key tile t lives in stage t % S, S = 3 stages, or 2 at 176 keys; u = t / S
// counts the stage's uses; the text below says 3):
//   k_full[s], v_full[s]: 1 arrival (the producer's arrive.expect_tx) + the TMA bytes; the
//     consumers wait for parity u & 1.
//   k_empty[s], v_empty[s]: 8 arrivals (lane 0 of each consumer warp); the producer waits for
//     parity (u - 1) & 1 before loading tile t >= 3 into the stage. A consumer cannot release
//     tile t + 3 before the other has released tile t (tile t + 3 is not loaded before), so the
//     8 arrivals of one phase always belong to one tile.
//   q_full: loaded once, parity 0.
// Named barriers 1 and 2 (256 threads: 128 bar.sync + 128 bar.arrive): consumer 1 arrives once
// up front, then each consumer passes the turn after each of its issue sections (a persistent
// CTA's turns run on from query tile to query tile), and consumer 0 takes consumer 1's last pass
// before it exits, so both barriers see equal sync and arrive counts. Masked work left out keeps
// the counts: consumer 0 runs a causal diagonal's tile after its loop at 64 keys and takes that
// loop step's turn empty; consumer 1 of a query tile of 64 rows or fewer takes every turn empty
// and only releases the stages (run_tile; csrc/ws_pipeline_model.py replays both).
// Persistent CTAs (kPersistent, one per SM): see fwd_ws_kernel.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdlib.h>
#include <type_traits>
#include <math.h>

#include "cta_trace.h"
#include "dualkv_kernels.h"
#include "dualkv_fwd_ws.h"
#include "env_choice.h"
#include "sm90_common.h"
#include "sm90_ws_common.h"
#include "wgmma_ops.h"

namespace mdkv {
namespace sm90ws {

using sm90::pack_frags;
using sm90::reg_fence;
using sm90::wg_commit;
using sm90::wg_fence;
using sm90::wg_wait;
using sm90::wgmma_regs_x_tile;
using sm90::wgmma_rows_x_rows;

constexpr int kBQ = 128;      // query rows per CTA (2 consumer warpgroups x 64)
constexpr int kThreadsWS = 384;
#ifndef WS_PREGS
#define WS_PREGS 40
#define WS_CREGS 232
#endif
// Key tile width BK and what goes with it: the K/V ring depth (D = 128: 32 KB Q + 3 x 64 KB K/V =
// 224 KB of the 227 at 128 keys; 2 x 88 KB at 176) and the register split (S and P grow with BK:
// 176 keys need the consumers' 240)
template <int BK>
struct KvTile;
template <>
struct KvTile<128> {
  static constexpr int kStages = 3, kProducerRegs = WS_PREGS, kConsumerRegs = WS_CREGS;
};
template <>
struct KvTile<176> {
  static constexpr int kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
};
static_assert(regs_fit_384(KvTile<128>::kProducerRegs, KvTile<128>::kConsumerRegs), "consumer registers would never be granted");
static_assert(regs_fit_384(KvTile<176>::kProducerRegs, KvTile<176>::kConsumerRegs), "consumer registers would never be granted");
constexpr int kSchedBar = 1;  // named barriers 1, 2: "consumer w may issue its MMAs" (0 is __syncthreads)

// shared memory: Q [kBQ x D], K and V [kStages][kBK x D] (each as D/64 swizzled panels), then
// the mbarriers; the base is 1024-aligned (the 128-byte swizzle pattern repeats every 1024 bytes)
template <typename T, int D, int kBK>
struct Smem {
  static constexpr int kStages = KvTile<kBK>::kStages;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kBQ * D * (int)sizeof(T);
  static constexpr int kV = kK + kStages * kBK * D * (int)sizeof(T);
  static constexpr int kBar = kV + kStages * kBK * D * (int)sizeof(T);
  static constexpr int kQEmpty = kBar + 8 * KvRing<kStages>::kBarCount;  // persistent CTAs only
  static constexpr int kSlot = kQEmpty + 8;                               // int, persistent CTAs only
  static constexpr int kBytes = kSlot + 8 + 1024;
  static_assert(kBytes <= 227 * 1024, "shared memory of the ws forward exceeds the 227 KB an sm_90 CTA can have");
};

// ---------------------------------------------------------------------------------------------
// consumer pieces
// ---------------------------------------------------------------------------------------------

// mask S for key tile [k0, k0 + kBK) (parent tail / causal diagonal), then the online softmax:
// S becomes P (unnormalised, in place), m and l are updated; returns the factor O must be
// rescaled by (per row half r)
template <int kBK>
__device__ __forceinline__ void softmax_step(float (&s)[kBK / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             int k0, bool is_par, int par1, int row_a, int row_w0, int lane,
                                             float sl2) {
  mask_scores<kBK>(s, k0, is_par, par1, row_a, row_w0, lane);
  softmax_update<kBK>(s, m, l, sl2, [&](int r, float f) { alpha[r] = f; });
}

// Skipped when no row of the warp raised its running max (every alpha exactly 1: the result is
// bitwise the same). Past the first tiles of a long row that is most tiles, and the 64 FMULs per
// thread it saves sit on the softmax path that ping-pong must hide: +2-4 % forward on the long
// shapes (docs/PERF.md, fifth session).
template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 2], const float (&alpha)[2]) {
  if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    o[4 * j + 0] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// ---------------------------------------------------------------------------------------------
// the kernel
// ---------------------------------------------------------------------------------------------

// One 128-row query tile of one query head (a row item of cuda_backend.row_items) and the key tiles
// it walks: the parent's full tiles, the row's own tiles, then the parent's partial last tile.
template <int kBK>
struct FwdTile {
  int hk, h, q0, q1, self0, par0, par1, qloc, n_par, n_total, tail_w, n_main, n_pfull;
  // b: the query tile in kv-head-major order; narrow: the narrowest width the parent's partial last
  // tile may run at (16 or 64; 0: not narrowed)
  __device__ __forceinline__ FwdTile(const FwdArgs& a, unsigned b, int narrow) {
    const KvHeadMajorBlock blk(b, a.num_items, a.hq, a.hkv);
    hk = blk.hk;
    h = blk.h;
    const int* w = a.work + blk.item * 8;
    q0 = w[0], q1 = w[1], self0 = w[2], par0 = w[3], par1 = w[4], qloc = w[6];
    n_par = (par1 - par0 + kBK - 1) / kBK;
    n_total = n_par + (q1 - self0 + kBK - 1) / kBK;  // > n_par: q0 >= self0, q1 > q0
    // The parent's last key tile holds only `tail` of its kBK keys; the rest are other tokens' rows,
    // masked (P = 16384 with 176-key tiles: 160 of the 176). Where 16, 32, 64 or 128 keys cover the
    // tail (tail_w < kBK) that tile goes last, after the row's own tiles, and runs after the loop
    // with its S and P V narrowed to tail_w keys; the loop's code is the same either way
    // (docs/PERF.md, nineteenth session: a width chosen inside the loop, or a peeled first step,
    // made ptxas serialize the wgmmas or cost 2-5 %).
    const int tail = n_par > 0 ? par1 - par0 - (n_par - 1) * kBK : kBK;
    // (16 and 32 at 128-key tiles only: with them the 176-key instance spilled 48 bytes)
    const bool narrower = kBK == 128 && narrow <= 16;
    tail_w = !narrow || n_par < 1 ? kBK
             : tail <= 16 && narrower ? 16
             : tail <= 32 && narrower ? 32
             : tail <= 64 ? 64
             : tail <= 128 ? 128 : kBK;
    n_main = tail_w < kBK ? n_total - 1 : n_total;  // tiles of the loop: >= 1 (the own rows)
    n_pfull = tail_w < kBK ? n_par - 1 : n_par;     // parent tiles among them
  }
  __device__ __forceinline__ int kv_start(int t) const {
    if (t < n_pfull) return par0 + t * kBK;
    if (t < n_main) return self0 + (t - n_pfull) * kBK;
    return par0 + (n_par - 1) * kBK;  // t = n_main: the narrowed tail
  }
};

// kPingPong: consumers take turns issuing their MMAs (named barriers); false: they issue freely.
// kPersistent: one CTA per SM takes query tiles (blockIdx.x, then from a.tile_counter) until none is
// left. The producer takes the next tile after issuing the current one's last K/V load (taken when
// a tile started, a CTA that had just begun a long tile held the next one back from idle SMs:
// docs/PERF.md, thirteenth session), loads its Q once both consumers' last S MMA has read the
// current Q (q_empty), and its K/V into the ring as stages free up, so the next tile's start hides
// under the current tile's last P V product and epilogue. The consumers' code per tile is the
// one-tile-per-CTA code with the ring position offset by the tiles streamed before; compiled so, it
// runs each tile 6-11 % slower (the run-time offset 1-5 %, the rest not found), which taking tiles
// in turn wins back only on short walks: cuda_backend.ws_fwd_persistent picks it there
// (docs/PERF.md, twenty-seventh session §9).
template <typename T, int D, bool kPingPong, int kBK, bool kPersistent>
__global__ void __launch_bounds__(kThreadsWS, 1)
    fwd_ws_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                  const __grid_constant__ CUtensorMap tm_v, FwdArgs a, int narrow_tail, int diag64_on,
                  int idle_on) {
  using L = Smem<T, D, kBK>;
  constexpr int kStages = L::kStages;
  extern __shared__ unsigned char smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023);
  T* sQ = reinterpret_cast<T*>(base + L::kQ);
  T* sK = reinterpret_cast<T*>(base + L::kK);
  T* sV = reinterpret_cast<T*>(base + L::kV);
  using Ring = KvRing<kStages>;
  const Ring ring{smem_addr(reinterpret_cast<void*>(base + L::kBar))};
  // persistent: q_empty (8 arrivals, lane 0 of each consumer warp: the tile's last S MMA has read Q)
  // and the slot in which the producer publishes the next query tile (-1: none left)
  const uint32_t q_empty = smem_addr(reinterpret_cast<void*>(base + L::kQEmpty));
  volatile int* slot = reinterpret_cast<volatile int*>(base + L::kSlot);
  const int narrow = kPingPong ? narrow_tail : 0;
  const FwdTile<kBK> first(a, blockIdx.x, narrow);  // one tile per CTA: this CTA's

  // warp-uniform role (the shuffle tells the compiler so: no divergent branch around wgmma)
  const int role = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);

  // stamps (csrc/cta_trace.h, -DMDKV_CTA_TRACE builds only; one tile per CTA): 2 Q in, 3 tile 0 (S
  // and its softmax) done, 4 the loop done, 5 the last P V products and narrowed tiles done, 6 the
  // end of the O / lse stores; the count: key tiles
  if constexpr (!kPersistent) MDKV_TRACE_ENTRY(first.n_total);
  if (threadIdx.x == 0) {
    if constexpr (kPersistent) mbar_init(q_empty, 8);
    ring.init();
  }
  __syncthreads();

  if (role == 0) {
    // ------------------------------- producer -------------------------------
    regs_dec<KvTile<kBK>::kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_map(&tm_q);
      prefetch_map(&tm_k);
      prefetch_map(&tm_v);
      // Q of tile ft, then its K/V tiles, the ring's g .. g + n_total - 1
      auto load_tile = [&](const FwdTile<kBK>& ft, int g) {
        mbar_expect_tx(ring.q_full(), kBQ * D * sizeof(T));
#pragma unroll
        for (int p = 0; p < D / 64; ++p)
          tma_load(smem_addr(sQ + p * kBQ * 64), &tm_q, ring.q_full(), p * 64, ft.h, ft.qloc);
        ring.template load_kv<T, D, kBK>(&tm_k, &tm_v, sK, sV, ft.n_total, ft.hk,
                                         [&](int t) { return ft.kv_start(t); }, g);
      };
      if constexpr (!kPersistent) {
        load_tile(first, 0);
      } else {
        const int n_tiles = a.num_items * a.hq;
        int b = (int)blockIdx.x, g = 0;
        for (int j = 0;; ++j) {
          if (j > 0) mbar_wait(q_empty, (j - 1) & 1);  // tile j - 1's Q read (and its slot)
          *slot = b < n_tiles ? b : -1;
          if (b >= n_tiles) {
            mbar_arrive(ring.q_full());  // no bytes: the consumers wake, read -1 and stop
            break;
          }
          const FwdTile<kBK> ft(a, (unsigned)b, narrow);
          load_tile(ft, g);  // the q_full arrival publishes the slot (release, CTA scope)
          g += ft.n_total;
          b = (int)gridDim.x + atomicAdd(a.tile_counter, 1);
        }
      }
    }
    return;
  }

  // ------------------------------- consumers -------------------------------
  regs_inc<KvTile<kBK>::kConsumerRegs>();
  const int cw = role - 1;  // consumer 0 / 1: query rows q0 + 64 * cw ...
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const T* sQw = sQ + cw * 64 * 64;
  const float sl2 = a.scale_log2;
  const int my_bar = kSchedBar + cw, other_bar = kSchedBar + (cw ^ 1);
  // The turn pass after each issue section: unconditional (consumer 1's last pass is taken by
  // consumer 0 at the end) and with the barrier id an immediate. A pass behind a test of the loop's
  // end ("consumer 1's last turn passes nothing on") with a computed id was issued 13-20
  // instructions after the MMAs in the persistent kernel (ptxas put the next step's mask setup
  // first), and at 176-key tiles the id was spilled and reloaded; this form made the one-tile-per-CTA
  // forward 0.5-7 % faster on 13 long shapes (H100, docs/PERF.md, twenty-seventh session §3).
  auto pass_turn = [&]() {
    if (cw == 0)
      named_arrive_id<kSchedBar + 1>(256);
    else
      named_arrive_id<kSchedBar>(256);
  };

  float o[D / 2];
  float m[2], l[2], alpha[2];
  float s[kBK / 2];
  uint32_t pa[kBK / 16][4];
  auto start_tile = [&]() {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  };

  // Query tile ft, once its Q is in: its key tiles are the ring's g, g + 1, ...
  auto run_tile = [&](const FwdTile<kBK>& ft, const int g) {
    const int n_main = ft.n_main, n_pfull = ft.n_pfull, tail_w = ft.tail_w, par1 = ft.par1;
    const int row_w0 = ft.q0 + cw * 64;
    const int row_a = row_w0 + warp * 16 + (lane >> 2);  // this thread's rows: row_a, row_a + 8
    // Consumer 0 at a causal diagonal: with 128-key tiles a row's last own key tile starts at its
    // query tile's first row, so its keys from row_w0 + 64 on are masked for all of consumer 0's
    // rows. Consumer 0 leaves that tile out of its loop (taking the loop step's turn empty, so
    // both consumers still pass the same number of turns) and runs it after the loop at 64 keys:
    // half its S and P V MMAs, which consumer 1's turns get instead. A separate step after the
    // loop, not a width chosen inside it (docs/PERF.md, nineteenth session: that serialized the
    // wgmmas). MEGATRON_DUALKV_WS_FWD_DIAG=0: the full-width tile in the loop.
    const bool diag64 = kBK == 128 && diag64_on && cw == 0 && n_main >= 2 && ft.kv_start(n_main - 1) >= row_w0;
    const int n_loop = diag64 ? n_main - 1 : n_main;  // tiles of this consumer's loop
    auto stage = [&](int t) { return Ring::stage(g + t); };
    auto parity = [&](int t) { return Ring::parity(g + t); };
    // the loop's ring positions kept incrementally (stage and parity of tiles t and t - 1, stage of
    // t - 2), so that the loop's code does not depend on g
    int st_c = stage(1), st_p = stage(0), st_pp = stage(0);
    uint32_t ph_c = parity(1), ph_p = parity(0);

    // Consumer 1 without rows (a query tile of 64 rows or fewer: a segment's last) computes
    // nothing: it takes its turns empty, so consumer 0's MMAs have the tensor cores to
    // themselves, and releases each stage once loaded (waiting for the load keeps its arrivals in
    // the stage's current phase). MEGATRON_DUALKV_WS_FWD_IDLE=0: it walks the tile as before.
    if (idle_on && cw == 1 && ft.q1 <= row_w0) {
      if constexpr (kPersistent)
        if (lane == 0) mbar_arrive(q_empty);  // it never reads this Q
      for (int t = 0; t < ft.n_total; ++t) {
        if (kPingPong && t < n_main) {  // tile 0's section and the loop's: the turns of a walk
          named_sync(my_bar, 256);
          pass_turn();
        }
        mbar_wait(ring.k_full(stage(t)), parity(t));
        mbar_wait(ring.v_full(stage(t)), parity(t));
        if (lane == 0) {
          mbar_arrive(ring.k_empty(stage(t)));
          mbar_arrive(ring.v_empty(stage(t)));
        }
      }
      return;
    }

    // tile 0: S only
    mbar_wait(ring.k_full(stage(0)), parity(0));
    if (kPingPong) named_sync(my_bar, 256);
    wg_fence();
    wgmma_rows_x_rows<T, D, kBQ, kBK>(s, sQw, 0, sK + stage(0) * kBK * D);
    wg_commit();
    if (kPingPong) pass_turn();
    wg_wait<0>();
    reg_fence(s);
    if (lane == 0) mbar_arrive(ring.k_empty(stage(0)));
    softmax_step<kBK>(s, m, l, alpha, ft.kv_start(0), n_pfull > 0, par1, row_a, row_w0, lane, sl2);
    if constexpr (!kPersistent) MDKV_TRACE_STAMP(3);

    // Steady state: S_t and O += P_{t-1} V_{t-1} in flight together; the softmax of S_t runs under
    // the P V MMA. The wait for that MMA sits at the top of the next iteration, not after the
    // softmax: in one basic block ptxas hoists WARPGROUP.DEPBAR above the softmax (seen in the
    // SASS), which serializes them again; the loop back edge keeps it below.
    for (int t = 1; t < n_loop; ++t) {
      const int st = st_c, sp = st_p;
      wg_wait<0>();  // O += P_{t-2} V_{t-2} complete (nothing pending when t = 1)
      reg_fence(o);
      reg_fence_u(pa);
      if (lane == 0 && t >= 2) mbar_arrive(ring.v_empty(st_pp));
      rescale<D>(o, alpha);
      pack_frags<T, kBK>(pa, s);
      mbar_wait(ring.k_full(st), ph_c);
      mbar_wait(ring.v_full(sp), ph_p);
      if (kPingPong) named_sync(my_bar, 256);
      reg_fence(o);
      reg_fence_u(pa);
      wg_fence();
      wgmma_rows_x_rows<T, D, kBQ, kBK>(s, sQw, 0, sK + st * kBK * D);
      wg_commit();
      wgmma_regs_x_tile<T, D, kBK>(o, pa, sV + sp * kBK * D);
      wg_commit();
      if (kPingPong) pass_turn();
      wg_wait<1>();  // S_t complete, P V still running
      reg_fence(s);
      if (lane == 0) mbar_arrive(ring.k_empty(st));
      softmax_step<kBK>(s, m, l, alpha, ft.kv_start(t), t < n_pfull, par1, row_a, row_w0, lane, sl2);
      st_pp = st_p;
      st_p = st_c;
      ph_p = ph_c;
      if (++st_c == kStages) {
        st_c = 0;
        ph_c ^= 1u;
      }
    }
    if constexpr (kPersistent)
      if (lane == 0 && tail_w == kBK && !diag64) mbar_arrive(q_empty);  // the loop's last S was the tile's last
    if (kPingPong && diag64) {  // the diagonal tile's loop step: its turn, passed on at once
      named_sync(my_bar, 256);
      pass_turn();
    }

    if constexpr (!kPersistent) MDKV_TRACE_STAMP(4);
    // the last two P V products
    {
      wg_wait<0>();
      reg_fence(o);
      reg_fence_u(pa);
      if (lane == 0 && n_loop >= 2) mbar_arrive(ring.v_empty(stage(n_loop - 2)));
      rescale<D>(o, alpha);
      pack_frags<T, kBK>(pa, s);
      const int sl = stage(n_loop - 1);
      mbar_wait(ring.v_full(sl), parity(n_loop - 1));
      reg_fence(o);
      reg_fence_u(pa);
      wg_fence();
      wgmma_regs_x_tile<T, D, kBK>(o, pa, sV + sl * kBK * D);
      wg_commit();
      wg_wait<0>();
      reg_fence(o);
      if (lane == 0) mbar_arrive(ring.v_empty(sl));
    }

    // Key tile t narrowed to its first W keys, without overlap: S, softmax, P V. The diagonal tile
    // (t = n_main - 1, causal) and the parent's narrowed tail (t = n_main); last_s: the query
    // tile's last S (its Q may be replaced)
    auto narrow_tile = [&](auto width, const int t, const bool parent, const bool last_s) {
      constexpr int W = decltype(width)::value;
      const int st = stage(t);
      float sn[W / 2];
      mbar_wait(ring.k_full(st), parity(t));
      wg_fence();
      wgmma_rows_x_rows<T, D, kBQ, W, kBK>(sn, sQw, 0, sK + st * kBK * D);
      wg_commit();
      wg_wait<0>();
      reg_fence(sn);
      if (lane == 0) {
        mbar_arrive(ring.k_empty(st));
        if (kPersistent && last_s) mbar_arrive(q_empty);
      }
#pragma unroll
      for (int i = 0; i < kBK / 2; ++i) s[i] = i < W / 2 ? sn[i] : -INFINITY;
      softmax_step<kBK>(s, m, l, alpha, ft.kv_start(t), parent, par1, row_a, row_w0, lane, sl2);
      rescale<D>(o, alpha);
      pack_frags<T, kBK>(pa, s);
      mbar_wait(ring.v_full(st), parity(t));
      reg_fence(o);
      reg_fence_u(pa);
      wg_fence();
      wgmma_regs_x_tile<T, D, kBK, W / 16>(o, pa, sV + st * kBK * D);
      wg_commit();
      wg_wait<0>();
      reg_fence(o);
      if (lane == 0) mbar_arrive(ring.v_empty(st));
    };
    if (diag64) narrow_tile(std::integral_constant<int, 64>(), n_main - 1, false, tail_w == kBK);
    if (kBK == 128 && tail_w == 16)
      narrow_tile(std::integral_constant<int, 16>(), n_main, true, true);
    else if (kBK == 128 && tail_w == 32)
      narrow_tile(std::integral_constant<int, 32>(), n_main, true, true);
    else if (tail_w == 64)
      narrow_tile(std::integral_constant<int, 64>(), n_main, true, true);
    else if (tail_w == 128 && kBK > 128)
      narrow_tile(std::integral_constant<int, 128>(), n_main, true, true);

    // out / lse hold the rows from qloc on (local queries): shift both so that packed row q0 lands there
    const long qs = (long)a.hq * D, shift = (long)ft.qloc - ft.q0;
    // 16-byte stores: 1.5 % faster forward on (28, 4096, R), whose short CTAs wait on the epilogue's
    // 4-byte stores (lg throttle, drain at exit); 0.1-0.7 % on the long shapes (docs/PERF.md,
    // twenty-first session)
    if constexpr (!kPersistent) MDKV_TRACE_STAMP(5);
    store_out_lse<T, D, true>(reinterpret_cast<T*>(a.out) + ft.h * D + shift * qs, qs,
                              a.lse + (long)ft.h * a.Tq + shift, row_a, ft.q1, lane, o, m, l);
    if constexpr (!kPersistent) MDKV_TRACE_END();
  };

  if constexpr (!kPersistent) {
    start_tile();
    mbar_wait(ring.q_full(), 0);
    MDKV_TRACE_STAMP(2);
    if (kPingPong && cw == 1) named_arrive(other_bar, 256);  // consumer 0 takes the first turn
    run_tile(first, 0);
  } else {
    int g = 0;  // K/V tiles of this CTA's earlier query tiles
    if (kPingPong && cw == 1) named_arrive(other_bar, 256);  // consumer 0 takes the first turn
    for (int j = 0;; ++j) {
      mbar_wait(ring.q_full(), j & 1);
      // read through a shuffle the slot is warp-uniform to the compiler: the tile's fields, the ring
      // position and so the wgmma descriptors stay in uniform registers (a plain shared load left
      // them in vector registers, an R2UR before every HGMMA: the loop 12 % slower, thirteenth session)
      const int b = __shfl_sync(0xffffffffu, *slot, 0);
      if (b < 0) break;
      const FwdTile<kBK> ft(a, (unsigned)b, narrow);
      start_tile();
      run_tile(ft, g);
      g += ft.n_total;
    }
  }
  if (kPingPong && cw == 0) named_sync(my_bar, 256);  // consumer 1's last pass
}

// ---------------------------------------------------------------------------------------------
// host: tensor maps and launch
// ---------------------------------------------------------------------------------------------

template <typename T, int D, int kBK>
static cudaError_t fwd_ws_t(const FwdArgs& a, CUtensorMapDataType dt, bool narrow_tail, cudaStream_t stream) {
  using L = Smem<T, D, kBK>;
  // MEGATRON_DUALKV_WS_PINGPONG=0: consumers without turns (an A/B switch for the first timings),
  // one tile per CTA; persistent CTAs where the caller passes a tile counter (with turns only)
  const char* pp = std::getenv("MEGATRON_DUALKV_WS_PINGPONG");
  const bool turns = !(pp && std::atoi(pp) == 0), persistent = turns && a.tile_counter != nullptr;
  auto k = !turns ? fwd_ws_kernel<T, D, false, kBK, false>
                  : (persistent ? fwd_ws_kernel<T, D, true, kBK, true> : fwd_ws_kernel<T, D, true, kBK, false>);
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (e != cudaSuccess) return e;
  if (a.num_items == 0 || a.T == 0 || a.Tq == 0) return cudaSuccess;
  const long n_tiles = (long)a.num_items * a.hq;
  long grid = n_tiles;
  if (persistent) {
    int dev = 0, sms = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
      return e;
    grid = n_tiles < sms ? n_tiles : sms;  // one CTA per SM (its shared memory holds one)
  }
  CUtensorMap mq, mk, mv;
  const int es = (int)sizeof(T);
  if (!make_map(&mq, a.q, dt, D, a.hq, a.Tq, kBQ, es) || !make_map(&mk, a.k, dt, D, a.hkv, a.T, kBK, es) ||
      !make_map(&mv, a.v, dt, D, a.hkv, a.T, kBK, es))
    return cudaErrorInvalidResourceHandle;  // tensor map encoding failed (driver entry point or arguments)
  const int narrowest = ws_fwd_tail_min_from_env();
  if (narrowest < 0) return cudaErrorInvalidValue;  // the op names the variable first
  const int diag64 = ws_fwd_diag_from_env(), idle = ws_fwd_idle_from_env();
  if (diag64 < 0 || idle < 0) return cudaErrorInvalidValue;
  MDKV_TRACE_SET_BUFFER("MDKV_CTA_TRACE_FWD", stream);
  k<<<(unsigned)grid, kThreadsWS, L::kBytes, stream>>>(mq, mk, mv, a, narrow_tail ? narrowest : 0, diag64, idle);
  return cudaGetLastError();
}

}  // namespace sm90ws

int ws_fwd_tail_min_from_env() {
  // 16: a tail of up to 16 or 32 keys runs at that width (the ragged prompts of GRPO layouts);
  // 64: at 64 at least, as before (an A/B switch)
  return env_choice("MEGATRON_DUALKV_WS_FWD_TAIL_MIN", {{"16", 16}, {"64", 64}});
}

int ws_fwd_diag_from_env() { return env_choice("MEGATRON_DUALKV_WS_FWD_DIAG", {{"1", 1}, {"0", 0}}); }
int ws_fwd_idle_from_env() { return env_choice("MEGATRON_DUALKV_WS_FWD_IDLE", {{"1", 1}, {"0", 0}}); }

cudaError_t launch_fwd_ws_sm90(const FwdArgs& a, int dtype, int d, int kv_tile, bool narrow_tail,
                               cudaStream_t stream) {
  if (kv_tile != 128 && !(kv_tile == 176 && d == 128)) return cudaErrorInvalidValue;
  const bool wide = kv_tile == 176;
  constexpr auto bf = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, hf = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (dtype == kBF16 && d == 128)
    return wide ? sm90ws::fwd_ws_t<__nv_bfloat16, 128, 176>(a, bf, narrow_tail, stream)
                : sm90ws::fwd_ws_t<__nv_bfloat16, 128, 128>(a, bf, narrow_tail, stream);
  if (dtype == kBF16 && d == 64) return sm90ws::fwd_ws_t<__nv_bfloat16, 64, 128>(a, bf, narrow_tail, stream);
  if (dtype == kFP16 && d == 128)
    return wide ? sm90ws::fwd_ws_t<__half, 128, 176>(a, hf, narrow_tail, stream)
                : sm90ws::fwd_ws_t<__half, 128, 128>(a, hf, narrow_tail, stream);
  if (dtype == kFP16 && d == 64) return sm90ws::fwd_ws_t<__half, 64, 128>(a, hf, narrow_tail, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mdkv
