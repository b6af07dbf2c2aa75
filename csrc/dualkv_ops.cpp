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

#include <cstdlib>

#include "dualkv_kernels.h"
#include "dualkv_op_args.h"
#include "ops_namespace.h"

namespace {

using namespace mdkv::op_args;

// q, k, v of the whole micro-batch: T query rows against T key rows
void check_qkv_same_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_qkv(q, k, v);
  TORCH_CHECK(k.size(0) == q.size(0), "megatron_dualkv: q and k/v token counts differ");
}

std::tuple<at::Tensor, at::Tensor> fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& row_work, double scale, bool sm90) {
  check_qkv_same_rows(q, k, v);
  check_work(row_work, q, "row_work", 8);
  c10::cuda::CUDAGuard guard(q.device());
  const FwdCall c = fwd_call(q, k, v, row_work, scale);
  auto stream = at::cuda::getCurrentCUDAStream();
  // MEGATRON_DUALKV_SM90_FWD_VARIANT: 1 (default) 64-row key tiles, two CTAs per SM (measured
  // 385-419 TFLOP/s); 0: 128-row key tiles, one CTA per SM (353-375)
  const char* venv = std::getenv("MEGATRON_DUALKV_SM90_FWD_VARIANT");
  const int variant = venv ? std::atoi(venv) : 1;
  const int d = q.size(2);
  auto err = sm90 ? mdkv::launch_fwd_sm90(c.args, dtype_code(q), d, stream, variant)
                  : mdkv::launch_fwd(c.args, dtype_code(q), d, stream);
  check_launch(err, sm90 ? "fwd_sm90" : "fwd", false);
  return {c.out, c.lse};
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
  check_qkv_same_rows(q, k, v);
  check_work(row_work, q, "row_work", 8);
  check_work(kv_work, q, "kv_work", 8);
  check_work(kv_ranges, q, "kv_ranges", 2);  // [q0, q1] (cuda_backend.kv_items)
  const BwdInputs in = check_bwd_inputs(dout_in, q, out, lse, dlse_in, "T");
  c10::cuda::CUDAGuard guard(q.device());
  const int T = q.size(0), hq = q.size(1), d = q.size(2);
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  auto delta = per_head_row_floats(q);
  // Fast mode (deterministic=False) on sm90: dQ by fp32 atomics inside the dK/dV kernel, measured
  // 3-9% faster fwd+bwd than the dQ kernel on the published shapes (H100); MEGATRON_DUALKV_ATOMIC_DQ=0
  // turns it off. Workspace: fp32 [T, Hq, D].
  const char* aenv = std::getenv("MEGATRON_DUALKV_ATOMIC_DQ");
  const bool atomic_dq = sm90 && !deterministic && !(aenv && std::atoi(aenv) == 0);
  if (sm90 && !atomic_dq) check_dq_key_tile_env();
  at::Tensor dq_acc;
  if (atomic_dq) dq_acc = at::zeros({T, hq, d}, q.options().dtype(at::kFloat));
  const mdkv::DeltaArgs da = delta_args(out, in.dout, in.dlse, delta);
  const mdkv::DqArgs qa = dq_args(q, k, v, in.dout, lse, delta, dq, row_work, scale);
  const mdkv::DkvArgs ka = dkv_args(q, k, v, in.dout, lse, delta, dk, dv, kv_work, kv_ranges, dq_acc, scale);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto err = sm90 ? mdkv::launch_bwd_sm90(da, qa, ka, dtype_code(q), d, stream)
                  : mdkv::launch_bwd(da, qa, ka, dtype_code(q), d, stream);
  check_launch(err, sm90 ? "bwd_sm90" : "bwd", false);
  if (dq_acc.defined()) finish_dq(dq_acc, dq, scale);
  return {dq, dk, dv};
}

// mma.sync kernels: row items of 64-row query tiles, kv items of 64-row key tiles
std::tuple<at::Tensor, at::Tensor, at::Tensor> dualkv_bwd(MDKV_BWD_PARAMS) {
  return bwd_impl(dout, q, k, v, out, lse, dlse, row_work, kv_work, kv_ranges, scale, deterministic, false);
}

// Hopper wgmma kernels: row items of 128-row query tiles, kv items of 128-row key tiles
std::tuple<at::Tensor, at::Tensor, at::Tensor> dualkv_bwd_sm90(MDKV_BWD_PARAMS) {
  return bwd_impl(dout, q, k, v, out, lse, dlse, row_work, kv_work, kv_ranges, scale, deterministic, true);
}

}  // namespace

MDKV_LIBRARY(MDKV_OPS_NS, m) {
  m.def(mdkv::op_args::fwd_schema("fwd").c_str());
  m.def(mdkv::op_args::fwd_schema("fwd_sm90").c_str());
  m.def(mdkv::op_args::bwd_schema("bwd").c_str());
  m.def(mdkv::op_args::bwd_schema("bwd_sm90").c_str());
}

MDKV_LIBRARY_IMPL(MDKV_OPS_NS, CUDA, m) {
  m.impl("fwd", &dualkv_fwd);
  m.impl("fwd_sm90", &dualkv_fwd_sm90);
  m.impl("bwd", &dualkv_bwd);
  m.impl("bwd_sm90", &dualkv_bwd_sm90);
}

// Importable as megatron_dualkv._C (importing it registers the ops above).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "DualKV fused attention kernels (torch ops megatron_dualkv::*)"; }
