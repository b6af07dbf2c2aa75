// DualKV backward dK/dV + dQ for Hopper (sm_90a), warp-specialized ("ws"): the default backward.
// Fast mode adds dQ as described below. kDQ = false (deterministic=True, no dq_acc): dK and dV only,
// every walk in list order (no phase-aligned start), a split key tile's parts summed in part order
// (epilogue), so they are bitwise reproducible; its steps overlap P^T with the previous step's
// dV / dK MMAs (kOverlap); a dQ kernel then computes dQ (dualkv_ws_ops.cpp).
//
// Same math as dkdv_kernel<..., kAtomicDQ = true> in dualkv_bwd_sm90.cu, and the same per-CTA
// accumulation order of dK/dV where no walk is phase-aligned or split (field 7 below) (one CTA
// per 128-row key tile and kv head, walking every query head of the
// GQA group and every query tile that attends the keys), restructured like the ws forward. Query
// tiles ("steps") of QT = 64 rows, or 80 at head dim 128 (the default there, "wide steps"; dK/dV
// stay bitwise equal: the MMAs still add 16-row slices in the same order). Wide steps differ in
// three places: dQ^T = K^T dS^T (M = dQ columns, N = 80 query rows: the MMA's M must be a multiple
// of 64), dS stored as [query][key] panels by stmatrix.trans, and the dQ issued after dV/dK have
// completed, outside the turns (registers); two Q/dO stages instead of three (shared memory).
// Blocks are kv-head-major (all key tiles of kv head 0, then of kv head 1, ...) so that the CTAs
// resident at once share one kv head's query tiles and dQ rows in L2, in two bands: the long key
// tiles of every kv head first, then the others (the block mapping below).
// Work items (cuda_backend.ws_kv_work): [k0, k1, rlo, rhi, tiles_per_head, n_long, wide_tiles_per_head,
// split, tail, dest] (query tiles of 64 and of kWideQT rows per head; split: 0, a part of a key
// tile split by query rows or of a prompt's tail (> 0), or a phase-aligned walk (< 0), see where it
// is read; tail > 0: the first `tail` key rows are a prompt's partial last key tile, rows dest..,
// the rest keys k0 + tail..k1 of a response, see where it is read); the query
// rows that attend keys k0..k1 are the ranges rlo..rhi of a.ranges, 4 int32 each:
// (a, b, loc, causal): packed rows [a, b), held at rows loc.. of q / dout / lse / delta / dq_acc
// (loc = a unless a context-parallel rank holds only some queries: "local queries"); causal
// ranges are the key tile's own segment (masked by qrow >= krow), the others its children.
//   warpgroup 0, producer (setmaxnreg 24): one warp, the one that orders the steps (a split
//     list's walks take each query head's tiles last first: DkvArgs::reverse_rows). Lane 0 loads
//     K and V once and, per step, the Q and dO tiles with TMA into a ring of kStagesB stages (3;
//     2 with wide steps) and writes the step's tile descriptor (q0, qend, local row, causal) into
//     a ring of 8; the 32 lanes load the step's lse (stored as -lse * log2 e) and delta values
//     with plain loads into shared memory and arrive on the stage's mbarrier (release semantics
//     order their st.shared before the arrival).
//   warpgroups 1, 2, consumers (setmaxnreg 240): 64 key rows each, dK and dV in registers.
//     Step i: group A = S^T = K Q^T, dP^T = V dO^T (wgmma); P^T and dS^T in registers; group B =
//     dV += P^T dO, dK += dS^T Q (register A), issued first, then (while they run) dS^T into this
//     consumer's half of buffer i & 1, then dQ of step i-1 = dS K from buffer (i-1) & 1 (D = 128: this consumer's 64 dQ columns over all
//     128 keys, both halves; D = 64: a partial dQ over its own 64 keys, its own half); then dQ of
//     step i-1 is added to the fp32 dQ buffer (below). The dQ of the last step is a group of its
//     own. dQ lags one step so that a consumer reads the other's dS^T half of a step both finished
//     long ago: the halves are handed over by mbarriers (ds_full / ds_empty), not by a barrier
//     that would hold the two consumers in lockstep. Turns (MEGATRON_DUALKV_WS_BWD_TURNS, default
//     on): the consumers issue their MMA groups alternately (named barriers 8 + cw), so one's
//     softmax and dQ stores run under the other's MMAs.
//
// mbarrier phases (query step i lives in stage i % kStagesB, u = i / kStagesB):
//   kv_full: 1 arrival + the K/V bytes, parity 0. A response tile holding its prompt's tail keys
//     (item field 8 > 0): the box lands on kv_tma (1 arrival + the bytes), the producer warp waits
//     for it, writes the tail rows over the box's first rows, fences (fence.proxy.async) and lane 0
//     arrives on kv_full (1 arrival, no bytes).
//   q_full[s]: 33 arrivals (lane 0's arrive.expect_tx + the 32 lanes after their lse/delta
//     stores) + the Q/dO bytes; consumers wait for parity u & 1.
//   empty[s]: 8 arrivals (lane 0 of each consumer warp) after the step's group B completed (Q, dO,
//     lse, delta no longer read; wide steps: dV / dK, before the dQ MMA is issued); the producer
//     waits for parity (u - 1) & 1 before refilling.
//   ds_full[b][h]: 128 arrivals (every thread of consumer h after its dS^T stores and
//     fence.proxy.async); the dQ MMA of step i waits for the use (i - 1) >> 1 of buffer (i-1) & 1.
//   ds_empty[b][h]: one arrival per warp that reads half h (D = 128: 8, D = 64: 4) after its dQ
//     MMA completed; consumer h waits for the use (i - 2) >> 1 before writing buffer i & 1.
// csrc/ws_pipeline_model.py replays this protocol under random interleavings.
//
// dQ into dq_acc by TMA reduce-add (kTmaDQ, default): each consumer owns one fp32 staging tile (QT
// query rows x 64 dQ columns, 16 or 20 KB, two 32-column halves of QT rows x 128 B, 128-byte swizzled
// like the tensor map's box). Thread 0 waits until the previous reduce has read the tile
// (cp.async.bulk.wait_group.read 0), named barrier 6 + cw (warp 0 arrives, warps 1-3 wait), every
// thread stores its fragment (the box adds all QT rows; rows >= qend hold zeros, their lse being
// -inf); after the consumer has issued its next MMA group (so that the stores land meanwhile):
// fence.proxy.async, named barrier 4 + cw (warps 1-3 arrive, warp 0 waits), then thread 0 issues
// two cp.reduce.async.bulk.tensor (add, fp32) and commits one bulk group. Each barrier blocks only the
// side that needs the other (bar.arrive releases the arriving threads' prior stores). The box starts
// at the tile's local row ql (dq_acc holds Tq rows); rows past Tq are dropped by TMA. Before
// exiting, thread 0 waits for the writes too (wait_group 0). MEGATRON_DUALKV_WS_DQ=atomic: float2
// atomics from registers instead (slower, kept for A/B).

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <math.h>
#include <cstdlib>
#include <type_traits>

#include "cta_trace.h"
#include "dualkv_kernels.h"
#include "dualkv_fwd_ws.h"
#include "env_choice.h"
#include "sm90_common.h"
#include "sm90_ws_common.h"
#include "wgmma_ops.h"

namespace mdkv {
namespace sm90ws {

using sm90::fence_proxy_async;
using sm90::pack_frags;
using sm90::reg_fence;
using sm90::store_ds_t;
using sm90::wg_commit;
using sm90::wg_fence;
using sm90::wg_wait;
using sm90::wgmma_ds_x_k;
using sm90::wgmma_regs_x_tile;
using sm90::wgmma_rows_x_rows;

constexpr int kKVB = 128;    // key rows per CTA (2 consumers x 64)
// Query rows per step (QT): 64, or kWideQT at head dim 128 (wide steps: S^T and dP^T as m64n80
// wgmmas and dQ^T = K^T dS^T, 8 % fewer shared-memory bytes per MMA flop; the 227 KB then hold two
// Q/dO stages instead of three). cuda_backend.WS_BWD_WIDE_TILE is the same number. Ring depth of
// Q/dO/lse/delta per QT:
constexpr int kWideQT = 80;
template <int QT>
constexpr int stages_b() {
  return QT == kWideQT ? 2 : 3;
}
// descriptors of steps i-1 .. i+3 may be live at once (dQ lags one step; the producer runs at most
// kStagesB steps ahead of the slower consumer), so the ring has more slots than the stages
constexpr int kTdRing = 8;
constexpr int kThreadsB = 384;
constexpr int kProducerRegsB = 24, kConsumerRegsB = 240;
static_assert(regs_fit_384(kProducerRegsB, kConsumerRegsB), "consumer registers would never be granted");

template <typename T, int D, bool kTmaDQ, int QT>
struct BwdSmem {
  static constexpr int kStagesB = stages_b<QT>();
  static constexpr int kTile = QT * D * (int)sizeof(T);
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKVB * D * (int)sizeof(T);
  static constexpr int kQ = kV + kKVB * D * (int)sizeof(T);
  static constexpr int kDO = kQ + kStagesB * kTile;
  static constexpr int kDS = kDO + kStagesB * kTile;                 // 2 x [kKVB x QT] (dS^T; QT 80: dS)
  static constexpr int kStg = kDS + 2 * kKVB * QT * (int)sizeof(T);   // kTmaDQ: 2 x [2][QT][32] fp32
  static constexpr int kStgBytes = kTmaDQ ? 2 * QT * 64 * (int)sizeof(float) : 0;
  static constexpr int kL = kStg + kStgBytes;                         // [kStagesB][QT] lse
  static constexpr int kDl = kL + kStagesB * QT * (int)sizeof(float);  // [kStagesB][QT] delta
  static constexpr int kTd = kDl + kStagesB * QT * (int)sizeof(float);  // [kTdRing] int4 tile descriptor
  static constexpr int kBar = kTd + kTdRing * 16;
  // kv_full, q_full[], empty[], ds_full[2][2], ds_empty[2][2], kv_tma
  static constexpr int kBarCount = 2 + 2 * kStagesB + 8;
  static constexpr int kBytes = kBar + 8 * kBarCount + 1024;
  static_assert(kStg % 1024 == 0, "the 128-byte swizzle of the dQ staging tile needs a 1024-aligned base");
  static_assert(kBytes <= 227 * 1024, "shared memory of the ws backward exceeds the 227 KB an sm_90 CTA can have");
};

// fp32 dQ tile of one consumer, 32 columns x 64 rows from shared memory added into the tensor map's
// (c0, c1, c2) box; completes in the issuing thread's current bulk group
__device__ __forceinline__ void tma_reduce_add(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// the shared-memory sources of every committed bulk group have been read (may be overwritten)
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// every committed bulk group has completed (its global writes included)
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// This consumer's dS fragment (dS^T in the accumulator layout of S^T: key rows row0 + (lane >> 2)
// (+ 8), QT query columns) transposed into an [QT x 64] panel of key columns (poff<QT>) with
// stmatrix.trans: 8x8 block (j, hh) of da[j >> 1][(j & 1) * 2 + hh] becomes query rows 8j..8j+7,
// keys (row0 & 63) + 8hh .. + 7 (one 16-byte chunk per row; 8 distinct chunks per block: no bank
// conflict). The dQ^T MMA reads the panels as its K-major B operand.
template <typename T, int QT>
__device__ __forceinline__ void store_ds_qk(T* panel, int row0, int lane, const uint32_t (&da)[QT / 16][4]) {
  const int blk = lane >> 3, t = lane & 7;  // this lane addresses row t of block blk of each x4
  const int chunk = ((row0 & 63) >> 3) + (blk & 1);
#pragma unroll
  for (int m = 0; m < QT / 16; ++m) {
    const int q = (2 * m + (blk >> 1)) * 8 + t;
    const uint32_t addr = smem_addr(panel + q * 64 + ((chunk ^ t) << 3));
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(da[m][0]), "r"(da[m][1]), "r"(da[m][2]), "r"(da[m][3])
                 : "memory");
  }
}

// The CTA's work: kv item `item` of kv head hk, query heads part head_part of head_parts.
// kv-head-major block order: the CTAs resident at once work for one kv head, so they share its
// query tiles and dQ rows in L2 (item-major, 8 kv heads' working sets competed: 3.4x the DRAM
// traffic on (16, 32768, 2048), docs/PERF.md "Backward: where the time goes"). In two bands:
// first the long items (0 .. n_long - 1, field 5 of every item; cuda_backend.ws_kv_work) of
// every kv head, then the others. One band, head-major throughout, started the last kv head's
// long prompt tiles after most short response tiles: the tail made (28, 4096, R) ~11 % slower.
// Head parts (a.head_parts > 1 in the long band, a.rest_parts > 1 in the second): each item of the
// band runs as that many CTAs per kv head, part j walking query heads j * group / parts .. of the
// group, kv-head-major then part-major inside the band, so that the CTAs resident at once walk the
// same query heads: walks of 8 heads (Hq / Hkv = 32 / 4) drift apart by one causal walk per head,
// and the resident CTAs' rows no longer fit in L2 (docs/PERF.md, thirty-third session; the
// responses' own walks on multi-group GRPO layouts, thirty-sixth session §4-§5). The parts' dK/dV
// meet in fp32 slots from a.head_slot_base (fast mode: every part but the last stores its own, the
// last adds them; deterministic: as a split key tile's, see the epilogue). An item that is a prompt
// tail's part (field 7 > 0) keeps its own slot and is walked whole by part 0; its other parts'
// CTAs exit at once (head_part >= head_parts).
struct BlockMap {
  int item, hk, head_parts, head_part;
};
__device__ __forceinline__ BlockMap map_block(const DkvArgs& a, unsigned block) {
  const int n_long = a.work[5];
  const int long_blocks = n_long * a.hkv * a.head_parts;
  const bool in_long = (int)block < long_blocks;
  const int band_block = (int)block - (in_long ? 0 : long_blocks);  // block index inside its band
  const int band_items = in_long ? n_long : a.num_items - n_long;
  const int parts = in_long ? a.head_parts : a.rest_parts;
  const int hkp = band_block / band_items, item = (in_long ? 0 : n_long) + band_block % band_items;
  const bool whole = parts > 1 && a.work[item * kWsKvItemInts + 7] > 0;  // a tail's part
  return {item, hkp / parts, whole ? 1 : parts, hkp % parts};
}
// this CTA's index, read again where the block map is needed after the walk: recomputing the map
// there keeps its fields out of the consumers' registers during the walk
__device__ __forceinline__ unsigned ctaid_x() {
  unsigned x;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  return x;
}

// kOverlap (deterministic dK/dV only, 64-row steps; the default there): each consumer issues S^T
// of step i and dV, dK of step i - 1 back to back and computes P^T of step i under the dV / dK
// MMAs (part of the forward's intra-warpgroup overlap; see overlapped_walk below)
template <typename T, int D, bool kTmaDQ, bool kTurns, int QT, bool kDQ, bool kOverlap = false>
__global__ void __launch_bounds__(kThreadsB, 1)
    dkdv_ws_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                   const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                   const __grid_constant__ CUtensorMap tm_dq, DkvArgs a) {
  static_assert(QT == 64 || (QT == kWideQT && D == 128 && kTmaDQ), "wide query steps: head dim 128, dQ by TMA");
  // (80-row steps: S^T, dP^T and P^T, dS^T grow to 40 registers each; that instance spilled 48
  // bytes and ran 12-30 % slower than 64-row steps, docs/PERF.md, twenty-third session)
  static_assert(!kOverlap || (!kDQ && QT == 64), "the overlapped walk computes dK/dV only, in 64-row steps");
  constexpr bool kWide = QT == kWideQT;
  using L = BwdSmem<T, D, kTmaDQ, QT>;
  constexpr int kStagesB = L::kStagesB;
  extern __shared__ unsigned char smem_raw[];
  // 1024-aligned base as an offset from smem_raw (not through an integer cast), so the compiler
  // keeps the shared address space: LDS/STS for lse, delta and dS^T instead of generic LD/ST
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  T* sK = reinterpret_cast<T*>(base + L::kK);
  T* sV = reinterpret_cast<T*>(base + L::kV);
  T* sQ = reinterpret_cast<T*>(base + L::kQ);
  T* sdO = reinterpret_cast<T*>(base + L::kDO);
  T* sdS = reinterpret_cast<T*>(base + L::kDS);
  float* sL = reinterpret_cast<float*>(base + L::kL);
  float* sDl = reinterpret_cast<float*>(base + L::kDl);
  int4* sTd = reinterpret_cast<int4*>(base + L::kTd);
  float* sStg = reinterpret_cast<float*>(base + L::kStg);  // kTmaDQ only
  const uint32_t bar0 = smem_addr(base + L::kBar);
  const uint32_t kv_full = bar0;
  auto q_full = [&](int s) { return bar0 + 8u * (1 + s); };
  auto empty = [&](int s) { return bar0 + 8u * (1 + kStagesB + s); };
  // dS^T buffer b, key half h (written by consumer h): full = its 128 threads stored it; empty =
  // every consumer whose dQ MMA reads it (D = 128: both; D = 64: consumer h) completed that MMA
  auto ds_full = [&](int b, int h) { return bar0 + 8u * (1 + 2 * kStagesB + 2 * b + h); };
  auto ds_empty = [&](int b, int h) { return bar0 + 8u * (1 + 2 * kStagesB + 4 + 2 * b + h); };
  // a prompt tail's response tile: the K/V box landed, before the tail rows are written over it
  const uint32_t kv_tma = bar0 + 8u * (1 + 2 * kStagesB + 8);
  auto stage = [](int i) { return i % kStagesB; };
  auto parity = [](int i) { return (uint32_t)((i / kStagesB) & 1); };

  const int group = a.hq / a.hkv;
  const BlockMap bm = map_block(a, blockIdx.x);
  if (bm.head_part >= bm.head_parts) return;  // a tail's part beyond part 0: walked whole there
  const int item = bm.item, hk = bm.hk;
  const int heads = group / bm.head_parts;          // query heads this CTA walks
  const int h0 = hk * group + bm.head_part * heads;  // the first of them
  const int* w = a.work + item * kWsKvItemInts;
  const int k0 = w[0], k1 = w[1], rlo = w[2], rhi = w[3], per_head = kWide ? w[6] : w[4];
  // fields 8, 9: a response's first key tile that holds its prompt's partial last key tile
  // (cuda_backend.ws_kv_work, merge_tails): key rows k0..k0 + tail - 1 of the tile are the prompt's
  // keys tail_dest.. (loaded over the box's first rows), rows k0 + tail..k1 the response's keys
  // k0 + tail..; the tile walks the response's rows only (k0 + tail on), so the causal mask (query
  // row >= k0 + key index) never masks the tail keys, which every row of the response attends.
  // The tail rows' dK/dV are a part of the tail's slot (field 7), stored at tail_dest.. by its last
  // part. Else tail <= 0 and tail_dest = k0 (a split part's rows go to their own rows).
  const int tail = w[8] > 0 ? w[8] : 0, tail_dest = w[9];
  // field 7: 0, or (slot << 20) | (part << 10) | parts: a key tile split by query rows
  // (cuda_backend.split_by_rows, where one CTA walking all its rows would outlast the rest of the
  // grid) into `parts` items of which this is number `part`; its dK/dV go to the fp32 workspace
  // (epilogue below): fast mode, added into slot `slot`; deterministic (!kDQ), stored into slot
  // slot + part, the tile's parts numbering consecutive slots from `slot`
  // (step i: query head h0 + i / per_head, its query tile i % per_head, or with
  // a.reverse_rows per_head - 1 - i % per_head)
  // or < 0: -1 - phase slot, the walk of a root's key tile whose child ranges come first and are
  // walked from the step other CTAs of this kv head walk now (below)
  // (head parts are summed the same way: see the epilogue)
  // !kDQ (the deterministic mode's dK/dV): always list order, so the sums' order never varies
  const int phase_slot = kDQ && w[7] < 0 ? -1 - w[7] : -1;
  const int n_iter = per_head * heads;
  // The overlapped deterministic walk: a key tile whose first range is its own causal rows from
  // k0 on starts each head's walk (reversed, on a split list: ends it) with rows k0..k0 + 63,
  // which lie before all of consumer 1's keys (k0 + 64 on): every score of that step is masked
  // for it. Those `heads` diagonal steps are walked last, after every head's other
  // steps, and consumer 1 stops before them (it only releases their stages and takes their turns
  // empty): no branch around a wgmma issue, which made ptxas fence every register-operand wgmma
  // and cost the kernel 24-37 % (docs/PERF.md, twenty-ninth session §4). Only the sums' order
  // changes: still a fixed order (deterministic), no longer the sm90 kernel's (list order).
  // MEGATRON_DUALKV_DET_SKIP=0 keeps the plain walk.
  bool diag_last = false;
  if constexpr (kOverlap) {
    if (a.skip_masked_steps && tail == 0 && k1 - k0 > 64 && rhi > rlo) {
      const int4 g0 = __ldg(reinterpret_cast<const int4*>(a.ranges) + rlo);
      diag_last = g0.w != 0 && g0.x == k0;
    }
  }

  // query tile i of a head: packed rows q0..qend (QT at most used), held from local row ql. Only
  // the producer walks the ranges; it hands each step's (q0, qend, ql, causal) to the consumers in
  // the stage's shared-memory descriptor, published by its q_full arrival like lse and delta
  // (consumer registers: keeping the first two ranges there made the tma instance spill 28 bytes
  // in the step loop; a global load per step cost 3-5 %, docs/PERF.md "CUDA local queries").
  // The producer's cursor: range cur_r holds the steps cur_base.. of a head's walk. Steps mostly
  // follow one another, so the search resumes there instead of at rlo (each range passed is a
  // dependent L1 load: up to N + 1 per step on a phase-aligned walk over N responses).
  const int4* ranges = reinterpret_cast<const int4*>(a.ranges);
  int cur_r = rlo, cur_base = 0;
  auto query_tile = [&](int i) -> int4 {
    if (i < cur_base) cur_r = rlo, cur_base = 0;
    for (int r = cur_r; r < rhi; ++r) {
      const int4 g = __ldg(ranges + r);
      const int n = (g.y - g.x + QT - 1) / QT;
      if (i < cur_base + n) {
        cur_r = r;
        const int o = i - cur_base;
        return make_int4(g.x + o * QT, g.y, g.z + o * QT, g.w);
      }
      cur_base += n;
    }
    cur_r = rlo, cur_base = 0;
    return make_int4(0, 0, 0, 0);
  };

  // stamps (csrc/cta_trace.h, -DMDKV_CTA_TRACE builds only): 2 K/V in, 3 step 0 done, 4 the last
  // step done, 5 the last dQ reduces written, 6 the end of the epilogue; the count: steps
  MDKV_TRACE_ENTRY(n_iter);
  const int role = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  // deterministic mode: the dQ kernel, a programmatic dependent launch behind this one, may start
  // as soon as every CTA of this grid has started (it reads nothing this kernel writes)
  if constexpr (!kDQ) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    mbar_init(kv_tma, 1);
#pragma unroll
    for (int s = 0; s < kStagesB; ++s) {
      mbar_init(q_full(s), 33);
      mbar_init(empty(s), 8);
    }
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mbar_init(ds_full(b, h), 128);
        mbar_init(ds_empty(b, h), D == 128 ? 8 : 4);
      }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (role == 0) {
    // ------------------------------- producer -------------------------------
    regs_dec<kProducerRegsB>();
    if (warp == 0) {
      if (lane == 0) {
        prefetch_map(&tm_k);
        prefetch_map(&tm_v);
        prefetch_map(&tm_q);
        prefetch_map(&tm_do);
        const uint32_t kv_bar = tail ? kv_tma : kv_full;
        mbar_expect_tx(kv_bar, 2 * kKVB * D * sizeof(T));
#pragma unroll
        for (int p = 0; p < D / 64; ++p) {
          tma_load(smem_addr(sK + p * kKVB * 64), &tm_k, kv_bar, p * 64, hk, k0);
          tma_load(smem_addr(sV + p * kKVB * 64), &tm_v, kv_bar, p * 64, hk, k0);
        }
      }
      if (tail) {
        // the prompt's tail keys over the box's first rows (they held the rows before the
        // response), 16-byte chunks in the box's 128-byte swizzle, visible to the wgmmas (async
        // proxy) before kv_full: the consumers wait for it as for the box alone
        mbar_wait(kv_tma, 0);
        // (K chunks in lanes 0..D/8-1, V chunks in the next D/8; D = 64: two rows per pass. Few live
        // registers: the producer runs under setmaxnreg 24, and a loop over (row, chunk) pairs spilled)
        constexpr int kChunks = D / 8, kRowsPerPass = 32 / (2 * kChunks);
        const int c = lane % kChunks, of_v = (lane / kChunks) & 1;
        const long row_stride = (long)a.hkv * D;
        const T* g = reinterpret_cast<const T*>(of_v ? a.v : a.k) +
                     (long)(tail_dest + lane / (2 * kChunks)) * row_stride + hk * D + c * 8;
        const uint32_t dst = smem_addr(of_v ? sV : sK) + (c >> 3) * kKVB * 128;
#pragma unroll 1
        for (int r = lane / (2 * kChunks); r < tail; r += kRowsPerPass, g += kRowsPerPass * row_stride) {
          const uint4 x = __ldg(reinterpret_cast<const uint4*>(g));
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + r * 128 + (((c & 7) ^ (r & 7)) << 4)),
                       "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                       : "memory");
        }
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) mbar_arrive(kv_full);
      }
      // Phase-aligned walks: the resident CTAs of one kv head all walk the same children (a GRPO
      // group's responses) of the prompt's key tiles. Each head's walk over them starts at the
      // child step another CTA of this kv head published last and goes round, so the CTAs stay on
      // the same query rows however their own (causal) walks and start times differ, and the
      // rows' Q, dO and dQ are read and reduced in L2 while the others still need them. The walk
      // still covers every child step once; only the order (and the dQ sum order) changes.
      int* phase = phase_slot >= 0 ? a.phase + phase_slot * a.hkv + hk : nullptr;
      int n_kid = 0;  // leading child steps of a head's walk
      if (phase)
        for (int r = rlo; r < rhi; ++r) {
          const int4 g = __ldg(ranges + r);
          if (g.w) break;
          n_kid += (g.y - g.x + QT - 1) / QT;
        }
      int kid_base = 0;
      // diag_last: the first heads * (per_head - 1) steps are the heads' walks without their
      // diagonal step (query tile 0), then the `heads` diagonal steps, head by head
      const int per_lead = diag_last ? per_head - 1 : per_head, lead = heads * per_lead;
      for (int i = 0; i < n_iter; ++i) {
        const int st = stage(i);
        if (i >= kStagesB) mbar_wait(empty(st), parity(i) ^ 1);
        int hj = i - lead, j = 0;
        if (i < lead) {
          hj = i / per_lead;
          const int r = i % per_lead;
          // Reversed (a split list, never phase-aligned): the CTAs of one response's rows (the prompt's
          // parts over them, its own key tiles, each starting at a different row) all start at its
          // last query tile and walk down together, so they read and reduce the same rows in L2
          // while the others still need them (cuda_backend's split lists; csrc/ws_l2_model.py).
          // In list order a diag_last walk takes query tiles 1 .. per_head - 1 here.
          j = a.reverse_rows ? per_head - 1 - r : r + (diag_last ? 1 : 0);
        }
        const int h = h0 + hj;
        if (n_kid > 0 && j < n_kid) {
          if (j == 0) {
            int at = 0;
            if (lane == 0) asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(at) : "l"(phase));
            kid_base = (int)((unsigned)__shfl_sync(0xffffffffu, at, 0) % (unsigned)n_kid);
          }
          j += kid_base;
          if (j >= n_kid) j -= n_kid;
          if (lane == 0) asm volatile("st.relaxed.gpu.global.s32 [%0], %1;\n" ::"l"(phase), "r"(j) : "memory");
        }
        const int4 td = query_tile(j);
        const int q0 = td.x, qend = td.y, ql = td.z;
        if (lane == 0) {
          sTd[i % kTdRing] = td;
          mbar_expect_tx(q_full(st), 2 * QT * D * sizeof(T));
#pragma unroll
          for (int p = 0; p < D / 64; ++p) {
            tma_load(smem_addr(sQ + st * QT * D + p * QT * 64), &tm_q, q_full(st), p * 64, h, ql);
            tma_load(smem_addr(sdO + st * QT * D + p * QT * 64), &tm_do, q_full(st), p * 64, h, ql);
          }
        }
        __syncwarp();
#pragma unroll
        for (int r = lane; r < QT; r += 32) {
          const bool ok = q0 + r < qend;
          const long idx = (long)h * a.Tq + (ok ? ql + r : 0);
          // the consumers' exponent offset, ready; -inf past qend masks those query columns for free
          // (p = exp2(-inf) = 0, so dS = 0 too): a partial step needs no per-element mask
          sL[st * QT + r] = ok ? -a.lse[idx] * kLog2e : -INFINITY;
          sDl[st * QT + r] = ok ? a.delta[idx] : 0.f;
        }
        mbar_arrive(q_full(st));
      }
    }
    return;
  }

  // ------------------------------- consumers -------------------------------
  regs_inc<kConsumerRegsB>();
  const int cw = role - 1;
  const int krow_a = k0 + cw * 64 + warp * 16 + (lane >> 2);  // key rows krow_a, krow_a + 8
  const float sl2 = a.scale_log2;
  const bool tile_short = k1 < k0 + kKVB;  // rows k1.. of sK / sV belong to another segment
  const bool dq_issuer = kDQ && kTmaDQ && warp == 0 && lane == 0;  // issues this consumer's dQ reduces
  if (dq_issuer) prefetch_map(&tm_dq);
  // dS^T key halves a consumer's dQ MMA reads: D = 128 all 128 keys for its 64 columns (both
  // halves); D = 64 a partial dQ over its own 64 keys (its own half)
  constexpr int kReadHalves = D == 128 ? 2 : 1;
  auto read_half = [&](int j) { return D == 128 ? j : cw; };
  // kTurns: the consumers issue their MMA groups alternately (consumer 0 first), so one's softmax and
  // dQ stores run under the other's MMAs; named barriers 8 + cw (bar.sync mine, bar.arrive the other's)
  auto turn_take = [&]() {
    if (kTurns) named_sync(8 + cw, 256);
  };
  auto turn_pass = [&](bool last) {  // consumer 1's last section passes nothing on
    if (kTurns && !(last && cw == 1)) named_arrive(8 + (cw ^ 1), 256);
  };

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

  // dQ of a step from dS^T buffer pdS: D = 128: dQ[:, 64 cw : 64 cw + 64] over all 128 keys;
  // D = 64: dQ[:, 0:64] over this consumer's 64 keys (the other consumer adds its own partial sum)
  // Wide steps: dQ^T[64 cw : 64 cw + 64, :] = K^T dS^T over all 128 keys (M = this consumer's 64 dQ
  // columns, N = the QT query rows; A = K's panel cw read M-major, B = dS's key panels K-major).
  auto issue_dq = [&](float(&dq)[QT / 2], const T* pdS) {
    if constexpr (kWide) {
      const uint64_t ka0 = sm90::desc(sK + cw * kKVB * 64, kKVB * 64 * (int)sizeof(T), 1024);
      const uint64_t db0 = sm90::desc(pdS, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < kKVB / 16; ++kk) {
        const uint64_t ka = sm90::desc_plus(ka0, kk * 16 * 64 * (int)sizeof(T));
        const uint64_t db = sm90::desc_plus(db0, ((kk >> 2) * QT * 64 + (kk & 3) * 16) * (int)sizeof(T));
        wgmma_ss_ta<QT, T>(dq, ka, db, kk > 0 ? 1 : 0);
      }
    } else if (D == 128) {
      wgmma_ds_x_k<T, kKVB, kKVB / 16>(dq, pdS, sK + cw * kKVB * 64);
    } else {
      wgmma_ds_x_k<T, kKVB, 4>(dq, pdS, sK, cw * 4);
    }
  };

  // dQ of step i: into this consumer's staging tile (kTmaDQ; reduce_dq adds it to dq_acc later) or
  // straight into dq_acc by atomics. The step's descriptor is read again from the ring (kTdRing
  // slots outlive the lag) rather than kept in registers across the next step.
  auto store_dq = [&](const float(&dq)[QT / 2], int i) {
    const int4 td = sTd[i % kTdRing];
    const int q0 = td.x, qend = td.y;
    if constexpr (kTmaDQ) {
      // staging reuse: the previous reduce has read the tile before any thread stores into it.
      // Warp 0 (whose lane 0 waited) only arrives; warps 1-3 wait for it.
      if (dq_issuer) bulk_wait_read0();
      if (warp == 0)
        named_arrive(6 + cw, 128);
      else
        named_sync(6 + cw, 128);
      float* stg = sStg + cw * QT * 64;
      // rows past qend hold dQ = 0 already (their dS is 0: lse = -inf there), which the box adds
      if constexpr (kWide) {
        // dQ^T fragment (dQ column c = warp * 16 + (lane >> 2) (+ 8), query rows r) -> the same
        // staging tile as below, one float per store: per store the 4 rows r = 8j + 2 (lane & 3) +
        // e and 8 columns fall on 8 distinct 16-byte chunks (no bank conflict)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int c = warp * 16 + (lane >> 2) + hh * 8;
          float* col = stg + (c >> 5) * QT * 32 + (c & 3);
#pragma unroll
          for (int j = 0; j < QT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int r = j * 8 + (lane & 3) * 2 + e;
              col[r * 32 + ((((c & 31) >> 2) ^ (r & 7)) << 2)] = dq[4 * j + 2 * hh + e];
            }
        }
      } else {
        // fragment -> staging tile [half][row][32 floats], 16-byte chunk c of row r at c ^ (r & 7)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = warp * 16 + (lane >> 2) + hh * 8;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int chunk = ((j & 3) * 2 + ((lane & 3) >> 1)) ^ (r & 7);
            float* dst = stg + (j >> 2) * QT * 32 + r * 32 + chunk * 4 + (lane & 1) * 2;
            *reinterpret_cast<float2*>(dst) = make_float2(dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
          }
        }
      }
    } else {
      const int ql = td.z, h = h0 + i / per_head;
      float* acc = a.dq_acc + (long)h * D + (D == 128 ? cw * 64 : 0);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = warp * 16 + (lane >> 2) + hh * 8;
        if (q0 + r < qend) {
          float* rp = acc + (long)(ql + r) * a.hq * D + (lane & 3) * 2;
#pragma unroll
          for (int j = 0; j < 8; ++j)
            atomicAdd(reinterpret_cast<float2*>(rp + j * 8), make_float2(dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]));
        }
      }
    }
  };

  // kTmaDQ: the staged dQ of step i into dq_acc. Deferred until this consumer has issued its next
  // MMA group: the fence waits for the staging stores to land, which they do meanwhile.
  auto reduce_dq = [&](int i) {
    if constexpr (kTmaDQ) {
      const int4 td = sTd[i % kTdRing];
      const int h = h0 + i / per_head;
      float* stg = sStg + cw * QT * 64;
      fence_proxy_async();  // the generic-proxy stores before the TMA (async proxy) reads them
      // the whole tile is stored: only warp 0 (the issuer's) waits; warps 1-3 arrive (release:
      // their fenced stores are visible to the issuer) and go on to their next instructions
      if (warp == 0)
        named_sync(4 + cw, 128);
      else
        named_arrive(4 + cw, 128);
      if (dq_issuer) {
        const int c0 = D == 128 ? cw * 64 : 0;
        tma_reduce_add(&tm_dq, smem_addr(stg), c0, h, td.z);  // local rows ql.. of dq_acc
        tma_reduce_add(&tm_dq, smem_addr(stg + QT * 32), c0 + 32, h, td.z);
        bulk_commit();
      }
    }
  };

  // One query step: S^T, dP^T; P^T, dS^T; dV, dK and (has_prev) the dQ of the previous step. dQ
  // lags one step so that it needs the other consumer's dS^T half of a step both have long
  // finished: the consumers no longer meet at a barrier every step (which kept them in lockstep,
  // their softmax never under an MMA), only wait on the dS^T buffers' mbarriers.
  // P^T in place of S^T and, with_ds, dS^T = P^T (dP^T - delta) in place of dP^T, for a query step
  // of descriptor td whose -lse log2(e) and delta are cL, cD.
  // Key rows k1..k0+127 of a short key tile hold the NEXT segment's keys (TMA loads the whole
  // 128-row box; only rows past T are zero-filled, unlike the sm90 kernel's cp.async loads that
  // zero every row >= k1). Their P^T / dS^T rows must be zeroed here: dK/dV of those rows are
  // never stored, but dQ = dS K contracts over all 128 key rows, so unmasked rows would add the
  // neighbours' keys to dQ (the causal own rows mask them anyway; the child ranges did not).
  // One branch for the whole tile, not one per element (ptxas kept the `if (msk)` inside the
  // unrolled loop: a branch and a compare per element, ~10 % of the stall samples, docs/PERF.md).
  // cL holds -lse * log2(e) (the producer), so p is bitwise what exp2(s sl2 - lse log2 e) was, and
  // -inf for query columns past qend, so p = 0 there without a mask: a partial step (the last of
  // most walks on GRPO shapes) takes the unmasked path. (Those columns are another range's rows:
  // a NaN there would now reach this tile's sums, where the mask kept it out; finite inputs give
  // bitwise the masked path's p and dS.)
  auto probs = [&](float(&s)[QT / 2], float(&dp)[QT / 2], const int4 td, const float* cL, const float* cD,
                   auto with_ds) {
    const int q0 = td.x;
    const bool causal = td.w != 0;
    auto run = [&](auto masked) {
#pragma unroll
      for (int j = 0; j < QT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = j * 8 + (lane & 3) * 2 + (e & 1);  // query column inside the tile
          float p = exp2f(fmaf(s[4 * j + e], sl2, cL[c]));
          if constexpr (decltype(masked)::value) {
            const int qrow = q0 + c;
            const int krow = krow_a + (e >> 1) * 8;
            if (krow >= k1 || (causal && qrow < krow)) p = 0.f;
          }
          s[4 * j + e] = p;
          if constexpr (decltype(with_ds)::value) dp[4 * j + e] = p * (dp[4 * j + e] - cD[c]);
        }
    };
    if ((causal && q0 < k0 + kKVB) || tile_short)
      run(std::true_type{});
    else
      run(std::false_type{});
  };

  auto step = [&](auto has_prev, const int it) {
    constexpr bool kPrev = decltype(has_prev)::value;
    const int st = stage(it), b = it & 1;
    const T* cQ = sQ + st * QT * D;
    const T* cdO = sdO + st * QT * D;
    const float* cL = sL + st * QT;
    const float* cD = sDl + st * QT;
    mbar_wait(q_full(st), parity(it));
    const int4 td = sTd[it % kTdRing];  // written by the producer before its q_full arrival

    float s[QT / 2], dp[QT / 2];
    turn_take();
    wg_fence();
    wgmma_rows_x_rows<T, D, kKVB, QT>(s, sK, cw * 64, cQ);
    wgmma_rows_x_rows<T, D, kKVB, QT>(dp, sV, cw * 64, cdO);
    wg_commit();
    turn_pass(false);
    if (kDQ && it >= 2) reduce_dq(it - 2);  // staged at the end of the previous step
    wg_wait<0>();
    reg_fence(s);
    reg_fence(dp);

    probs(s, dp, td, cL, cD, std::true_type{});

    uint32_t pa[QT / 16][4], da[QT / 16][4];
    pack_frags<T, QT>(pa, s, da, dp);

    // Group B: dV and dK first (registers and the stage only), then, while they run, dS^T into
    // this consumer's half of buffer b (once the dQ MMAs of step it - 2, which read that half, have
    // completed), then dQ of step it - 1 once both halves of buffer b ^ 1 are there. Wide steps
    // hold the turn for dV and dK only and issue the dQ once they have completed: with the dQ
    // accumulators (40) live beside the P^T / dS^T fragments (40) and dK, dV (128), ptxas
    // serializes the wgmmas (C7512).
    float dq[QT / 2];
    turn_take();
    reg_fence(dv);
    reg_fence(dk);
    wg_fence();
    wgmma_regs_x_tile<T, D, QT>(dv, pa, cdO);
    wgmma_regs_x_tile<T, D, QT>(dk, da, cQ);
    if constexpr (kWide) {
      wg_commit();
      turn_pass(false);
    }
    if constexpr (kDQ) {
      T* cdS = sdS + b * kKVB * QT;
      if (it >= 2) mbar_wait(ds_empty(b, cw), ((it - 2) >> 1) & 1);
      if constexpr (kWide)
        store_ds_qk<T, QT>(cdS + cw * QT * 64, warp * 16, lane, da);
      else
        store_ds_t<T, kKVB>(cdS, cw * 64 + warp * 16, lane, da);
      fence_proxy_async();  // before the wgmma (async proxy) of either consumer reads them
      mbar_arrive(ds_full(b, cw));
    }
    if constexpr (kPrev && kDQ) {
#pragma unroll
      for (int j = 0; j < kReadHalves; ++j) mbar_wait(ds_full(b ^ 1, read_half(j)), ((it - 1) >> 1) & 1);
      if constexpr (kWide) {
        wg_wait<0>();
        reg_fence(dv);
        reg_fence(dk);
        // the stage is free once dV / dK completed (the dQ MMA reads K and dS^T only): the producer
        // refills it a dQ MMA sooner (bwd 0.991 on (64, 256, 1024), long shapes level; PERF.md)
        if (lane == 0) mbar_arrive(empty(st));
        wg_fence();
      }
      issue_dq(dq, sdS + (b ^ 1) * kKVB * QT);
    }
    if constexpr (!kWide) {
      wg_commit();
      turn_pass(false);
    } else if constexpr (kPrev && kDQ) {
      wg_commit();
    }
    wg_wait<0>();
    reg_fence(dv);
    reg_fence(dk);
    // Q, dO, lse, delta of this stage are no longer read (wide steps with a dQ: released above)
    if (lane == 0 && !(kWide && kPrev && kDQ)) mbar_arrive(empty(st));
    if constexpr (kPrev && kDQ) {
      reg_fence(dq);
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < kReadHalves; ++j) mbar_arrive(ds_empty(b ^ 1, read_half(j)));
      }
      store_dq(dq, it - 1);
    }
  };

  // the dQ of the last step (nothing else is left to overlap it with)
  auto last_dq = [&](const int it) {
    const int b = it & 1;
#pragma unroll
    for (int j = 0; j < kReadHalves; ++j) mbar_wait(ds_full(b, read_half(j)), (it >> 1) & 1);
    float dq[QT / 2];
    turn_take();
    wg_fence();
    issue_dq(dq, sdS + b * kKVB * QT);
    wg_commit();
    turn_pass(true);
    if (it >= 1) reduce_dq(it - 1);
    wg_wait<0>();
    reg_fence(dq);
    store_dq(dq, it);
    reduce_dq(it);
  };

  // kOverlap: S^T_i and dV, dK of step i - 1 (group B) in one issue section; the consumer waits
  // for S^T_i only and computes P^T_i (the exponentials) while B runs, then issues dP^T_i and
  // computes dS^T_i. The whole of A (S^T and dP^T) beside B, as the forward does, needs dK, dV
  // (128) + P^T, dS^T packed (32) + S^T, dP^T (64) live: ptxas spilled 88 bytes and serialized
  // the wgmmas at head dim 128 (C7512). Here 192 at most. Stage i - 1 is released once B_{i-1}
  // completed. Sections: A_0, then per step S_i + B_{i-1} and dP_i, then B_{n-1}: 2n per
  // consumer (consumer 1 stopping before diag_last's steps takes their two sections empty),
  // consumer 1's last passing nothing on. csrc/ws_pipeline_model.py (run_det_overlap)
  // replays this protocol.
  auto overlapped_walk = [&]() {
    float s[QT / 2], dp[QT / 2];
    uint32_t pa[QT / 16][4], da[QT / 16][4];
    auto issue_s = [&](int it) { wgmma_rows_x_rows<T, D, kKVB, QT>(s, sK, cw * 64, sQ + stage(it) * QT * D); };
    auto issue_dp = [&](int it) { wgmma_rows_x_rows<T, D, kKVB, QT>(dp, sV, cw * 64, sdO + stage(it) * QT * D); };
    auto issue_b = [&](int it) {
      wgmma_regs_x_tile<T, D, QT>(dv, pa, sdO + stage(it) * QT * D);
      wgmma_regs_x_tile<T, D, QT>(dk, da, sQ + stage(it) * QT * D);
    };
    // P^T of step it in place of S^T; dS^T in place of dP^T once dP^T is there (probs' arithmetic)
    auto probs_p = [&](int it) {
      probs(s, dp, sTd[it % kTdRing], sL + stage(it) * QT, sDl + stage(it) * QT, std::false_type{});
    };
    auto probs_ds = [&](int it) {
      const float* cD = sDl + stage(it) * QT;
#pragma unroll
      for (int j = 0; j < QT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - cD[j * 8 + (lane & 3) * 2 + (e & 1)]);
    };
    auto fence_b = [&]() {
      reg_fence(dv);
      reg_fence(dk);
      reg_fence_u(pa);
      reg_fence_u(da);
    };
    // the walk over steps 0 .. n - 1 (n = n_iter, or consumer 1's steps before the diagonal ones)
    auto walk = [&](const int n) {
      mbar_wait(q_full(0), 0);
      turn_take();
      wg_fence();
      issue_s(0);
      issue_dp(0);
      wg_commit();
      turn_pass(false);
      wg_wait<0>();
      reg_fence(s);
      reg_fence(dp);
      probs_p(0);
      probs_ds(0);
      for (int it = 1; it < n; ++it) {
        pack_frags<T, QT>(pa, s, da, dp);  // step it - 1
        mbar_wait(q_full(stage(it)), parity(it));
        turn_take();
        fence_b();
        wg_fence();
        issue_s(it);
        wg_commit();
        issue_b(it - 1);
        wg_commit();
        turn_pass(false);
        wg_wait<1>();  // S^T_it complete, B_{it-1} running
        reg_fence(s);
        probs_p(it);
        wg_wait<0>();
        fence_b();
        if (lane == 0) mbar_arrive(empty(stage(it - 1)));
        turn_take();
        wg_fence();
        issue_dp(it);
        wg_commit();
        turn_pass(false);
        wg_wait<0>();
        reg_fence(dp);
        probs_ds(it);
      }
      pack_frags<T, QT>(pa, s, da, dp);
      turn_take();
      fence_b();
      wg_fence();
      issue_b(n - 1);
      wg_commit();
      turn_pass(n == n_iter);
      wg_wait<0>();
      fence_b();
      if (lane == 0) mbar_arrive(empty(stage(n - 1)));
    };
    // consumer 1 of a diag_last walk stops before the diagonal steps (see diag_last)
    const int n_run = diag_last && cw == 1 ? n_iter - heads : n_iter;
    if (kTurns && cw == 1) named_arrive(8, 256);  // consumer 0 takes the first turn
    if (n_run > 0) walk(n_run);
    for (int it = n_run; it < n_iter; ++it) {
      // a skipped step: its stage released once it holds the step (so that this arrival belongs to
      // the step's phase; the turns alone keep it behind too), both its turns taken empty
      mbar_wait(q_full(stage(it)), parity(it));
      if (lane == 0) mbar_arrive(empty(stage(it)));
      turn_take();
      turn_pass(false);
      turn_take();
      turn_pass(it + 1 == n_iter);
    }
  };

  mbar_wait(kv_full, 0);
  MDKV_TRACE_STAMP(2);
  if (n_iter > 0) {
    if constexpr (kOverlap) {
      overlapped_walk();  // (stamps 3 and 4 after the whole walk)
      MDKV_TRACE_STAMP(3);
      MDKV_TRACE_STAMP(4);
    } else {
      if (kTurns && cw == 1) named_arrive(8, 256);  // consumer 0 takes the first turn
      step(std::false_type{}, 0);
      MDKV_TRACE_STAMP(3);
      for (int it = 1; it < n_iter; ++it) step(std::true_type{}, it);
      MDKV_TRACE_STAMP(4);
      if constexpr (kDQ) last_dq(n_iter - 1);
    }
  }
  if (dq_issuer) bulk_wait0();  // the last reduces have read the staging tile and written dq_acc
  MDKV_TRACE_STAMP(5);

  const long ks = (long)a.hkv * D;
  T* dkg = reinterpret_cast<T*>(a.dk) + hk * D;
  T* dvg = reinterpret_cast<T*>(a.dv) + hk * D;
  // a split part (field 7 > 0) or a head part: its dK/dV meet the other parts' in fp32 slots
  // (fast-mode head parts just below; split parts and deterministic head parts in `split`)
  const BlockMap em = map_block(a, ctaid_x());
  const int split_field = w[7] > 0 ? w[7] : 0;
  // slot s's fp32 sums [2][kKVB][D] of kv head hk
  auto slot_acc = [&](int s) { return a.split_acc + (long)(s * a.hkv + hk) * 2 * kKVB * D; };
  // Fast mode, head parts: the parts' sums meet without atomics. Each part takes a ticket (the
  // order they finish in); all but the last store their raw dK, dV fragments into a slot of their
  // own, thread-major (the last part's thread holds the same fragment positions: 16-byte stores
  // and loads, whole lines, no zero fill), and mark it ready; the last waits until every other
  // part is ready, adds their slots to its registers and stores dK/dV like an unsplit tile. The
  // adds into one zeroed slot (float4 atomics) took ~30k cycles a CTA on 8 groups of
  // (16, 1024, 2048) at 32 / 4, 6 % of the kernel's SM time (docs/PERF.md, thirty-eighth session).
  // pslots = max(head_parts, rest_parts) - 1 slots per item from head_slot_base; the item's
  // counter (split_count at its first slot) counts tickets in bits 0-15, ready parts from bit 16.
  if (kDQ && em.head_parts > 1) {
    const int pslots = max(a.head_parts, a.rest_parts) - 1;
    const int base = a.head_slot_base + em.item * pslots;
    int* const cnt = a.split_count + (long)base * a.hkv + hk;
    const int tid = threadIdx.x - 128;
    auto slot4 = [&](int s) { return reinterpret_cast<float4*>(slot_acc(s)); };
    int* ticket = reinterpret_cast<int*>(sTd);
    named_sync(10, 256);  // both consumers' steps are done: sTd is free
    if (threadIdx.x == 128) *ticket = atomicAdd(cnt, 1) & 0xffff;
    named_sync(10, 256);
    const int t = *ticket;
    const bool last_part = t == em.head_parts - 1;
    if (!last_part) {
      float4* sl = slot4(base + t);
#pragma unroll
      for (int v = 0; v < D / 8; ++v) {
        __stcg(sl + v * 256 + tid, make_float4(dk[4 * v], dk[4 * v + 1], dk[4 * v + 2], dk[4 * v + 3]));
        __stcg(sl + (D / 8 + v) * 256 + tid, make_float4(dv[4 * v], dv[4 * v + 1], dv[4 * v + 2], dv[4 * v + 3]));
      }
      __threadfence();
      named_sync(10, 256);  // every thread's stores are fenced before the part is marked ready
      if (threadIdx.x == 128) atomicAdd(cnt, 1 << 16);
      MDKV_TRACE_END();
      return;
    }
    if (threadIdx.x == 128) {
      int ready;
      do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(ready) : "l"(cnt) : "memory");
        if ((ready >> 16) < t) __nanosleep(64);
      } while ((ready >> 16) < t);
    }
    named_sync(10, 256);
    __threadfence();
    for (int s = 0; s < t; ++s) {
      const float4* sl = slot4(base + s);
#pragma unroll
      for (int v = 0; v < D / 8; ++v) {
        const float4 x = __ldcg(sl + v * 256 + tid), y = __ldcg(sl + (D / 8 + v) * 256 + tid);
        dk[4 * v] += x.x, dk[4 * v + 1] += x.y, dk[4 * v + 2] += x.z, dk[4 * v + 3] += x.w;
        dv[4 * v] += y.x, dv[4 * v + 1] += y.y, dv[4 * v + 2] += y.z, dv[4 * v + 3] += y.w;
      }
    }
  }
  const bool split = (!kDQ && em.head_parts > 1) || split_field > 0;
  // rows k0..slot_end - 1 are the slot's (a split part: all; a prompt tail's response tile: the tail keys)
  const int slot_end = split ? (tail ? k0 + tail : k1) : k0;
  bool last = false;
  if (split) {
    // A key tile split by query rows or a prompt tail's part (and, deterministic, a head part).
    // Fast mode: this part's dK (scaled) and dV added into the slot's fp32 sums [2][kKVB][D] of kv
    // head hk (16-byte atomics: half the requests of float2 adds, 3-4 % faster backward on GRPO
    // shapes). Deterministic: stored into a slot of its own, and the sum is taken over the parts'
    // slots in part order, so it does not depend on which part finishes when. Either way the part
    // that finishes last (a ticket after __threadfence) converts the sums to T.
    const bool head_part = !kDQ && em.head_parts > 1;  // fast mode's head parts met above
    const int slot = head_part ? a.head_slot_base + em.item * max(a.head_parts, a.rest_parts) : split_field >> 20;
    const int part = head_part ? em.head_part : (split_field >> 10) & 1023;
    const int parts = head_part ? em.head_parts : split_field & 1023;
    // deterministic: part p's own sums; a prompt tail's parts (t rows each) packed kKVB / t to a slot
    const int tail_rows = w[8] < 0 ? -w[8] : w[8];
    auto part_acc = [&](int p) {
      if (kDQ) return slot_acc(slot);
      if (!tail_rows) return slot_acc(slot + p);
      const int per_slot = kKVB / tail_rows;
      return slot_acc(slot + p / per_slot) + (long)(p % per_slot) * tail_rows * D;
    };
    float* acc = part_acc(part);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = krow_a + r * 8;
      if constexpr (kDQ) {
        red_frag_row_x4<D>(acc, D, row - k0, lane, dk, r, a.scale, row < slot_end);
        red_frag_row_x4<D>(acc + kKVB * D, D, row - k0, lane, dv, r, 1.f, row < slot_end);
      } else if (row < slot_end) {
        float* pk = acc + (long)(row - k0) * D + (lane & 3) * 2;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          __stcg(reinterpret_cast<float2*>(pk + j * 8), make_float2(dk[4 * j + 2 * r] * a.scale, dk[4 * j + 2 * r + 1] * a.scale));
          __stcg(reinterpret_cast<float2*>(pk + kKVB * D + j * 8), make_float2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]));
        }
      }
    }
    __threadfence();
    named_sync(10, 256);  // both consumers' adds are issued and fenced (and their steps done: sTd is free)
    int* ticket = reinterpret_cast<int*>(sTd);
    if (threadIdx.x == 128) *ticket = atomicAdd(a.split_count + slot * a.hkv + hk, 1) == parts - 1;
    named_sync(10, 256);
    last = *ticket;
    if (last) {
      __threadfence();
      // the group's sums into this thread's fragment positions, stored below like an unsplit tile's
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = krow_a + r * 8;
        if (row >= slot_end) continue;
        for (int p = 0; p < (kDQ ? 1 : parts); ++p) {  // fast mode: the one slot; else in part order
          const float* pk = part_acc(p) + (long)(row - k0) * D + (lane & 3) * 2;
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            const float2 sk = __ldcg(reinterpret_cast<const float2*>(pk + j * 8));
            const float2 sv = __ldcg(reinterpret_cast<const float2*>(pk + kKVB * D + j * 8));
            dk[4 * j + 2 * r] = p == 0 ? sk.x : dk[4 * j + 2 * r] + sk.x;
            dk[4 * j + 2 * r + 1] = p == 0 ? sk.y : dk[4 * j + 2 * r + 1] + sk.y;
            dv[4 * j + 2 * r] = p == 0 ? sv.x : dv[4 * j + 2 * r] + sv.x;
            dv[4 * j + 2 * r + 1] = p == 0 ? sv.y : dv[4 * j + 2 * r + 1] + sv.y;
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = krow_a + r * 8;
    // a slot's rows: stored by its last part only, at tail_dest.., the sums holding dK scaled already
    const bool slot_row = row < slot_end;
    const int dest = slot_row ? tail_dest + (row - k0) : row;
    const float dk_scale = slot_row ? 1.f : a.scale;
    const bool store = row < k1 && (!slot_row || last);
    // 16-byte stores (a warp's store 8 rows x 64 bytes, not x 16): the short CTAs of GRPO shapes end
    // 1-4 % sooner (docs/PERF.md, twenty-second session)
    store_frag_row_x4<T, D>(dkg, ks, dest, lane, dk, r, dk_scale, store);
    store_frag_row_x4<T, D>(dvg, ks, dest, lane, dv, r, 1.f, store);
  }
  MDKV_TRACE_END();
}

// dq_acc fp32 [Tq, hq, D] as (D, hq, Tq); box = 32 columns (128 B, the swizzle span) x 1 head x qt rows
static bool make_dq_map(CUtensorMap* map, float* dq_acc, int d, int hq, int Tq, int qt) {
  auto fn = encode_tiled();
  if (!fn) return false;
  const cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)hq, (cuuint64_t)Tq};
  const cuuint64_t strides[2] = {(cuuint64_t)d * sizeof(float), (cuuint64_t)hq * d * sizeof(float)};
  const cuuint32_t box[3] = {32, 1, (cuuint32_t)qt};
  const cuuint32_t estr[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, dq_acc, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90ws

int det_overlap_from_env() { return env_choice("MEGATRON_DUALKV_DET_OVERLAP", {{"1", 1}, {"0", 0}}); }

int det_skip_from_env() { return env_choice("MEGATRON_DUALKV_DET_SKIP", {{"1", 1}, {"0", 0}}); }

namespace sm90ws {

template <typename T, int D, bool kTmaDQ, int QT>
static cudaError_t bwd_ws_t(const DeltaArgs& da, const DkvArgs& ka, int dtype, CUtensorMapDataType dt,
                            cudaStream_t stream, bool delta_done) {
  using L = BwdSmem<T, D, kTmaDQ, QT>;
  // no dq_acc: dK and dV only (the deterministic mode; its dQ is a dQ kernel's), on the
  // TMA-dQ instance's shared-memory layout
  const bool with_dq = ka.dq_acc != nullptr;
  if (!kTmaDQ && !with_dq) return cudaErrorInvalidValue;
  cudaError_t e = delta_done ? cudaSuccess : launch_delta(da, dtype, D, stream);
  if (e != cudaSuccess) return e;
  // MEGATRON_DUALKV_WS_BWD_TURNS=0: consumers without turns (an A/B switch, like the forward's
  // MEGATRON_DUALKV_WS_PINGPONG)
  const char* turns = std::getenv("MEGATRON_DUALKV_WS_BWD_TURNS");
  auto k = (turns && std::atoi(turns) == 0) ? dkdv_ws_kernel<T, D, kTmaDQ, false, QT, true>
                                            : dkdv_ws_kernel<T, D, kTmaDQ, true, QT, true>;
  if constexpr (kTmaDQ) {
    if (!with_dq) k = dkdv_ws_kernel<T, D, true, true, QT, false>;
    if constexpr (QT == 64)
      if (!with_dq && det_overlap_from_env() == 1) k = dkdv_ws_kernel<T, D, true, true, 64, false, true>;
  }
  e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (e != cudaSuccess) return e;
  if (ka.num_items == 0 || ka.T == 0 || ka.Tq == 0) return cudaSuccess;
  CUtensorMap mk, mv, mq, mdo, mdq = {};  // mdq: read only by the kTmaDQ kernel
  const int es = (int)sizeof(T);
  if (!make_map(&mk, ka.k, dt, D, ka.hkv, ka.T, kKVB, es) || !make_map(&mv, ka.v, dt, D, ka.hkv, ka.T, kKVB, es) ||
      !make_map(&mq, ka.q, dt, D, ka.hq, ka.Tq, QT, es) || !make_map(&mdo, ka.dout, dt, D, ka.hq, ka.Tq, QT, es) ||
      (kTmaDQ && with_dq && !make_dq_map(&mdq, ka.dq_acc, D, ka.hq, ka.Tq, QT)))
    return cudaErrorInvalidResourceHandle;
  MDKV_TRACE_SET_BUFFER("MDKV_CTA_TRACE_BWD", stream);
  // (head parts: the long items' CTAs head_parts times, the others' rest_parts times)
  const long blocks = ((long)ka.long_items * ka.head_parts + (long)(ka.num_items - ka.long_items) * ka.rest_parts) * ka.hkv;
  k<<<(unsigned)blocks, kThreadsB, L::kBytes, stream>>>(mk, mv, mq, mdo, mdq, ka);
  return cudaGetLastError();
}

template <typename T, int D>
static cudaError_t bwd_ws_mode(const DeltaArgs& da, const DkvArgs& ka, int dtype, CUtensorMapDataType dt,
                               cudaStream_t stream, bool delta_done) {
  const int mode = ws_dq_mode_from_env();
  const int qt = ws_bwd_query_tile_from_env();
  const int overlap = ka.dq_acc == nullptr ? det_overlap_from_env() : 0;
  // the op checks the variables first, with a clear message
  if (mode < 0 || qt < 0 || overlap < 0) return cudaErrorInvalidValue;
  if (mode == 0 && ka.dq_acc != nullptr) return bwd_ws_t<T, D, false, 64>(da, ka, dtype, dt, stream, delta_done);
  // the overlapped deterministic dK/dV kernel steps by 64 query rows (registers)
  if (overlap == 1) return bwd_ws_t<T, D, true, 64>(da, ka, dtype, dt, stream, delta_done);
  if constexpr (D == 128)
    if (qt == kWideQT) return bwd_ws_t<T, D, true, kWideQT>(da, ka, dtype, dt, stream, delta_done);
  return bwd_ws_t<T, D, true, 64>(da, ka, dtype, dt, stream, delta_done);
}

}  // namespace sm90ws

int ws_dq_mode_from_env() {
  // default tma: 8-18 % faster backward on the published shapes (H100, docs/PERF.md)
  return env_choice("MEGATRON_DUALKV_WS_DQ", {{"tma", 1}, {"atomic", 0}});
}

int ws_reverse_rows_from_env() {
  // default: reversed where the list is split (split_slots > 0), as DkvArgs::reverse_rows says
  return env_choice("MEGATRON_DUALKV_WS_REVERSE_ROWS", {{"auto", 1}, {"0", 0}});
}

int ws_bwd_query_tile_from_env() {
  // query rows per step of the ws backward at head dim 128 (64 always at head dim 64 and with
  // MEGATRON_DUALKV_WS_DQ=atomic); default 80 (sm90ws::kWideQT): 5-10 % faster backward on the
  // published shapes (H100, docs/PERF.md "Seventh session")
  return env_choice("MEGATRON_DUALKV_WS_BWD_QTILE", {{"80", sm90ws::kWideQT}, {"64", 64}});
}

cudaError_t launch_bwd_ws_sm90(const DeltaArgs& da, const DkvArgs& ka, int dtype, int d, cudaStream_t stream,
                               bool delta_done) {
  constexpr auto bf = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, hf = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  if (dtype == kBF16 && d == 128) return sm90ws::bwd_ws_mode<__nv_bfloat16, 128>(da, ka, dtype, bf, stream, delta_done);
  if (dtype == kBF16 && d == 64) return sm90ws::bwd_ws_mode<__nv_bfloat16, 64>(da, ka, dtype, bf, stream, delta_done);
  if (dtype == kFP16 && d == 128) return sm90ws::bwd_ws_mode<__half, 128>(da, ka, dtype, hf, stream, delta_done);
  if (dtype == kFP16 && d == 64) return sm90ws::bwd_ws_mode<__half, 64>(da, ka, dtype, hf, stream, delta_done);
  return cudaErrorInvalidValue;
}

}  // namespace mdkv
