// What the CPU kernels share: 16-lane vectors (GCC/Clang vector extensions: AVX-512, AVX2 or NEON, whichever
// -march=native gives), bf16 -> f32 widening, and a parallel loop over XLA:CPU's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ernie_jax {

namespace ffi = xla::ffi;

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 widen(const uint16_t* p) {  // 16 bf16 -> f32 (exact: the bf16 bits are the f32's top half)
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float widen1(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Runs fn(i) for every i in [0, n) on the calling thread and on up to num_threads - 1 of XLA's pool threads,
// each claiming the next index; returns once all are done. A helper that starts late finds nothing to claim
// and returns without touching fn (whose captures may be gone by then).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, const F& fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, n, &fn] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < n;) {
      fn(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(drain)(drain));  // each helper its own copy
  drain();
  while (shared->done.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }
}

}  // namespace ernie_jax
