// Torch op registration for the DualKV kernels: namespace `megatron_dualkv`.
//
//   megatron_dualkv::fwd(q, k, v, row_work, scale) -> (out [T,Hq,D], lse [Hq,T] fp32)   (mma.sync)
//   megatron_dualkv::fwd_sm90(...)  same, Hopper wgmma kernel (row items of 128-row tiles)
//   megatron_dualkv::bwd(dout, q, k, v, out, lse, dlse?, row_work, kv_work, kv_ranges, scale,
//                        deterministic) -> (dq, dk, dv)
//
// Work lists are int32 device tensors built by megatron_dualkv/ops/cuda_backend.py (once per
// layout). Fake (meta) implementations and autograd are registered in Python.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdlib>

#include "dualkv_kernels.h"

namespace {

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "megatron_dualkv: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "megatron_dualkv: q, k, v must be [tokens, heads, head_dim], got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "megatron_dualkv: dtype must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "megatron_dualkv: q, k, v must share one dtype");
  const auto d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "megatron_dualkv: head dim must be 64 or 128, got ", d);
  TORCH_CHECK(k.size(2) == d && v.size(2) == d && k.sizes() == v.sizes(), "megatron_dualkv: k and v must be [T, Hkv, ",
              d, "]");
  TORCH_CHECK(k.size(0) == q.size(0), "megatron_dualkv: q and k/v token counts differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "megatron_dualkv: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "megatron_dualkv: q, k, v must be contiguous [T, H, D]");
}

void check_work(const at::Tensor& w, const at::Tensor& q, const char* what) {
  TORCH_CHECK(w.is_cuda() && w.device() == q.device(), "megatron_dualkv: ", what, " must be on q's device");
  TORCH_CHECK(w.scalar_type() == at::kInt && w.is_contiguous(), "megatron_dualkv: ", what, " must be contiguous int32");
}

int dtype_code(const at::Tensor& q) { return q.scalar_type() == at::kBFloat16 ? mdkv::kBF16 : mdkv::kFP16; }

std::tuple<at::Tensor, at::Tensor> fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& row_work, double scale, bool sm90) {
  check_qkv(q, k, v);
  check_work(row_work, q, "row_work");
  TORCH_CHECK(row_work.dim() == 2 && row_work.size(1) == 8, "megatron_dualkv: row_work must be [items, 8]");
  c10::cuda::CUDAGuard guard(q.device());
  const int T = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  auto out = at::empty_like(q);
  auto lse = at::empty({hq, T}, q.options().dtype(at::kFloat));
  mdkv::FwdArgs a;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.work = row_work.data_ptr<int>();
  a.num_items = row_work.size(0);
  a.T = T;
  a.Tq = T;
  a.hq = hq;
  a.hkv = hkv;
  a.scale = static_cast<float>(scale);
  a.scale_log2 = static_cast<float>(scale * M_LOG2E);
  auto stream = at::cuda::getCurrentCUDAStream();
  // MEGATRON_DUALKV_SM90_FWD_VARIANT: 1 (default) 64-row key tiles, two CTAs per SM (measured
  // 385-419 TFLOP/s); 0: 128-row key tiles, one CTA per SM (353-375)
  const char* venv = std::getenv("MEGATRON_DUALKV_SM90_FWD_VARIANT");
  const int variant = venv ? std::atoi(venv) : 1;
  auto err = sm90 ? mdkv::launch_fwd_sm90(a, dtype_code(q), d, stream, variant)
                  : mdkv::launch_fwd(a, dtype_code(q), d, stream);
  TORCH_CHECK(err == cudaSuccess, "megatron_dualkv fwd launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

// mma.sync kernel (sm_80 style), row items of 64-row query tiles
std::tuple<at::Tensor, at::Tensor> dualkv_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& row_work, double scale) {
  return fwd_impl(q, k, v, row_work, scale, false);
}

// Hopper wgmma kernel, row items of 128-row query tiles
std::tuple<at::Tensor, at::Tensor> dualkv_fwd_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& row_work, double scale) {
  return fwd_impl(q, k, v, row_work, scale, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_impl(const at::Tensor& dout_in, const at::Tensor& q,
                                                          const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& out, const at::Tensor& lse,
                                                          const std::optional<at::Tensor>& dlse_in,
                                                          const at::Tensor& row_work, const at::Tensor& kv_work,
                                                          const at::Tensor& kv_ranges, double scale,
                                                          bool deterministic, bool sm90) {
  // deterministic=True (and every mma.sync path): dQ by its own kernel, every output accumulated
  // by one CTA in a fixed order: bitwise reproducible. deterministic=False on sm90: dQ accumulated
  // in fp32 by the dK/dV kernel with atomics (summation order varies from run to run).
  check_qkv(q, k, v);
  check_work(row_work, q, "row_work");
  check_work(kv_work, q, "kv_work");
  check_work(kv_ranges, q, "kv_ranges");
  auto dout = dout_in.contiguous();
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type(),
              "megatron_dualkv: grad of out must match q's shape and dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "megatron_dualkv: out must be contiguous like q");
  const int T = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == hq &&
                  lse.size(1) == T,
              "megatron_dualkv: lse must be contiguous float32 [Hq, T]");
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) {
    dlse = dlse_in->to(at::kFloat).contiguous();
    TORCH_CHECK(dlse.sizes() == lse.sizes(), "megatron_dualkv: grad of lse must be [Hq, T]");
  }
  c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  auto delta = at::empty({hq, T}, q.options().dtype(at::kFloat));
  const float sc = static_cast<float>(scale), sl2 = static_cast<float>(scale * M_LOG2E);

  mdkv::DeltaArgs da;
  da.out = out.data_ptr();
  da.dout = dout.data_ptr();
  da.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  da.delta = delta.data_ptr<float>();
  da.T = T;
  da.hq = hq;

  mdkv::DqArgs qa;
  qa.q = q.data_ptr();
  qa.k = k.data_ptr();
  qa.v = v.data_ptr();
  qa.dout = dout.data_ptr();
  qa.lse = lse.data_ptr<float>();
  qa.delta = delta.data_ptr<float>();
  qa.dq = dq.data_ptr();
  qa.work = row_work.data_ptr<int>();
  qa.num_items = row_work.size(0);
  qa.T = T;
  qa.hq = hq;
  qa.hkv = hkv;
  qa.scale = sc;
  qa.scale_log2 = sl2;

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
  at::Tensor dq_acc;
  // Fast mode (deterministic=False) on sm90: dQ by fp32 atomics inside the dK/dV kernel, measured
  // 3-9% faster fwd+bwd than the dQ kernel on the published shapes (H100); MEGATRON_DUALKV_ATOMIC_DQ=0
  // turns it off. Workspace: fp32 [T, Hq, D].
  const char* aenv = std::getenv("MEGATRON_DUALKV_ATOMIC_DQ");
  const bool atomic_dq = sm90 && !deterministic && !(aenv && std::atoi(aenv) == 0);
  if (atomic_dq) dq_acc = at::zeros({T, hq, d}, q.options().dtype(at::kFloat));
  ka.dq_acc = dq_acc.defined() ? dq_acc.data_ptr<float>() : nullptr;
  ka.num_items = kv_work.size(0);
  ka.T = T;
  ka.Tq = T;
  ka.hq = hq;
  ka.hkv = hkv;
  ka.scale = sc;
  ka.scale_log2 = sl2;

  auto stream = at::cuda::getCurrentCUDAStream();
  auto err = sm90 ? mdkv::launch_bwd_sm90(da, qa, ka, dtype_code(q), d, stream)
                  : mdkv::launch_bwd(da, qa, ka, dtype_code(q), d, stream);
  TORCH_CHECK(err == cudaSuccess, "megatron_dualkv bwd launch failed: ", cudaGetErrorString(err));
  if (dq_acc.defined()) dq.copy_(dq_acc.mul_(sc));
  return {dq, dk, dv};
}

#define MDKV_BWD_ARGS                                                                                          \
  const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out, \
      const at::Tensor &lse, const std::optional<at::Tensor> &dlse, const at::Tensor &row_work,               \
      const at::Tensor &kv_work, const at::Tensor &kv_ranges, double scale, bool deterministic

// mma.sync kernels: row items of 64-row query tiles, kv items of 64-row key tiles
std::tuple<at::Tensor, at::Tensor, at::Tensor> dualkv_bwd(MDKV_BWD_ARGS) {
  return bwd_impl(dout, q, k, v, out, lse, dlse, row_work, kv_work, kv_ranges, scale, deterministic, false);
}

// Hopper wgmma kernels: row items of 128-row query tiles, kv items of 128-row key tiles
std::tuple<at::Tensor, at::Tensor, at::Tensor> dualkv_bwd_sm90(MDKV_BWD_ARGS) {
  return bwd_impl(dout, q, k, v, out, lse, dlse, row_work, kv_work, kv_ranges, scale, deterministic, true);
}

}  // namespace

TORCH_LIBRARY(megatron_dualkv, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor row_work, float scale) -> (Tensor, Tensor)");
  m.def("fwd_sm90(Tensor q, Tensor k, Tensor v, Tensor row_work, float scale) -> (Tensor, Tensor)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor row_work, "
      "Tensor kv_work, Tensor kv_ranges, float scale, bool deterministic) -> (Tensor, Tensor, Tensor)");
  m.def(
      "bwd_sm90(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor row_work, "
      "Tensor kv_work, Tensor kv_ranges, float scale, bool deterministic) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_dualkv, CUDA, m) {
  m.impl("fwd", &dualkv_fwd);
  m.impl("fwd_sm90", &dualkv_fwd_sm90);
  m.impl("bwd", &dualkv_bwd);
  m.impl("bwd_sm90", &dualkv_bwd_sm90);
}

// Importable as megatron_dualkv._C (importing it registers the ops above).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "DualKV fused attention kernels (torch ops megatron_dualkv::*)"; }
