// Matmuls with a few rows against bf16 weights, for XLA:CPU through jax.ffi (ops/cpu_kernels/matvec.py).
//
// ErnieJaxExpertMatvec: y[r, j, :] = x[r, :] @ w[ids[r, j]]   x [R, K] f32, ids [R, J] s32, w: groups [E_g, K, N]
//   The experts are numbered across the weight groups in order (model.weights.cpu_layout splits an expert
//   stack into consecutive groups); an id outside [0, E) gives a zero row (another device's expert). Each
//   expert's weights are read once for all the rows that chose it, and only chosen experts are read:
//   XLA:CPU's batched matmul computes every expert at a common row capacity and repacks its weights on
//   every call. A plain [K, N] weight is one expert.
// ErnieJaxMatvecT: y[r, n] = x[r, :] . w[n, :]   x [R, K] f32, w [N, K] (a tied LM head: the embedding)
//
// Every output element is one f32 sum (bf16 products are exact in f32) in an order fixed by K alone, so a
// row's result does not depend on the other rows, on how many threads ran or on how the work was split.
#include <string>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using namespace ernie_jax;

namespace {

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
};

ffi::Error ExpertMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                            ffi::RemainingArgs groups, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), id = ids.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0]) {
    return ffi::Error::InvalidArgument("expert_matvec: x must be [R, K] and ids [R, J]");
  }
  auto step = std::make_unique<Step>();
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
  parallel_for(pool, step->units.size(), [&](int64_t i) { step->run(step->units[i]); });
  return ffi::Error::Success();
}

// y[a][n + b] = x[a] . w[n + b] for B rows of w [N, K] and A rows of x: 16-wide partial sums over k, added
// lane by lane in a fixed order at the end (then the K % 16 tail).
template <int B, int A>
void dot_rows(const uint16_t* w, int64_t K, int64_t n, const float* const* x, float* const* y) {
  f32x16 acc[A][B] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    f32x16 wv[B];
    for (int b = 0; b < B; ++b) wv[b] = widen(w + (n + b) * K + k);
    for (int a = 0; a < A; ++a) {
      f32x16 xv;
      std::memcpy(&xv, x[a] + k, sizeof xv);
      for (int b = 0; b < B; ++b) acc[a][b] += xv * wv[b];
    }
  }
  for (int a = 0; a < A; ++a) {
    for (int b = 0; b < B; ++b) {
      float lanes[16];
      std::memcpy(lanes, &acc[a][b], sizeof lanes);
      float t = 0.f;
      for (int i = 0; i < 16; ++i) t += lanes[i];
      for (int64_t kk = k; kk < K; ++kk) t += x[a][kk] * widen1(w[(n + b) * K + kk]);
      y[a][n + b] = t;
    }
  }
}

ffi::Error MatvecTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("matvec_t: x must be [R, K] and w [N, K]");
  }
  const int64_t R = xd[0], K = xd[1], N = wd[0], chunk = 256;
  const float* xs = x.typed_data();
  const uint16_t* ws = w.typed_data();
  float* ys = y->typed_data();
  parallel_for(pool, (N + chunk - 1) / chunk, [&](int64_t unit) {
    const int64_t n1 = std::min(N, (unit + 1) * chunk);
    for (int64_t r = 0; r < R; r += 2) {
      const float* xr[2] = {xs + r * K, xs + std::min(r + 1, R - 1) * K};
      float* yr[2] = {ys + r * N, ys + std::min(r + 1, R - 1) * N};
      int64_t n = unit * chunk;
      if (r + 1 < R) {
        for (; n + 4 <= n1; n += 4) dot_rows<4, 2>(ws, K, n, xr, yr);
        for (; n < n1; ++n) dot_rows<1, 2>(ws, K, n, xr, yr);
      } else {
        for (; n + 4 <= n1; n += 4) dot_rows<4, 1>(ws, K, n, xr, yr);
        for (; n < n1; ++n) dot_rows<1, 1>(ws, K, n, xr, yr);
      }
    }
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErnieJaxMatvecT, MatvecTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
