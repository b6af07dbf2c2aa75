// Torch op of the warp-specialized Hopper forward (csrc/dualkv_fwd_ws_sm90.cu), added to the
// `megatron_dualkv` library defined in csrc/dualkv_ops.cpp:
//
//   megatron_dualkv::fwd_ws_sm90(q, k, v, row_work, scale) -> (out [T,Hq,D], lse [Hq,T] fp32)
//
// Same contract and row items (128-row query tiles) as fwd_sm90. Opt-in from Python with
// fwd_impl="ws" or MEGATRON_DUALKV_CUDA_FWD=ws (megatron_dualkv/ops/cuda_backend.py, which also
// registers the fake implementation).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>

#include "dualkv_fwd_ws.h"

namespace {

std::tuple<at::Tensor, at::Tensor> dualkv_fwd_ws_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& row_work, double scale) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "megatron_dualkv: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "megatron_dualkv: q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "megatron_dualkv: dtype must be bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "megatron_dualkv: q, k, v must share one dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "megatron_dualkv: head dim must be 64 or 128, got ", d);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && k.size(0) == q.size(0),
              "megatron_dualkv: k and v must be [T, Hkv, ", d, "] with q's T");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "megatron_dualkv: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "megatron_dualkv: q, k, v must be contiguous [T, H, D]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "megatron_dualkv: the ws forward reads q, k, v with TMA, which needs 16-byte aligned data pointers");
  TORCH_CHECK(row_work.is_cuda() && row_work.device() == q.device() && row_work.scalar_type() == at::kInt &&
                  row_work.is_contiguous() && row_work.dim() == 2 && row_work.size(1) == 8,
              "megatron_dualkv: row_work must be a contiguous int32 [items, 8] tensor on q's device");
  c10::cuda::CUDAGuard guard(q.device());
  const int T = q.size(0), hq = q.size(1), hkv = k.size(1);
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
  a.hq = hq;
  a.hkv = hkv;
  a.scale = static_cast<float>(scale);
  a.scale_log2 = static_cast<float>(scale * M_LOG2E);
  const int dtype = q.scalar_type() == at::kBFloat16 ? mdkv::kBF16 : mdkv::kFP16;
  auto err = mdkv::launch_fwd_ws_sm90(a, dtype, static_cast<int>(d), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "megatron_dualkv fwd_ws_sm90 launch failed: ", cudaGetErrorString(err),
              err == cudaErrorInvalidResourceHandle ? " (TMA tensor map could not be encoded)" : "");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_dualkv, m) {
  m.def("fwd_ws_sm90(Tensor q, Tensor k, Tensor v, Tensor row_work, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_dualkv, CUDA, m) { m.impl("fwd_ws_sm90", &dualkv_fwd_ws_sm90); }
