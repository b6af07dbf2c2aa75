// Input checks and kernel-argument builders shared by the torch ops of csrc/dualkv_ops.cpp (mma.sync
// and wgmma kernels) and csrc/dualkv_ws_ops.cpp (warp-specialized kernels), so that each op states
// only what is its own: how many query rows it takes (T, or 1..T local queries), which work lists,
// which launcher. Inline functions: the header is compiled into both op files.
//
// Rows: q, dout, out, lse, delta and dq_acc hold Tq = q.size(0) rows, k and v T = k.size(0) rows.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "dualkv_kernels.h"

namespace mdkv::op_args {

// Device, rank, dtype, head dim, head grouping and contiguity of q, k, v. Their token counts are
// the op's to check (Tq == T for the whole micro-batch, 1 <= Tq <= T for local queries).
inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "megatron_dualkv: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "megatron_dualkv: q, k, v must be [tokens, heads, head_dim], got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "megatron_dualkv: dtype must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "megatron_dualkv: q, k, v must share one dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "megatron_dualkv: head dim must be 64 or 128, got ", d);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d, "megatron_dualkv: k and v must be [T, Hkv, ", d, "]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "megatron_dualkv: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "megatron_dualkv: q, k, v must be contiguous [T, H, D]");
}

// A work list of megatron_dualkv/ops/cuda_backend.py: contiguous int32 [n, cols] on q's device.
inline void check_work(const at::Tensor& w, const at::Tensor& q, const char* what, int64_t cols) {
  TORCH_CHECK(w.is_cuda() && w.device() == q.device() && w.scalar_type() == at::kInt && w.is_contiguous() &&
                  w.dim() == 2 && w.size(1) == cols,
              "megatron_dualkv: ", what, " must be a contiguous int32 [n, ", cols, "] tensor on q's device, got ",
              w.scalar_type(), " ", w.sizes(), " on ", w.device());
}

// The backward's inputs from the forward and autograd: dout (returned contiguous) like q, out like
// q, lse float32 [Hq, Tq], dlse (optional; returned float32 contiguous, or undefined) like lse.
// `rows` names Tq in the messages ("T" where the op takes every query row).
struct BwdInputs {
  at::Tensor dout, dlse;
};

inline BwdInputs check_bwd_inputs(const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& out,
                                  const at::Tensor& lse, const std::optional<at::Tensor>& dlse_in, const char* rows) {
  BwdInputs r;
  r.dout = dout_in.contiguous();
  TORCH_CHECK(r.dout.sizes() == q.sizes() && r.dout.scalar_type() == q.scalar_type(),
              "megatron_dualkv: grad of out must match q's shape and dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "megatron_dualkv: out must be contiguous like q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == q.size(1) &&
                  lse.size(1) == q.size(0),
              "megatron_dualkv: lse must be contiguous float32 [Hq, ", rows, "]");
  if (dlse_in.has_value() && dlse_in->defined()) {
    r.dlse = dlse_in->to(at::kFloat).contiguous();
    TORCH_CHECK(r.dlse.sizes() == lse.sizes(), "megatron_dualkv: grad of lse must be [Hq, ", rows, "]");
  }
  return r;
}

inline int dtype_code(const at::Tensor& q) { return q.scalar_type() == at::kBFloat16 ? kBF16 : kFP16; }

// float32 [Hq, Tq], the shape of lse and delta
inline at::Tensor per_head_row_floats(const at::Tensor& q) {
  return at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
}

// The fields that the forward, dQ and dK/dV kernels' arguments share
template <class Args>
void set_qkv(Args& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.T = k.size(0);
  a.hq = q.size(1);
  a.hkv = k.size(1);
  a.scale = static_cast<float>(scale);
  a.scale_log2 = static_cast<float>(scale * M_LOG2E);
}

// ... and those that the dQ and dK/dV kernels' arguments share
template <class Args>
void set_bwd_inputs(Args& a, const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta) {
  a.dout = dout.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
}

// A forward call: out (like q) and lse (float32 [Hq, Tq]), allocated on q's device, and the
// kernel arguments that point at them
struct FwdCall {
  at::Tensor out, lse;
  FwdArgs args;
};

inline FwdCall fwd_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& row_work,
                        double scale) {
  FwdCall c{at::empty_like(q), per_head_row_floats(q), {}};
  FwdArgs& a = c.args;
  set_qkv(a, q, k, v, scale);
  a.Tq = q.size(0);
  a.out = c.out.data_ptr();
  a.lse = c.lse.data_ptr<float>();
  a.work = row_work.data_ptr<int>();
  a.num_items = row_work.size(0);
  return c;
}

// delta = rowsum(dout * out) - dlse, one per query row and head; dlse may be undefined
inline DeltaArgs delta_args(const at::Tensor& out, const at::Tensor& dout, const at::Tensor& dlse,
                            const at::Tensor& delta) {
  DeltaArgs a;
  a.out = out.data_ptr();
  a.dout = dout.data_ptr();
  a.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  a.delta = delta.data_ptr<float>();
  a.T = out.size(0);
  a.hq = out.size(1);
  return a;
}

// The deterministic dQ kernel's arguments (q holds T rows, or for the ws dQ kernel a
// context-parallel rank's Tq: the row items' field 6 is then the local row of their first query)
inline DqArgs dq_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                      const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dq, const at::Tensor& row_work,
                      double scale) {
  DqArgs a;
  set_qkv(a, q, k, v, scale);
  set_bwd_inputs(a, dout, lse, delta);
  a.Tq = q.size(0);
  a.dq = dq.data_ptr();
  a.work = row_work.data_ptr<int>();
  a.num_items = row_work.size(0);
  return a;
}

// The dK/dV kernel's arguments; dq_acc undefined: no dQ by atomics (the dQ kernel computes it)
inline DkvArgs dkv_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                        const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& dk, const at::Tensor& dv,
                        const at::Tensor& kv_work, const at::Tensor& kv_ranges, const at::Tensor& dq_acc,
                        double scale) {
  DkvArgs a;
  set_qkv(a, q, k, v, scale);
  set_bwd_inputs(a, dout, lse, delta);
  a.Tq = q.size(0);
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  a.work = kv_work.data_ptr<int>();
  a.ranges = kv_ranges.data_ptr<int>();
  a.dq_acc = dq_acc.defined() ? dq_acc.data_ptr<float>() : nullptr;
  a.num_items = kv_work.size(0);
  return a;
}

// Before a launch that reads switch `var` (code: its *_from_env() value, -1 for a value not
// allowed): a clear error naming the variable and the `allowed` values
inline void check_env_choice(int code, const char* var, const char* allowed) {
  TORCH_CHECK(code >= 0, "megatron_dualkv: ", var, " must be ", allowed, ", got '", std::getenv(var), "'");
}

// before a launch of the sm90 dQ kernel, whose key tile comes from the environment
inline void check_dq_key_tile_env() {
  check_env_choice(dq_key_tile_from_env(), "MEGATRON_DUALKV_DQ_KTILE", "'64' or '128'");
}

// `op` names the op in the message. Launchers of kernels that read through TMA (`tma`: the ws
// kernels) return cudaErrorInvalidResourceHandle when a TMA tensor map cannot be encoded.
inline void check_launch(cudaError_t err, const char* op, bool tma) {
  TORCH_CHECK(err == cudaSuccess, "megatron_dualkv ", op, " launch failed: ", cudaGetErrorString(err),
              tma && err == cudaErrorInvalidResourceHandle ? " (TMA tensor map could not be encoded)" : "");
}

// dq = dq_acc * scale in q's dtype (fast modes: dQ accumulated in the fp32 workspace, unscaled),
// one kernel instead of mul_ and copy_
inline void finish_dq(const at::Tensor& dq_acc, at::Tensor& dq, double scale) {
  TORCH_CHECK(dq_acc.is_contiguous() && dq.is_contiguous() && dq_acc.numel() == dq.numel() && dq.numel() % 4 == 0,
              "megatron_dualkv: finish_dq needs contiguous dq and dq_acc of the same size (a multiple of 4)");
  check_launch(launch_dq_from_acc(dq_acc.data_ptr<float>(), dq.data_ptr(), dq.numel(), static_cast<float>(scale),
                                  dtype_code(dq), at::cuda::getCurrentCUDAStream()),
               "dq_from_acc", false);
}

// Every forward op's and every backward op's schema, after its name
inline std::string fwd_schema(const char* name) {
  return std::string(name) + "(Tensor q, Tensor k, Tensor v, Tensor row_work, float scale) -> (Tensor, Tensor)";
}

inline std::string bwd_schema(const char* name) {
  return std::string(name) +
         "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor row_work, "
         "Tensor kv_work, Tensor kv_ranges, float scale, bool deterministic) -> (Tensor, Tensor, Tensor)";
}

}  // namespace mdkv::op_args

// The C++ parameters of bwd_schema
#define MDKV_BWD_PARAMS                                                                                        \
  const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out, \
      const at::Tensor &lse, const std::optional<at::Tensor> &dlse, const at::Tensor &row_work,               \
      const at::Tensor &kv_work, const at::Tensor &kv_ranges, double scale, bool deterministic
