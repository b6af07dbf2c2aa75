// Per-CTA clock stamps: where a kernel's SM time goes (the CTA's start, its loop, its end, the gaps
// between CTAs), read by tools/cta_trace.py. Compiled in only with -DMDKV_CTA_TRACE
// (csrc/build_ext.py --cta-trace); in a default build every macro below is empty, so the kernels'
// code is what it is without them.
//
// Layout (kSlots uint64 per block, at the block's index): [0] %smid | count << 32, [1] %clock64 at
// entry (thread 0), [2]..[6] %clock64 at the kernel's own points (thread 128, consumer 0's first
// thread), [7] %globaltimer at entry, [8] %globaltimer at the end. A block whose slot 1 stays 0 was
// not stamped. The buffer is a zeroed int64 tensor of `capacity` blocks, given as "ADDRESS:CAPACITY"
// in the environment variable a launch names (MDKV_CTA_TRACE_FWD, MDKV_CTA_TRACE_BWD); the launch
// copies both into this translation unit's globals (none without the variable). Blocks from
// `capacity` on are not stamped.
#pragma once

#ifdef MDKV_CTA_TRACE
#include <cuda_runtime.h>
#include <cstdlib>

namespace mdkv {
namespace cta_trace {

constexpr int kSlots = 10;
struct Buffer {
  unsigned long long* stamps;
  unsigned long long capacity;  // blocks
};
static __device__ Buffer g_buffer;  // one per translation unit (static)

// this block's slots, or null; read through volatile loads at each stamp: a pointer held in a
// register across a kernel's walk made ptxas spill in the backward's deterministic instances
__device__ __forceinline__ unsigned long long* buffer() {
  unsigned long long* const p = *(unsigned long long* volatile*)&g_buffer.stamps;
  const unsigned long long cap = *(volatile unsigned long long*)&g_buffer.capacity;
  return p != nullptr && blockIdx.x < cap ? p + (unsigned long long)blockIdx.x * kSlots : nullptr;
}
__device__ __forceinline__ unsigned long long cycles() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(c)::"memory");
  return c;
}
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(c)::"memory");
  return c;
}
__device__ __forceinline__ void entry(unsigned long long count) {
  unsigned long long* const s = buffer();
  if (s == nullptr || threadIdx.x != 0) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  s[0] = (unsigned long long)sm | (count << 32);
  s[1] = cycles();
  s[7] = gtime();
}
__device__ __forceinline__ void stamp(int k) {
  unsigned long long* const s = buffer();
  if (s != nullptr && threadIdx.x == 128) s[k] = cycles();
}
__device__ __forceinline__ void end() {
  unsigned long long* const s = buffer();
  if (s == nullptr || threadIdx.x != 128) return;
  s[6] = cycles();
  s[8] = gtime();
}
// the buffer named by environment variable `var` ("ADDRESS:CAPACITY", decimal or 0x; unset or
// without a capacity: none) for the kernels launched next on `stream` from this translation unit
static inline cudaError_t set_buffer(const char* var, cudaStream_t stream) {
  const char* v = std::getenv(var);
  char* rest = nullptr;
  Buffer b{nullptr, 0};
  if (v != nullptr) {
    b.stamps = reinterpret_cast<unsigned long long*>(std::strtoull(v, &rest, 0));
    b.capacity = rest != nullptr && *rest == ':' ? std::strtoull(rest + 1, nullptr, 0) : 0;
  }
  // pageable source: the copy is staged before this returns, so `b` may go out of scope
  return cudaMemcpyToSymbolAsync(g_buffer, &b, sizeof(b), 0, cudaMemcpyHostToDevice, stream);
}

}  // namespace cta_trace
}  // namespace mdkv

#define MDKV_TRACE_ENTRY(count) ::mdkv::cta_trace::entry((unsigned long long)(count))
#define MDKV_TRACE_STAMP(k) ::mdkv::cta_trace::stamp(k)
#define MDKV_TRACE_END() ::mdkv::cta_trace::end()
#define MDKV_TRACE_SET_BUFFER(var, stream)                                          \
  do {                                                                              \
    const cudaError_t trace_e = ::mdkv::cta_trace::set_buffer((var), (stream));     \
    if (trace_e != cudaSuccess) return trace_e;                                     \
  } while (0)
#else
#define MDKV_TRACE_ENTRY(count) ((void)0)
#define MDKV_TRACE_STAMP(k) ((void)0)
#define MDKV_TRACE_END() ((void)0)
#define MDKV_TRACE_SET_BUFFER(var, stream) ((void)0)
#endif
