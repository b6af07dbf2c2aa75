// Torch ops of the warp-specialized Hopper kernels (csrc/dualkv_fwd_ws_sm90.cu,
// csrc/dualkv_bwd_ws_sm90.cu), added to the `megatron_dualkv` library defined in
// csrc/dualkv_ops.cpp:
//
//   megatron_dualkv::fwd_ws_sm90(q, k, v, row_work, scale) -> (out [Tq,Hq,D], lse [Hq,Tq] fp32)
//   megatron_dualkv::bwd_ws_sm90(dout, q, k, v, out, lse, dlse?, row_work, kv_work, kv_ranges, scale,
//                                deterministic) -> (dq, dk, dv)      (fast mode only)
//
// q (and dout, out, lse) hold Tq rows, k and v T rows: Tq = T for the whole micro-batch, fewer for
// local queries (a context-parallel rank's rows against gathered K/V). Row items (128-row query
// tiles) carry the local row of their first query in field 6; the backward's kv items and
// ranges (4 int32: a, b, loc, causal) are those of cuda_backend.ws_kv_work. The work lists come
// from megatron_dualkv/ops/cuda_backend.py, which also registers the fake implementations.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "dualkv_fwd_ws.h"

namespace {

void check_ws_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "megatron_dualkv: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "megatron_dualkv: q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "megatron_dualkv: dtype must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "megatron_dualkv: q, k, v must share one dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "megatron_dualkv: head dim must be 64 or 128, got ", d);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d, "megatron_dualkv: k and v must be [T, Hkv, ", d, "]");
  TORCH_CHECK(q.size(0) > 0 && q.size(0) <= k.size(0), "megatron_dualkv: q holds ", q.size(0),
              " rows; it must hold 1 to T = ", k.size(0), " (all or a context-parallel rank's queries)");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "megatron_dualkv: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "megatron_dualkv: q, k, v must be contiguous [T, H, D]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "megatron_dualkv: the ws kernels read q, k, v with TMA, which needs 16-byte aligned data pointers");
}

void check_work_ws(const at::Tensor& w, const at::Tensor& q, const char* what) {
  TORCH_CHECK(w.is_cuda() && w.device() == q.device() && w.scalar_type() == at::kInt && w.is_contiguous() &&
                  w.dim() == 2,
              "megatron_dualkv: ", what, " must be a contiguous 2-D int32 tensor on q's device");
}

std::tuple<at::Tensor, at::Tensor> dualkv_fwd_ws_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& row_work, double scale) {
  check_ws_inputs(q, k, v);
  TORCH_CHECK(row_work.is_cuda() && row_work.device() == q.device() && row_work.scalar_type() == at::kInt &&
                  row_work.is_contiguous() && row_work.dim() == 2 && row_work.size(1) == 8,
              "megatron_dualkv: row_work must be a contiguous int32 [items, 8] tensor on q's device");
  c10::cuda::CUDAGuard guard(q.device());
  const int T = k.size(0), Tq = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  auto out = at::empty_like(q);
  auto lse = at::empty({hq, Tq}, q.options().dtype(at::kFloat));
  mdkv::FwdArgs a;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.work = row_work.data_ptr<int>();
  a.num_items = row_work.size(0);
  a.T = T;
  a.Tq = Tq;
  a.hq = hq;
  a.hkv = hkv;
  a.scale = static_cast<float>(scale);
  a.scale_log2 = static_cast<float>(scale * M_LOG2E);
  const int dtype = q.scalar_type() == at::kBFloat16 ? mdkv::kBF16 : mdkv::kFP16;
  auto err = mdkv::launch_fwd_ws_sm90(a, dtype, d, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "megatron_dualkv fwd_ws_sm90 launch failed: ", cudaGetErrorString(err),
              err == cudaErrorInvalidResourceHandle ? " (TMA tensor map could not be encoded)" : "");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dualkv_bwd_ws_sm90(
    const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& dlse_in, const at::Tensor& row_work,
    const at::Tensor& kv_work, const at::Tensor& kv_ranges, double scale, bool deterministic) {
  TORCH_CHECK(!deterministic,
              "megatron_dualkv: the ws backward has no deterministic mode (dQ by atomics); use bwd_sm90 for it");
  check_ws_inputs(q, k, v);
  TORCH_CHECK(mdkv::ws_dq_mode_from_env() >= 0, "megatron_dualkv: MEGATRON_DUALKV_WS_DQ must be 'atomic' or 'tma', got '",
              std::getenv("MEGATRON_DUALKV_WS_DQ"), "'");
  check_work_ws(kv_work, q, "kv_work");
  check_work_ws(kv_ranges, q, "kv_ranges");
  TORCH_CHECK(kv_work.size(1) == 8 && kv_ranges.size(1) == 4,
              "megatron_dualkv: kv_work must be [items, 8], kv_ranges [n, 4] (cuda_backend.ws_kv_work)");
  (void)row_work;  // the ws backward walks key tiles only; the argument keeps bwd_sm90's signature
  auto dout = dout_in.contiguous();
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type(),
              "megatron_dualkv: grad of out must match q's shape and dtype");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 == 0,
              "megatron_dualkv: the ws backward reads dout with TMA, which needs a 16-byte aligned data pointer");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "megatron_dualkv: out must be contiguous like q");
  const int T = k.size(0), Tq = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == hq &&
                  lse.size(1) == Tq,
              "megatron_dualkv: lse must be contiguous float32 [Hq, Tq]");
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) {
    dlse = dlse_in->to(at::kFloat).contiguous();
    TORCH_CHECK(dlse.sizes() == lse.sizes(), "megatron_dualkv: grad of lse must be [Hq, Tq]");
  }
  c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  auto delta = at::empty({hq, Tq}, q.options().dtype(at::kFloat));
  auto dq_acc = at::zeros({Tq, hq, d}, q.options().dtype(at::kFloat));
  mdkv::DeltaArgs da;
  da.out = out.data_ptr();
  da.dout = dout.data_ptr();
  da.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  da.delta = delta.data_ptr<float>();
  da.T = Tq;  // delta is per query row
  da.hq = hq;
  mdkv::DkvArgs ka;
  ka.q = q.data_ptr();
  ka.k = k.data_ptr();
  ka.v = v.data_ptr();
  ka.dout = dout.data_ptr();
  ka.lse = lse.data_ptr<float>();
  ka.delta = delta.data_ptr<float>();
  ka.dk = dk.data_ptr();
  ka.dv = dv.data_ptr();
  ka.work = kv_work.data_ptr<int>();
  ka.ranges = kv_ranges.data_ptr<int>();
  ka.dq_acc = dq_acc.data_ptr<float>();
  ka.num_items = kv_work.size(0);
  ka.T = T;
  ka.Tq = Tq;
  ka.hq = hq;
  ka.hkv = hkv;
  ka.scale = static_cast<float>(scale);
  ka.scale_log2 = static_cast<float>(scale * M_LOG2E);
  const int dtype = q.scalar_type() == at::kBFloat16 ? mdkv::kBF16 : mdkv::kFP16;
  auto err = mdkv::launch_bwd_ws_sm90(da, ka, dtype, d, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "megatron_dualkv bwd_ws_sm90 launch failed: ", cudaGetErrorString(err),
              err == cudaErrorInvalidResourceHandle ? " (TMA tensor map could not be encoded)" : "");
  dq.copy_(dq_acc.mul_(scale));
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_dualkv, m) {
  m.def("fwd_ws_sm90(Tensor q, Tensor k, Tensor v, Tensor row_work, float scale) -> (Tensor, Tensor)");
  m.def(
      "bwd_ws_sm90(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor row_work, "
      "Tensor kv_work, Tensor kv_ranges, float scale, bool deterministic) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_dualkv, CUDA, m) {
  m.impl("fwd_ws_sm90", &dualkv_fwd_ws_sm90);
  m.impl("bwd_ws_sm90", &dualkv_bwd_ws_sm90);
}
