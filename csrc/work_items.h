// The kernels' work items decoded on the device (the int32 format is described at the top of
// dualkv_kernels.cu; the tile size is the kernel's own).
#pragma once
#include <cuda_runtime.h>

namespace mdkv {

// Row item (forward, dQ): query rows [q0, q1) of a segment that starts at self0 and whose parent
// is [par0, par1). Key tiles of kRows rows: the parent's n_par tiles, then the segment's own
// (causal) up to q1.
template <int kRows>
struct RowItem {
  int q0, q1, self0, par0, par1, n_par, n_total;
  __device__ __forceinline__ explicit RowItem(const int* w)
      : q0(w[0]), q1(w[1]), self0(w[2]), par0(w[3]), par1(w[4]), n_par((par1 - par0 + kRows - 1) / kRows),
        n_total(n_par + (q1 - self0 + kRows - 1) / kRows) {}
  __device__ __forceinline__ int kv_start(int t) const {
    return t < n_par ? par0 + t * kRows : self0 + (t - n_par) * kRows;
  }
  __device__ __forceinline__ int kv_end(int t) const { return t < n_par ? par1 : q1; }
  // does tile t need masking: the parent's tail, or a causal tile reaching past the first query row
  __device__ __forceinline__ bool needs_mask(int t) const {
    const int k0 = kv_start(t);
    return t < n_par ? (k0 + kRows > par1) : (k0 + kRows - 1 > q0);
  }
  __device__ __forceinline__ bool allowed(int t, int row, int col) const {
    return t < n_par ? (col < par1) : (col <= row);
  }
};

// Query tile i of the child ranges r_begin .. r_end - 1 of a kv item (2 int32 per range: query
// rows [a, b) that attend the key tile in full), in tiles of kRows rows: rows [q0, q0 + kRows),
// valid below qend.
template <int kRows>
__device__ __forceinline__ void child_query_tile(const int* ranges, int r_begin, int r_end, int i, int& q0,
                                                 int& qend) {
  for (int r = r_begin; r < r_end; ++r) {
    const int ra = ranges[2 * r], rb = ranges[2 * r + 1];
    const int n = (rb - ra + kRows - 1) / kRows;
    if (i < n) {
      q0 = ra + i * kRows;
      qend = rb;
      return;
    }
    i -= n;
  }
  q0 = 0;  // unreachable for a consistent work list
  qend = 0;
}

// Kv item (dK/dV): key rows [k0, k1) of a segment that ends at seg_end, and per query head the
// per_head query tiles of kRows rows that attend them: the segment's own rows from k0 on (n_own
// tiles, causal), then the child ranges rlo .. rhi - 1 of `ranges` in full.
template <int kRows>
struct KvItem {
  int k0, k1, seg_end, rlo, rhi, per_head, n_own;
  const int* ranges;
  __device__ __forceinline__ KvItem(const int* w, const int* rg)
      : k0(w[0]), k1(w[1]), seg_end(w[2]), rlo(w[3]), rhi(w[4]), per_head(w[5]),
        n_own((seg_end - k0 + kRows - 1) / kRows), ranges(rg) {}
  // query tile i (0 <= i < per_head) -> rows [q0, q0 + kRows), valid below qend, causal or not
  __device__ __forceinline__ void query_tile(int i, int& q0, int& qend, bool& causal) const {
    if (i < n_own) {
      q0 = k0 + i * kRows;
      qend = seg_end;
      causal = true;
      return;
    }
    causal = false;
    child_query_tile<kRows>(ranges, rlo, rhi, i - n_own, q0, qend);
  }
};

}  // namespace mdkv
