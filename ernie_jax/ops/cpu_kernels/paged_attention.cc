// Paged decode attention (one query token per sequence) over a bf16 KV page pool, for XLA:CPU through jax.ffi
// (ops/cpu_kernels/attention.py).
//
//   q [B, N, D] f32, k_pool, v_pool [P, page, K, D] bf16 bits (u16), tables [B, n] s32, positions [B] s32
//   -> out [B, N, D] f32
//
// Query head h reads KV head h / (N / K). Key slot j of row b is page tables[b, j / page], slot j % page,
// and is visible iff j <= positions[b]; a row at a negative position (padding) gets zeros. The math is the
// XLA reference's (ops/paged_attention/reference.py) block by block: an online softmax over blocks of
// `block_slots` slots, scores as f32 sums of exact bf16 products scaled by D^-1/2, each block's weights
// rounded to bf16 before they multiply the values, the denominator summed from the unrounded weights. XLA's
// forms gather every block's slots into new arrays and run a dozen small operations per block; here a
// (sequence, KV head) pair reads its slots in place, once.
#include <cmath>
#include <string>
#include <vector>

#include "common.h"

using namespace ernie_jax;  // ffi, the vectors, widen, lane_sums, parallel_for

namespace {

// exp(x) for x <= 0, 16 at a time (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), 0 below
// -87 (where the f32 result would be subnormal).
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 low = x < -87.0f ? f32x16{} + 1.0f : f32x16{};
  x = x < -87.0f ? f32x16{} - 87.0f : x;
  f32x16 fx = x * 1.44269504088896341f + 0.5f;
  i32x16 n = __builtin_convertvector(fx, i32x16);
  n -= (__builtin_convertvector(n, f32x16) > fx) ? i32x16{} + 1 : i32x16{};  // floor
  const f32x16 nf = __builtin_convertvector(n, f32x16);
  const f32x16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  f32x16 y = p * r * r + r + 1.0f;
  i32x16 bits = (n + 127) << 23;
  f32x16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  y *= two_n;
  return low > 0.0f ? f32x16{} : y;
}

inline float round_to_bf16(float f) {  // round to nearest even, as XLA's convert does (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One (sequence, KV head) pair: its R query heads q [R, D] (D = 16 DV) over the key slots whose D values
// start at k/v + at[j], j < count -> o [R, D].
template <int DV>
void attend(const float* q, int64_t R, const uint16_t* ks, const uint16_t* vs, const int64_t* at, int64_t count,
            int64_t block_slots, float scale, float* o) {
  constexpr int64_t D = 16 * DV;
  std::vector<f32x16> qv(R * DV), part(R * 16), acc(R * DV, f32x16{}), block(R * DV);
  std::memcpy(qv.data(), q, sizeof(float) * R * D);
  std::vector<float> m(R, -1e30f), denom(R, 0.f), s(R * (block_slots + 16));
  for (int64_t start = 0; start < count; start += block_slots) {
    const int64_t stop = std::min(count, start + block_slots), width = stop - start;
    // scores, 16 slots at a time: each slot's keys widened once for all R heads
    for (int64_t c = 0; c < width; c += 16) {
      const int64_t slots = std::min<int64_t>(16, width - c);
      for (int64_t jj = 0; jj < 16; ++jj) {
        if (jj >= slots) {
          for (int64_t r = 0; r < R; ++r) part[r * 16 + jj] = f32x16{};
          continue;
        }
        f32x16 kv[DV];
        for (int dv = 0; dv < DV; ++dv) kv[dv] = widen(ks + at[start + c + jj] + 16 * dv);
        for (int64_t r = 0; r < R; ++r) {
          f32x16 t = qv[r * DV] * kv[0];
          for (int dv = 1; dv < DV; ++dv) t += qv[r * DV + dv] * kv[dv];
          part[r * 16 + jj] = t;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        f32x16 sums = lane_sums(part.data() + r * 16) * scale;
        std::memcpy(s.data() + r * (block_slots + 16) + c, &sums, sizeof sums);  // lanes past `slots`: unused
      }
    }
    // the online softmax's update, per head
    std::vector<float> e(R * width);
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.data() + r * (block_slots + 16);
      float m_new = m[r];
      for (int64_t j = 0; j < width; ++j) m_new = std::max(m_new, sr[j]);
      const float alpha = std::exp(m[r] - m_new);
      for (int64_t j = 0; j < width; j += 16) {  // sr has room for a whole last vector
        f32x16 v;
        std::memcpy(&v, sr + j, sizeof v);
        v = exp_nonpositive(v - m_new);
        std::memcpy(sr + j, &v, sizeof v);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < width; ++j) sum += sr[j];
      denom[r] = denom[r] * alpha + sum;
      m[r] = m_new;
      for (int dv = 0; dv < DV; ++dv) acc[r * DV + dv] *= alpha;
      for (int64_t j = 0; j < width; ++j) e[r * width + j] = round_to_bf16(sr[j]);
    }
    // the block's weighted values (each slot's values widened once), then added, as the reference adds them
    std::fill(block.begin(), block.end(), f32x16{});
    for (int64_t j = 0; j < width; ++j) {
      f32x16 vv[DV];
      for (int dv = 0; dv < DV; ++dv) vv[dv] = widen(vs + at[start + j] + 16 * dv);
      for (int64_t r = 0; r < R; ++r) {
        const float w = e[r * width + j];
        for (int dv = 0; dv < DV; ++dv) block[r * DV + dv] += w * vv[dv];
      }
    }
    for (int64_t i = 0; i < R * DV; ++i) acc[i] += block[i];
  }
  for (int64_t r = 0; r < R; ++r) {
    const float d = std::max(denom[r], 1e-30f);
    for (int dv = 0; dv < DV; ++dv) {
      f32x16 v = acc[r * DV + dv] / d;
      std::memcpy(o + r * D + 16 * dv, &v, sizeof v);
    }
  }
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> k_pool,
                                    ffi::Buffer<ffi::U16> v_pool, ffi::Buffer<ffi::S32> tables,
                                    ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out,
                                    int64_t block_slots) {
  auto qd = q.dimensions(), pd = k_pool.dimensions(), vd = v_pool.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || vd.size() != 4 || td.size() != 2 || td[0] != qd[0] || pd[3] != qd[2] ||
      !std::equal(pd.begin(), pd.end(), vd.begin()) || positions.element_count() != qd[0] || qd[1] % pd[2] != 0 ||
      block_slots < 1 || !(qd[2] == 16 || qd[2] == 32 || qd[2] == 64 || qd[2] == 128)) {
    return ffi::Error::InvalidArgument(
        "paged_decode_attention: expected q [B, N, D], pools [P, page, K, D] with K dividing N and D one of 16, "
        "32, 64, 128, tables [B, n], positions [B] and block_slots >= 1");
  }
  const int64_t B = qd[0], N = qd[1], D = qd[2], P = pd[0], page = pd[1], K = pd[2], n = td[1], R = N / K;
  const float scale = 1.0f / std::sqrt(float(D));
  const float* qs = q.typed_data();
  const uint16_t *ks = k_pool.typed_data(), *vs = v_pool.typed_data();
  const int32_t *tab = tables.typed_data(), *pos = positions.typed_data();
  float* os = out->typed_data();
  for (int64_t b = 0; b < B; ++b) {  // the pages a row reads must lie in the pool (the rest are never read)
    const int64_t last = std::min<int64_t>(pos[b], n * page - 1);
    for (int64_t i = 0; last >= 0 && i <= last / page; ++i) {
      if (tab[b * n + i] < 0 || tab[b * n + i] >= P) {
        return ffi::Error::InvalidArgument("paged_decode_attention: row " + std::to_string(b) + "'s block table names page " +
                                           std::to_string(tab[b * n + i]) + ", outside the pool of " + std::to_string(P));
      }
    }
  }
  int64_t work = 0;  // a query head's multiply-adds over its visible slots, keys and values
  for (int64_t b = 0; b < B; ++b) work += N * 2 * D * (std::min<int64_t>(pos[b], n * page - 1) + 1);
  parallel_for(pool, B * K, work, [&](int64_t unit) {
    const int64_t b = unit / K, g = unit % K;
    float* o = os + (b * N + g * R) * D;  // this group's R query heads, adjacent
    const int64_t last = std::min<int64_t>(pos[b], n * page - 1);
    if (last < 0) {
      std::fill(o, o + R * D, 0.f);
      return;
    }
    std::vector<int64_t> at(last + 1);  // where each visible slot's D values start
    for (int64_t j = 0, i = 0; j <= last; j += page, ++i) {
      const int64_t base = (int64_t(tab[b * n + i]) * page * K + g) * D;
      for (int64_t t = 0; t < page && j + t <= last; ++t) at[j + t] = base + t * K * D;
    }
    const float* qg = qs + (b * N + g * R) * D;
    switch (D / 16) {
      case 1: attend<1>(qg, R, ks, vs, at.data(), last + 1, block_slots, scale, o); break;
      case 2: attend<2>(qg, R, ks, vs, at.data(), last + 1, block_slots, scale, o); break;
      case 4: attend<4>(qg, R, ks, vs, at.data(), last + 1, block_slots, scale, o); break;
      case 8: attend<8>(qg, R, ks, vs, at.data(), last + 1, block_slots, scale, o); break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ErnieJaxPagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_slots"));
