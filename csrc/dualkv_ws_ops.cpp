// Torch ops of the warp-specialized Hopper kernels (csrc/dualkv_fwd_ws_sm90.cu,
// csrc/dualkv_bwd_ws_sm90.cu), added to the `megatron_dualkv` library defined in
// csrc/dualkv_ops.cpp:
//
//   megatron_dualkv::fwd_ws_sm90(q, k, v, row_work, scale, kv_tile=128, narrow_tail=True, persistent=False)
//                                -> (out [Tq,Hq,D], lse [Hq,Tq] fp32)
//     kv_tile: keys per tile, 128 or (head dim 128 only) 176; narrow_tail: a parent's partial last
//     key tile after the row's own tiles, its MMAs narrowed to 64 or 128 keys (else in key order at
//     full width; cuda_backend.ws_fwd_narrow_tail chooses); persistent: one CTA per SM takes the
//     query tiles in turn (bitwise the same out and lse; cuda_backend.ws_fwd_persistent chooses)
//   megatron_dualkv::bwd_ws_sm90(dout, q, k, v, out, lse, dlse?, row_work, kv_work, kv_ranges, scale,
//                                deterministic, split_slots=0, tail_slots=0, head_parts=1, long_items=0,
//                                dq_beside=False, rest_parts=1) -> (dq, dk, dv)
//     deterministic: dK/dV by the ws kernel without dQ, every key tile's walk in list order, then
//     dQ over row_work (128-row query tiles, cuda_backend's rows128) by the ws dQ kernel, or the
//     sm90 one with MEGATRON_DUALKV_DQ_KERNEL=sm90 (bitwise the same; all T query rows only):
//     bitwise reproducible, and where no key tile is split equal to bwd_sm90's deterministic mode;
//     dq_beside: the dQ kernel may start beside the dK/dV kernel's last wave (under
//     MEGATRON_DUALKV_DQ_STREAM=auto; cuda_backend.ws_dq_beside chooses)
//
// q (and dout, out, lse) hold Tq rows, k and v T rows: Tq = T for the whole micro-batch, fewer for
// local queries (a context-parallel rank's rows against gathered K/V). Row items (128-row query
// tiles) carry the local row of their first query in field 6; the backward's kv items and
// ranges (4 int32: a, b, loc, causal) are those of cuda_backend.ws_kv_work; split_slots is the
// number of fp32 dK/dV slots the split key tiles' parts name (cuda_backend.split_slots: one per
// split tile in fast mode, one per part in deterministic mode; the workspace is allocated here).
// tail_slots: the slots after those of the prompt tails' parts (cuda_backend.tail_slots; kv item
// field 8 != 0). Each must be that function's count for this list and mode: the kernel indexes
// the workspace by the parts' field 7 without a bound check. head_parts > 1 (a list with no split
// part, cuda_backend.ws_head_parts): the first long_items kv items (item field 5, the long band)
// run as head_parts CTAs per kv head, each walking Hq / Hkv / head_parts query heads, their dK/dV
// summed in workspace slots after the tails' (fast mode: max(head_parts, rest_parts) - 1 per item,
// every part but the last to finish storing its own; deterministic: max(head_parts, rest_parts),
// one per part). rest_parts > 1 (cuda_backend.ws_rest_parts): the other items likewise, in
// rest_parts CTAs per kv head; then long_items must be item field 5 even where head_parts = 1, and
// every item has slots.
// The work lists come from megatron_dualkv/ops/cuda_backend.py, which also registers the fake
// implementations.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "dualkv_fwd_ws.h"
#include "dualkv_op_args.h"
#include "ops_namespace.h"

namespace {

using namespace mdkv::op_args;

// q holds all T query rows or a context-parallel rank's; the kernels read q, k, v with TMA
void check_ws_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_qkv(q, k, v);
  TORCH_CHECK(q.size(0) > 0 && q.size(0) <= k.size(0), "megatron_dualkv: q holds ", q.size(0),
              " rows; it must hold 1 to T = ", k.size(0), " (all or a context-parallel rank's queries)");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "megatron_dualkv: the ws kernels read q, k, v with TMA, which needs 16-byte aligned data pointers");
}

std::tuple<at::Tensor, at::Tensor> dualkv_fwd_ws_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& row_work, double scale, int64_t kv_tile,
                                                      bool narrow_tail, bool persistent) {
  check_ws_qkv(q, k, v);
  check_work(row_work, q, "row_work", 8);
  check_env_choice(mdkv::ws_fwd_tail_min_from_env(), "MEGATRON_DUALKV_WS_FWD_TAIL_MIN", "'16' or '64'");
  check_env_choice(mdkv::ws_fwd_diag_from_env(), "MEGATRON_DUALKV_WS_FWD_DIAG", "'0' or '1'");
  check_env_choice(mdkv::ws_fwd_idle_from_env(), "MEGATRON_DUALKV_WS_FWD_IDLE", "'0' or '1'");
  TORCH_CHECK(kv_tile == 128 || (kv_tile == 176 && q.size(2) == 128),
              "megatron_dualkv: fwd_ws_sm90 takes key tiles of 128 keys, or 176 at head dim 128; got ", kv_tile,
              " at head dim ", q.size(2));
  c10::cuda::CUDAGuard guard(q.device());
  FwdCall c = fwd_call(q, k, v, row_work, scale);
  at::Tensor tile_counter;  // persistent CTAs take their next query tile from it
  if (persistent) {
    tile_counter = at::zeros({1}, q.options().dtype(at::kInt));
    c.args.tile_counter = tile_counter.data_ptr<int>();
  }
  auto err = mdkv::launch_fwd_ws_sm90(c.args, dtype_code(q), q.size(2), (int)kv_tile, narrow_tail,
                                      at::cuda::getCurrentCUDAStream());
  check_launch(err, "fwd_ws_sm90", true);
  return {c.out, c.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dualkv_bwd_ws_sm90(MDKV_BWD_PARAMS, int64_t split_slots,
                                                                   int64_t tail_slots, int64_t head_parts,
                                                                   int64_t long_items, bool dq_beside,
                                                                   int64_t rest_parts) {
  check_ws_qkv(q, k, v);
  check_env_choice(mdkv::ws_dq_mode_from_env(), "MEGATRON_DUALKV_WS_DQ", "'atomic' or 'tma'");
  check_env_choice(mdkv::ws_bwd_query_tile_from_env(), "MEGATRON_DUALKV_WS_BWD_QTILE", "'64' or '80'");
  check_env_choice(mdkv::ws_reverse_rows_from_env(), "MEGATRON_DUALKV_WS_REVERSE_ROWS", "'auto' or '0'");
  // kv items and ranges [a, b, loc, causal] of cuda_backend.ws_kv_work
  check_work(kv_work, q, "kv_work", mdkv::kWsKvItemInts);
  check_work(kv_ranges, q, "kv_ranges", 4);
  TORCH_CHECK(split_slots >= 0 && split_slots <= kv_work.size(0), "megatron_dualkv: split_slots = ", split_slots,
              " is not between 0 and the ", kv_work.size(0), " kv items");
  TORCH_CHECK(tail_slots >= 0 && split_slots + tail_slots <= kv_work.size(0), "megatron_dualkv: tail_slots = ",
              tail_slots, " is not between 0 and the ", kv_work.size(0) - split_slots, " kv items past the split slots");
  const int64_t group = q.size(1) / k.size(1);
  TORCH_CHECK(head_parts >= 1 && group % head_parts == 0, "megatron_dualkv: head_parts = ", head_parts,
              " does not divide the ", group, " query heads per kv head");
  TORCH_CHECK(head_parts == 1 || split_slots == 0, "megatron_dualkv: head_parts = ", head_parts,
              " on a list with key tiles split by query rows (split_slots = ", split_slots,
              "); head parts take unsplit lists only");
  TORCH_CHECK(rest_parts >= 1 && group % rest_parts == 0, "megatron_dualkv: rest_parts = ", rest_parts,
              " does not divide the ", group, " query heads per kv head");
  TORCH_CHECK(rest_parts == 1 || split_slots == 0, "megatron_dualkv: rest_parts = ", rest_parts,
              " on a list with key tiles split by query rows (split_slots = ", split_slots,
              "); head parts take unsplit lists only");
  TORCH_CHECK(long_items >= 0 && long_items <= kv_work.size(0), "megatron_dualkv: long_items = ", long_items,
              " is not between 0 and the ", kv_work.size(0), " kv items");
  // head parts: slots for the items in parts (the long band's, and with rest_parts > 1 every item)
  // after the tails': m = max(head_parts, rest_parts) an item in deterministic mode (one per part),
  // m - 1 in fast mode (every part but the last to finish stores its sums; the last adds them)
  const int64_t stride = std::max(head_parts, rest_parts);
  const int64_t part_items = rest_parts > 1 ? kv_work.size(0) : (head_parts > 1 ? long_items : 0);
  const int64_t slots = split_slots + tail_slots + part_items * (deterministic ? stride : stride - 1);
  const BwdInputs in = check_bwd_inputs(dout, q, out, lse, dlse, "Tq");
  if (deterministic) {
    check_work(row_work, q, "row_work", 8);  // the dq kernel's 128-row query tiles
    check_env_choice(mdkv::dq_kernel_from_env(), "MEGATRON_DUALKV_DQ_KERNEL", "'ws' or 'sm90'");
    TORCH_CHECK(q.size(0) == k.size(0) || mdkv::dq_kernel_from_env() == 1,
                "megatron_dualkv: the sm90 dQ kernel (MEGATRON_DUALKV_DQ_KERNEL=sm90) takes all T = ", k.size(0),
                " query rows; q holds ", q.size(0), " (local queries run on the ws dQ kernel)");
    check_env_choice(mdkv::dq_side_stream_from_env(), "MEGATRON_DUALKV_DQ_STREAM", "'auto', '0', '1' or 'pdl'");
    check_env_choice(mdkv::det_overlap_from_env(), "MEGATRON_DUALKV_DET_OVERLAP", "'0' or '1'");
    check_env_choice(mdkv::dq_skip_from_env(), "MEGATRON_DUALKV_DQ_SKIP", "'0' or '1'");
    check_env_choice(mdkv::dq_idle_from_env(), "MEGATRON_DUALKV_DQ_IDLE", "'0' or '1'");
    check_env_choice(mdkv::dq_narrow_from_env(), "MEGATRON_DUALKV_DQ_NARROW", "'0' or '1'");
    check_env_choice(mdkv::det_skip_from_env(), "MEGATRON_DUALKV_DET_SKIP", "'0' or '1'");
    if (mdkv::dq_kernel_from_env() == 0) check_dq_key_tile_env();
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(in.dout.data_ptr()) % 16 == 0,
              "megatron_dualkv: the ws backward reads dout with TMA, which needs a 16-byte aligned data pointer");
  c10::cuda::CUDAGuard guard(q.device());
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  auto delta = per_head_row_floats(q);
  // fast mode: the fp32 dQ sums, and behind them (zeroed by the same fill) the int phase slots
  // [items, hkv] of the phase-aligned walks (kv item field 7 < 0; at most one slot per item).
  // Deterministic: neither (no dq_acc: the kernel computes dK/dV only, then the dQ kernel runs).
  at::Tensor acc, dq_acc;
  if (!deterministic) {
    acc = at::zeros({q.numel() + kv_work.size(0) * k.size(1)}, q.options().dtype(at::kFloat));
    dq_acc = acc.narrow(0, 0, q.numel()).view(q.sizes());
  }
  const mdkv::DeltaArgs da = delta_args(out, in.dout, in.dlse, delta);
  mdkv::DkvArgs ka = dkv_args(q, k, v, in.dout, lse, delta, dk, dv, kv_work, kv_ranges, dq_acc, scale);
  if (acc.defined()) ka.phase = reinterpret_cast<int*>(acc.data_ptr<float>() + q.numel());
  // a split list is grouped by response (cuda_backend.split_by_rows) and has no phase-aligned walk
  ka.reverse_rows = split_slots > 0 && mdkv::ws_reverse_rows_from_env() == 1;
  ka.skip_masked_steps = deterministic && mdkv::det_skip_from_env() == 1;
  ka.head_parts = (int)head_parts;
  ka.rest_parts = (int)rest_parts;
  ka.long_items = head_parts > 1 || rest_parts > 1 ? (int)long_items : 0;
  ka.head_slot_base = (int)(split_slots + tail_slots);
  // dK/dV of the key tiles split by query rows and of the prompt tails, and their tickets: fast
  // mode, one slot of sums per split tile or tail (zeroed: parts add into it); deterministic, one
  // slot per part, a prompt tail's t-row parts packed 128 // t to a slot (each part stores its rows
  // before the last part reads them). Head parts' slots are stored before they are read (never
  // zeroed).
  at::Tensor split_acc, split_count;
  if (slots > 0) {
    const std::vector<int64_t> shape{slots, k.size(1), 2, 128, q.size(2)};
    const auto f32 = q.options().dtype(at::kFloat);
    split_acc = at::empty(shape, f32);
    if (!deterministic && split_slots + tail_slots > 0) split_acc.narrow(0, 0, split_slots + tail_slots).zero_();
    split_count = at::zeros({slots, k.size(1)}, q.options().dtype(at::kInt));
    ka.split_acc = split_acc.data_ptr<float>();
    ka.split_count = split_count.data_ptr<int>();
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  if (!deterministic) {
    check_launch(mdkv::launch_bwd_ws_sm90(da, ka, dtype_code(q), q.size(2), stream), "bwd_ws_sm90", true);
    finish_dq(dq_acc, dq, scale);
    return {dq, dk, dv};
  }
  // Deterministic: delta, then the dK/dV kernel and the dQ kernel, which need nothing of each
  // other. Where the dK/dV kernel's last wave leaves SMs idle (dq_beside, cuda_backend.ws_dq_beside:
  // key tiles split by query rows, or head parts for balance) the dQ kernel's CTAs fill them (on
  // the long shapes at 32 / 8, which split nothing, -0.7 to +4 %: docs/PERF.md, twenty-third
  // session). Either as a programmatic
  // dependent launch behind it on this stream ("pdl"; its CTAs start once every dK/dV CTA has
  // started), or on a second stream that this one then waits for, so that every tensor used there
  // is ordered before its memory can be reused. auto: pdl, except under
  // CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue). On a second stream with the default 8
  // queues the backward was bimodal (some calls as slow as one kernel after the other: dQ CTAs
  // started among the long dK/dV ones), pdl 0.87-1.00x of it and 0.79-0.95x of serial on GRPO
  // shapes; under one queue the second stream was never slow and 0.3-0.8 % faster than pdl
  // (docs/PERF.md, twenty-fifth session).
  const int side_mode = mdkv::dq_side_stream_from_env();  // 2 auto, 1 second stream, 0 serial, 3 pdl
  const bool overlap = side_mode == 1 || side_mode == 3 || (side_mode == 2 && dq_beside);
  const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const bool one_queue = queues != nullptr && std::atoi(queues) == 1;
  // (kv items: the dK/dV kernel is launched, so the dQ kernel may overlap it and not delta, whose
  // output it reads)
  const bool ws_dq = mdkv::dq_kernel_from_env() == 1;  // else the sm90 dQ kernel (no dependent launch)
  const bool pdl = overlap && (side_mode == 3 || (side_mode == 2 && !one_queue)) && ws_dq && kv_work.size(0) > 0;
  const bool side = overlap && !pdl;
  at::Tensor ticket;
  if (pdl) ticket = at::zeros({1}, q.options().dtype(at::kInt));  // before delta: no kernel between the two
  check_launch(mdkv::launch_delta(da, dtype_code(q), q.size(2), stream), "bwd_ws_sm90 (delta)", false);
  const c10::cuda::CUDAStream dq_stream = side ? c10::cuda::getStreamFromPool(false, q.device().index()) : stream;
  at::cuda::CUDAEvent delta_ready, dq_done;
  if (side) {
    delta_ready.record(stream);
    delta_ready.block(dq_stream);
  }
  // dK/dV first: its list starts with the longest CTAs, which should not wait behind dQ's
  check_launch(mdkv::launch_bwd_ws_sm90(da, ka, dtype_code(q), q.size(2), stream, true), "bwd_ws_sm90", true);
  mdkv::DqArgs qa = dq_args(q, k, v, in.dout, lse, delta, dq, row_work, scale);
  if (pdl) qa.pdl_ticket = ticket.data_ptr<int>();
  qa.skip_masked_last = mdkv::dq_skip_from_env();
  qa.idle_empty_rows = mdkv::dq_idle_from_env();
  qa.narrow_parent_tail = mdkv::dq_narrow_from_env();
  if (ws_dq)
    check_launch(mdkv::launch_dq_ws_sm90(qa, dtype_code(q), q.size(2), dq_stream, pdl), "bwd_ws_sm90 (dq_ws)", true);
  else
    check_launch(mdkv::launch_dq_sm90(qa, dtype_code(q), q.size(2), dq_stream), "bwd_ws_sm90 (dq)", false);
  if (side) {
    dq_done.record(dq_stream);
    dq_done.block(stream);
  }
  return {dq, dk, dv};
}

}  // namespace

// The format of the ws work lists and ops this build reads (cuda_backend.WS_LIST_FORMAT; 2: kv item
// field 7 < 0 marks a phase-aligned walk; 3: fwd_ws_sm90 takes kv_tile; 4: and narrow_tail; 5: a
// split part's field 7 is (slot << 20) | (part << 10) | parts, and deterministic lists split; 6:
// fwd_ws_sm90 takes persistent; 7: kv items of mdkv::kWsKvItemInts fields, the prompt tails
// merged into their responses' first key tiles, and bwd_ws_sm90 takes tail_slots). The package
// refuses a build that reads another format: a format-1 build would take a phase walk for a split
// part and write outside its workspace, a format-2 one has no kv_tile argument, a format-3 one no
// narrow_tail, a format-4 one would read a part's slot from the wrong bits, a format-5 one has no
// persistent argument, a format-6 one reads 8 fields. 8: the ws dQ kernel (deterministic backward)
// reads row item field 6, the local row of its first query, and takes local queries; a format-7
// build refuses them. 9: bwd_ws_sm90 takes head_parts and long_items (a format-8 build has neither).
// 10: and dq_beside (a format-9 build decides it from split_slots alone). 11: and rest_parts
// (the second band's items in head parts; a format-10 build has no such argument).
constexpr int64_t kWsListFormat = 11;

MDKV_LIBRARY_FRAGMENT(MDKV_OPS_NS, m) {
  m.def("ws_list_format() -> int", []() -> int64_t { return kWsListFormat; });
  std::string ws_fwd = mdkv::op_args::fwd_schema("fwd_ws_sm90");
  ws_fwd.insert(ws_fwd.find(") ->"), ", int kv_tile=128, bool narrow_tail=True, bool persistent=False");
  m.def(ws_fwd.c_str());
  std::string ws_bwd = mdkv::op_args::bwd_schema("bwd_ws_sm90");
  ws_bwd.insert(ws_bwd.find(") ->"), ", int split_slots=0, int tail_slots=0, int head_parts=1, int long_items=0, bool dq_beside=False, int rest_parts=1");
  m.def(ws_bwd.c_str());
}

MDKV_LIBRARY_IMPL(MDKV_OPS_NS, CUDA, m) {
  m.impl("fwd_ws_sm90", &dualkv_fwd_ws_sm90);
  m.impl("bwd_ws_sm90", &dualkv_bwd_ws_sm90);
}
