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
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

using namespace ernie_jax;  // ffi, the vectors, widen, lane_sums, parallel_for

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

// x's n values as bf16 bits when every one is a bf16 value (a bf16 model's activations) and this CPU has
// bf16 dot-product instructions; else empty, and the kernels widen the weights to f32 instead.
std::vector<uint16_t> bf16_bits(const float* x, int64_t n) {
#if defined(__AVX512BF16__)
  std::vector<uint16_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    if (u & 0xffffu) return {};
    out[i] = uint16_t(u >> 16);
  }
  return out;
#else
  return {};
#endif
}

#if defined(__AVX512BF16__)
// tile() with bf16 dot-product instructions: weight rows k and k + 1 interleaved into pairs, each x pair
// broadcast, 32 products an instruction and no widening.
template <int V, int A>
void tile_bf16(const uint16_t* w, int64_t K, int64_t N, int64_t n, const uint16_t* const* xb, float* const* y) {
  alignas(64) static const uint16_t order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(order);
  __m512 acc[A][V];
  for (int a = 0; a < A; ++a) {
    for (int v = 0; v < V; ++v) acc[a][v] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 2) {
    const bool pair = k + 1 < K;  // an odd K's last row is paired with zeros
    __m512i wv[V];
    for (int v = 0; v < V; ++v) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * N + n + 16 * v));
      const __m256i hi = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k + 1) * N + n + 16 * v))
                              : _mm256_setzero_si256();
      wv[v] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), interleave, _mm512_castsi256_si512(hi));
    }
    for (int a = 0; a < A; ++a) {
      const uint32_t xp = uint32_t(xb[a][k]) | (pair ? uint32_t(xb[a][k + 1]) << 16 : 0u);
      const __m512i xv = _mm512_set1_epi32(int32_t(xp));
      for (int v = 0; v < V; ++v) acc[a][v] = _mm512_dpbf16_ps(acc[a][v], (__m512bh)xv, (__m512bh)wv[v]);
    }
  }
  for (int a = 0; a < A; ++a) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y[a] + n + 16 * v, acc[a][v]);
  }
}
#endif

// columns<A>, reading x as bf16 bits where `xb` holds them (bf16_bits); the last N % 16 columns as columns<A>
template <int A>
void columns_any(const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1, const float* const* x,
                 const uint16_t* const* xb, float* const* y) {
#if defined(__AVX512BF16__)
  if (xb != nullptr) {
    int64_t n = n0;
    for (; n + 128 <= n1; n += 128) tile_bf16<8, A>(w, K, N, n, xb, y);
    for (; n + 16 <= n1; n += 16) tile_bf16<1, A>(w, K, N, n, xb, y);
    if (n < n1) columns<A>(w, K, N, n, n1, x, y);
    return;
  }
#endif
  columns<A>(w, K, N, n0, n1, x, y);
}

struct Step {
  const float* x;
  std::vector<uint16_t> xb;  // bf16_bits(x), or empty
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
      const uint16_t* xbs[2];
      float* ys[2];
      const int count = mine.size() - a >= 2 ? 2 : 1;
      for (int i = 0; i < count; ++i) {
        xs[i] = x + (mine[a + i] / J) * K;
        xbs[i] = xb.empty() ? nullptr : xb.data() + (mine[a + i] / J) * K;
        ys[i] = y + int64_t(mine[a + i]) * N;
      }
      const uint16_t* const* bits = xb.empty() ? nullptr : xbs;
      if (count == 2) {
        columns_any<2>(experts[unit.first], K, N, n0, n1, xs, bits, ys);
      } else {
        columns_any<1>(experts[unit.first], K, N, n0, n1, xs, bits, ys);
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
  Step step;
  step.x = x.typed_data();
  step.xb = bf16_bits(step.x, x.element_count());
  step.y = y->typed_data();
  step.J = id[1];
  step.K = xd[1];
  step.N = -1;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto w = groups.get<ffi::Buffer<ffi::BF16>>(g);
    if (!w.has_value()) return ffi::Error::InvalidArgument("expert_matvec: weight groups must be bf16");
    auto wd = w->dimensions();
    if (wd.size() != 3 || wd[1] != step.K || (step.N >= 0 && wd[2] != step.N)) {
      return ffi::Error::InvalidArgument("expert_matvec: weight group " + std::to_string(g) +
                                         " must be [E_g, K, N] with x's K and one N");
    }
    step.N = wd[2];
    const uint16_t* base = w->typed_data();
    for (int64_t e = 0; e < wd[0]; ++e) step.experts.push_back(base + e * wd[1] * wd[2]);
  }
  const int64_t E = step.experts.size(), R = xd[0], J = step.J, N = step.N;
  std::memset(step.y, 0, sizeof(float) * R * J * std::max<int64_t>(N, 0));
  step.rows.resize(E);
  const int32_t* route = ids.typed_data();
  for (int64_t i = 0; i < R * J; ++i) {
    if (route[i] >= 0 && route[i] < E) step.rows[route[i]].push_back(i);
  }
  step.chunk = 256;  // a unit of work: one expert's rows over 256 columns
  for (int64_t e = 0; e < E; ++e) {
    if (step.rows[e].empty()) continue;
    for (int64_t n = 0; n < N; n += step.chunk) step.units.emplace_back(e, n);
  }
  int64_t work = 0;
  for (const auto& r : step.rows) work += int64_t(r.size()) * step.K * N;
  parallel_for(pool, step.units.size(), work, [&](int64_t i) { step.run(step.units[i]); });
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

#if defined(__AVX512BF16__)
// dot_rows with bf16 dot-product instructions (AVX512-BF16: 32 products a step, no widening), for x rows
// that are bf16 values (xb: their bits) and K a multiple of 32.
template <int B, int A>
void dot_rows_bf16(const uint16_t* w, int64_t K, int64_t n, const uint16_t* const* xb, float* const* y) {
  __m512 acc[A][B];
  for (int a = 0; a < A; ++a) {
    for (int b = 0; b < B; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + (n + b) * K + k);
    for (int a = 0; a < A; ++a) {
      const __m512i xv = _mm512_loadu_si512(xb[a] + k);
      for (int b = 0; b < B; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int a = 0; a < A; ++a) {
    for (int b = 0; b < B; ++b) y[a][n + b] = _mm512_reduce_add_ps(acc[a][b]);
  }
}
#endif

// matvec_t over the rows of w in [n0, n1): x's rows two at a time, four rows of w at a time, through
// dot_rows_bf16 (X = uint16_t: bf16 bits) or dot_rows (X = float).
template <typename X>
void matvec_t_rows(const uint16_t* w, int64_t K, int64_t N, int64_t R, const X* x, float* y, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < R; r += 2) {
    const X* xr[2] = {x + r * K, x + std::min(r + 1, R - 1) * K};
    float* yr[2] = {y + r * N, y + std::min(r + 1, R - 1) * N};
    const bool two = r + 1 < R;
    for (int64_t n = n0; n < n1;) {
      const int b = n + 4 <= n1 ? 4 : 1;
      if constexpr (std::is_same_v<X, uint16_t>) {
#if defined(__AVX512BF16__)
        if (b == 4) two ? dot_rows_bf16<4, 2>(w, K, n, xr, yr) : dot_rows_bf16<4, 1>(w, K, n, xr, yr);
        else two ? dot_rows_bf16<1, 2>(w, K, n, xr, yr) : dot_rows_bf16<1, 1>(w, K, n, xr, yr);
#endif
      } else {
        if (b == 4) two ? dot_rows<4, 2>(w, K, n, xr, yr) : dot_rows<4, 1>(w, K, n, xr, yr);
        else two ? dot_rows<1, 2>(w, K, n, xr, yr) : dot_rows<1, 1>(w, K, n, xr, yr);
      }
      n += b;
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
#if defined(__AVX512BF16__)
  const std::vector<uint16_t> xb = K % 32 == 0 ? bf16_bits(xs, R * K) : std::vector<uint16_t>();
#else
  const std::vector<uint16_t> xb;
#endif
  parallel_for(pool, (N + chunk - 1) / chunk, R * N * K, [&](int64_t unit) {
    const int64_t n0 = unit * chunk, n1 = std::min(N, n0 + chunk);
    if (!xb.empty()) {
      matvec_t_rows(ws, K, N, R, xb.data(), ys, n0, n1);
    } else {
      matvec_t_rows(ws, K, N, R, xs, ys, n0, n1);
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
