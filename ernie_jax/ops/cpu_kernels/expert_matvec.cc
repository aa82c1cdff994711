// Few-row matmuls against selected experts' bf16 weights, for XLA:CPU through jax.ffi.
//
//   y[r, j, :] = x[r, :] @ w[ids[r, j]]     x [R, K] f32, ids [R, J] s32, w: groups [E_g, K, N] bf16
//
// The experts are numbered across the weight groups in order (model.weights.cpu_layout splits an expert
// stack into consecutive groups); an id outside [0, E) gives a zero row (another device's expert).
// Each expert's weights are read once for all the rows that chose it, and only chosen experts are read:
// XLA:CPU's batched matmul would compute every expert at a common row capacity and repack its weights on
// every call. Every output element is one f32 sum over k in order (bf16 products are exact in f32), so a
// row's result does not depend on the other rows, on how many threads ran or on how the work was split.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
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

// A rows x (16 V) columns of y from rows x[a] and weight columns [n, n + 16 V): registers hold the
// accumulators, and every k reads 32 V contiguous bytes of the weight.
template <int V, int A>
void tile(const uint16_t* w, int64_t K, int64_t N, int64_t n, const float* const* x, float* const* y) {
  f32x16 acc[A][V] = {};
  const uint16_t* p = w + n;
  for (int64_t k = 0; k < K; ++k, p += N) {
    f32x16 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = widen(p + 16 * v);
    for (int a = 0; a < A; ++a) {
      const float xv = x[a][k];
      for (int v = 0; v < V; ++v) acc[a][v] += xv * wv[v];
    }
  }
  for (int a = 0; a < A; ++a) std::memcpy(y[a] + n, acc[a], sizeof acc[a]);
}

template <int A>
void columns(const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, const float* const* x,
             float* const* y) {
  int64_t n = n0;
  for (; n + 128 <= n1; n += 128) tile<8, A>(w, K, N, n, x, y);
  for (; n + 16 <= n1; n += 16) tile<1, A>(w, K, N, n, x, y);
  for (; n < n1; ++n) {
    for (int a = 0; a < A; ++a) {
      float t = 0.f;
      for (int64_t k = 0; k < K; ++k) t += x[a][k] * widen1(w[k * N + n]);
      y[a][n] = t;
    }
  }
}

struct Step {
  const float* x;
  float* y;
  int64_t J, K, N;
  std::vector<const uint16_t*> experts;    // every expert's [K, N] weights, groups in order
  std::vector<std::vector<int32_t>> rows;  // per expert: the (r * J + j) it computes
  std::vector<std::pair<int32_t, int64_t>> units;  // (expert, first column)
  int64_t chunk;
  std::atomic<int64_t> next{0}, done{0};

  void run(const std::pair<int32_t, int64_t>& unit) const {
    const auto& mine = rows[unit.first];
    const int64_t n0 = unit.second, n1 = std::min(N, n0 + chunk);
    for (size_t a = 0; a < mine.size(); a += 2) {
      const float* xs[2];
      float* ys[2];
      const int count = mine.size() - a >= 2 ? 2 : 1;
      for (int i = 0; i < count; ++i) {
        xs[i] = x + (mine[a + i] / J) * K;
        ys[i] = y + int64_t(mine[a + i]) * N;
      }
      if (count == 2) {
        columns<2>(experts[unit.first], K, N, n0, n1, xs, ys);
      } else {
        columns<1>(experts[unit.first], K, N, n0, n1, xs, ys);
      }
    }
  }

  void drain() {  // claim units until none are left; a late helper thread finds none and returns
    const int64_t n = units.size();
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      run(units[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error ExpertMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                            ffi::RemainingArgs groups, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), id = ids.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0]) {
    return ffi::Error::InvalidArgument("expert_matvec: x must be [R, K] and ids [R, J]");
  }
  auto step = std::make_shared<Step>();
  step->x = x.typed_data();
  step->y = y->typed_data();
  step->J = id[1];
  step->K = xd[1];
  step->N = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto w = groups.get<ffi::Buffer<ffi::BF16>>(g);
    if (!w.has_value()) return ffi::Error::InvalidArgument("expert_matvec: weight groups must be bf16");
    auto wd = w->dimensions();
    if (wd.size() != 3 || wd[1] != step->K || (step->N >= 0 && wd[2] != step->N)) {
      return ffi::Error::InvalidArgument("expert_matvec: weight group " + std::to_string(g) +
                                         " must be [E_g, K, N] with x's K and one N");
    }
    step->N = wd[2];
    const uint16_t* base = w->typed_data();
    for (int64_t e = 0; e < wd[0]; ++e) step->experts.push_back(base + e * wd[1] * wd[2]);
  }
  const int64_t E = step->experts.size(), R = xd[0], J = step->J, N = step->N;
  std::memset(step->y, 0, sizeof(float) * R * J * std::max<int64_t>(N, 0));
  step->rows.resize(E);
  const int32_t* route = ids.typed_data();
  for (int64_t i = 0; i < R * J; ++i) {
    if (route[i] >= 0 && route[i] < E) step->rows[route[i]].push_back(i);
  }
  step->chunk = 256;  // a unit of work: one expert's rows over 256 columns
  for (int64_t e = 0; e < E; ++e) {
    if (step->rows[e].empty()) continue;
    for (int64_t n = 0; n < N; n += step->chunk) step->units.emplace_back(e, n);
  }
  const int64_t units = step->units.size();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), units) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([step] { step->drain(); });
  step->drain();
  while (step->done.load(std::memory_order_acquire) < units) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErnieJaxExpertMatvec, ExpertMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());
