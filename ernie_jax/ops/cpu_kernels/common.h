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

// Lane j of the result: the sum of v[j]'s 16 lanes, added as a fixed tree (pairs of lanes, then pairs of
// pairs, ...); four rounds of shuffles and additions over all 16 vectors at once.
inline f32x16 lane_sums(f32x16* v) {
  for (int width = 16; width > 1; width /= 2) {
    for (int i = 0; i < width / 2; ++i) {
      const f32x16 a = v[2 * i], b = v[2 * i + 1];
#if defined(__clang__)
      v[i] = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
             __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
      const i32x16 even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
      v[i] = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, even + 1);
#endif
    }
  }
  return v[0];
}

// The multiply-adds below which a call runs on its calling thread alone (cpu_kernels.set_parallel_work; the
// engine's CPU rules choose it per model): waking a helper costs about as much as a small call's work when
// its weights stream from cache, while from memory a second core's bandwidth pays even for small calls.
// Which threads run never changes a result: each output is computed whole by one thread, in a fixed order.
inline std::atomic<int64_t> g_parallel_work{0};
extern "C" __attribute__((visibility("default"))) void ErnieJaxSetParallelWork(int64_t work) {
  g_parallel_work.store(work);
}

// Runs fn(i) for every i in [0, n) on the calling thread and, for a call with at least g_parallel_work
// multiply-adds (`work`), on up to num_threads - 1 of XLA's pool threads too, each claiming the next index;
// returns once all are done. A helper that starts late finds nothing to claim and returns without touching
// fn (whose captures may be gone by then).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t work, const F& fn) {
  if (work < g_parallel_work.load(std::memory_order_relaxed) || n < 2 || pool.num_threads() < 2) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
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
