// attnlab's decode matvecs: y (M, N) = x (M, K) · Wᵀ for a few rows of fp32 activations and a
// weight matrix in fp32, per-row int8, or GGUF-style blocks of 32 (4-bit d·q + m, Q8_0 d·q).
// Built on first use by torch.utils.cpp_extension for the CPU it runs on (src/attnlab/nn/matvec.py
// picks -march); the loops are written so the compiler vectorises them: each weight row is read
// once, its products accumulate in LANES independent fp32 lanes (several FMA chains in flight),
// and rows are split over torch's intra-op threads (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTNLAB_AVX2 1
#endif

namespace {

constexpr int64_t LANES = 64;  // independent partial sums: 4 AVX-512 or 8 AVX2 registers

template <class F>
void over_rows(int64_t n, int64_t row_bytes, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(i);
  });
}

inline float hsum(const float* a, int64_t n) {
  float s = 0.f;
  for (int64_t j = 0; j < n; ++j) s += a[j];
  return s;
}

// Σ_k w[k]·x[k] for a row of weights of type T (float or int8), fp32 sums
template <class T>
inline float dot(const T* w, const float* x, int64_t k) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
#pragma omp simd
    for (int64_t j = 0; j < LANES; ++j) acc[j] += static_cast<float>(w[i + j]) * x[i + j];
  }
  float s = hsum(acc, LANES);
  for (; i < k; ++i) s += static_cast<float>(w[i]) * x[i];
  return s;
}

#ifdef ATTNLAB_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
// 8 int8 / uint8 at p as 8 floats
inline __m256 s8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

#if defined(__AVX512F__)
// the same over 16 lanes: one widening per 16 nibbles instead of two per 8
inline float q4_row512(const uint8_t* pr, const float* dr, const float* x, int64_t g) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(15);
  for (int64_t b = 0; b < g; ++b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pr + b * 16));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
    const __m512 t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + b * 32 + 16),
                                     _mm512_mul_ps(lo, _mm512_loadu_ps(x + b * 32)));
    if (b & 1)
      a1 = _mm512_fmadd_ps(t, _mm512_set1_ps(dr[b]), a1);
    else
      a0 = _mm512_fmadd_ps(t, _mm512_set1_ps(dr[b]), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#endif

// Σ_g d_g Σ_j q_gj x_gj over the 4-bit blocks of one row
inline float q4_row(const uint8_t* pr, const float* dr, const float* x, int64_t g) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(15);
  for (int64_t b = 0; b < g; ++b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pr + b * 16));
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const float* xb = x + b * 32;
    __m256 t = _mm256_mul_ps(u8x8(lo), _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(u8x8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), t);
    __m256 u = _mm256_mul_ps(u8x8(hi), _mm256_loadu_ps(xb + 16));
    u = _mm256_fmadd_ps(u8x8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), u);
    const __m256 db = _mm256_set1_ps(dr[b]);
    a0 = _mm256_fmadd_ps(t, db, a0);
    a1 = _mm256_fmadd_ps(u, db, a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// Σ_g d_g Σ_j q_gj x_gj over the Q8_0 blocks of one row
inline float q8_row(const int8_t* qr, const float* dr, const float* x, int64_t g) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    const int8_t* qb = qr + b * 32;
    const float* xb = x + b * 32;
    __m256 t = _mm256_mul_ps(s8x8(qb), _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(s8x8(qb + 8), _mm256_loadu_ps(xb + 8), t);
    __m256 u = _mm256_mul_ps(s8x8(qb + 16), _mm256_loadu_ps(xb + 16));
    u = _mm256_fmadd_ps(s8x8(qb + 24), _mm256_loadu_ps(xb + 24), u);
    const __m256 db = _mm256_set1_ps(dr[b]);
    a0 = _mm256_fmadd_ps(t, db, a0);
    a1 = _mm256_fmadd_ps(u, db, a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// Σ_k w_k x_k, fp32 w: four chains of 8 (or 16) lanes
inline float f32_row(const float* w, const float* x, int64_t k) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps(),
         b3 = _mm512_setzero_ps();
  for (; i + 64 <= k; i += 64) {
    b0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), b0);
    b1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), b1);
    b2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x + i + 32), b2);
    b3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x + i + 48), b3);
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3)));
#else
  float s = 0.f;
#endif
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
         a3 = _mm256_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  s += hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < k; ++i) s += w[i] * x[i];
  return s;
}

// Σ_k q_k x_k, int8 q
inline float i8_row(const int8_t* q, const float* x, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
         a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    a0 = _mm256_fmadd_ps(s8x8(q + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(s8x8(q + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(s8x8(q + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(s8x8(q + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < k; ++i) s += static_cast<float>(q[i]) * x[i];
  return s;
}
#endif

// one row of blocks as fp32: w = d·q + m (4-bit) and w = d·q (Q8_0), the same rounding as torch's
inline void q4_values(const uint8_t* pr, const float* dr, const float* mr, int64_t g, float* w) {
  for (int64_t b = 0; b < g; ++b) {
    const uint8_t* pb = pr + b * 16;
    float* wb = w + b * 32;
    const float db = dr[b], mb = mr[b];
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      wb[j] = static_cast<float>(pb[j] & 15) * db + mb;
      wb[j + 16] = static_cast<float>(pb[j] >> 4) * db + mb;
    }
  }
}

inline void q8_values(const int8_t* qr, const float* dr, int64_t g, float* w) {
  for (int64_t b = 0; b < g; ++b) {
    const float db = dr[b];
#pragma omp simd
    for (int j = 0; j < 32; ++j) w[b * 32 + j] = static_cast<float>(qr[b * 32 + j]) * db;
  }
}

inline float row_dot(const float* w, const float* x, int64_t k) {
#ifdef ATTNLAB_AVX2
  return f32_row(w, x, k);
#else
  return dot(w, x, k);
#endif
}

void check(const torch::Tensor& x, int64_t k, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kFloat &&
                  x.is_contiguous() && x.device().is_cpu(),
              what, ": x must be a contiguous fp32 CPU (M, K) tensor with K = ", k);
}

}  // namespace

torch::Tensor mv_f32(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.device().is_cpu(), "mv_f32: w");
  const int64_t n = w.size(0), k = w.size(1);
  check(x, k, "mv_f32");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k * 4, [&](int64_t r) {
    for (int64_t i = 0; i < m; ++i) {
#ifdef ATTNLAB_AVX2
      yp[i * n + r] = f32_row(wp + r * k, xp + i * k, k);
#else
      yp[i * n + r] = dot(wp + r * k, xp + i * k, k);
#endif
    }
  });
  return y;
}

torch::Tensor mv_int8(torch::Tensor x, torch::Tensor q, torch::Tensor s) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous() && q.device().is_cpu(), "mv_int8: q");
  const int64_t n = q.size(0), k = q.size(1);
  check(x, k, "mv_int8");
  const int64_t m = x.size(0);
  TORCH_CHECK(s.numel() == n && s.scalar_type() == torch::kFloat && s.is_contiguous() && s.device().is_cpu(), "mv_int8: s");
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k, [&](int64_t r) {
    for (int64_t i = 0; i < m; ++i) {
#ifdef ATTNLAB_AVX2
      yp[i * n + r] = i8_row(qp + r * k, xp + i * k, k) * sp[r];
#else
      yp[i * n + r] = dot(qp + r * k, xp + i * k, k) * sp[r];
#endif
    }
  });
  return y;
}

// 4-bit blocks: p (N, G, 16) uint8 (element j low nibble, j + 16 high), d, m (N, G) fp32
torch::Tensor mv_q4(torch::Tensor x, torch::Tensor p, torch::Tensor d, torch::Tensor mn) {
  TORCH_CHECK(p.dim() == 3 && p.size(2) == 16 && p.scalar_type() == torch::kByte && p.is_contiguous() && p.device().is_cpu(),
              "mv_q4: p");
  const int64_t n = p.size(0), g = p.size(1), k = g * 32;
  check(x, k, "mv_q4");
  const int64_t m = x.size(0);
  TORCH_CHECK(d.numel() == n * g && mn.numel() == n * g && d.is_contiguous() && d.device().is_cpu() && mn.is_contiguous() && mn.device().is_cpu() &&
                  d.scalar_type() == torch::kFloat && mn.scalar_type() == torch::kFloat,
              "mv_q4: d, m");
  auto y = torch::empty({m, n}, x.options());
  auto xs = x.view({m, g, 32}).sum(-1).contiguous();  // (M, G): Σ_j x per block, for the m term
  const float *xp = x.data_ptr<float>(), *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  const float* sp = xs.data_ptr<float>();
  const uint8_t* pp = p.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k / 2 + g * 8, [&](int64_t r) {
    const uint8_t* pr = pp + r * g * 16;
    const float *dr = dp + r * g, *mr = mp + r * g;
    if (m > 1) {  // several rows: the weight row dequantized once, then an fp32 dot per row
      thread_local std::vector<float> buf;
      buf.resize(k);
      q4_values(pr, dr, mr, g, buf.data());
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_dot(buf.data(), xp + i * k, k);
      return;
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = xp + i * k;
#ifdef ATTNLAB_AVX2
#if defined(__AVX512F__)
      yp[i * n + r] = q4_row512(pr, dr, xi, g) + dot(mr, sp + i * g, g);
#else
      yp[i * n + r] = q4_row(pr, dr, xi, g) + dot(mr, sp + i * g, g);
#endif
      continue;
#endif
      float acc[16] = {0.f};
      for (int64_t b = 0; b < g; ++b) {
        const uint8_t* pb = pr + b * 16;
        const float* xb = xi + b * 32;
        const float db = dr[b];
#pragma omp simd
        for (int j = 0; j < 16; ++j)
          acc[j] += db * (static_cast<float>(pb[j] & 15) * xb[j] +
                          static_cast<float>(pb[j] >> 4) * xb[j + 16]);
      }
      yp[i * n + r] = hsum(acc, 16) + dot(mr, sp + i * g, g);
    }
  });
  return y;
}

// Q8_0 blocks: q (N, G, 32) int8, d (N, G) fp32
torch::Tensor mv_q8(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 32 && q.scalar_type() == torch::kChar && q.is_contiguous() && q.device().is_cpu(),
              "mv_q8: q");
  const int64_t n = q.size(0), g = q.size(1), k = g * 32;
  check(x, k, "mv_q8");
  const int64_t m = x.size(0);
  TORCH_CHECK(d.numel() == n * g && d.is_contiguous() && d.device().is_cpu() && d.scalar_type() == torch::kFloat, "mv_q8: d");
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *dp = d.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  over_rows(n, k + g * 4, [&](int64_t r) {
    const int8_t* qr = qp + r * k;
    const float* dr = dp + r * g;
    if (m > 1) {
      thread_local std::vector<float> buf;
      buf.resize(k);
      q8_values(qr, dr, g, buf.data());
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = row_dot(buf.data(), xp + i * k, k);
      return;
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = xp + i * k;
#ifdef ATTNLAB_AVX2
      yp[i * n + r] = q8_row(qr, dr, xi, g);
      continue;
#endif
      float acc[32] = {0.f};
      for (int64_t b = 0; b < g; ++b) {
        const int8_t* qb = qr + b * 32;
        const float* xb = xi + b * 32;
        const float db = dr[b];
#pragma omp simd
        for (int j = 0; j < 32; ++j) acc[j] += db * (static_cast<float>(qb[j]) * xb[j]);
      }
      yp[i * n + r] = hsum(acc, 32);
    }
  });
  return y;
}

// the whole matrix dequantized in one pass (a prefill's weights, for torch's GEMM):
// 4-bit blocks -> (N, G*32) fp32, w = d·q + m
torch::Tensor dequant_q4(torch::Tensor p, torch::Tensor d, torch::Tensor mn) {
  TORCH_CHECK(p.dim() == 3 && p.size(2) == 16 && p.scalar_type() == torch::kByte && p.is_contiguous() && p.device().is_cpu(),
              "dequant_q4: p");
  const int64_t n = p.size(0), g = p.size(1);
  TORCH_CHECK(d.numel() == n * g && mn.numel() == n * g && d.is_contiguous() && d.device().is_cpu() && mn.is_contiguous() && mn.device().is_cpu() &&
                  d.scalar_type() == torch::kFloat && mn.scalar_type() == torch::kFloat,
              "dequant_q4: d, m");
  auto w = torch::empty({n, g * 32}, d.options());
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = mn.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  over_rows(n, g * 16, [&](int64_t r) { q4_values(pp + r * g * 16, dp + r * g, mp + r * g, g, wp + r * g * 32); });
  return w;
}

// Q8_0 blocks -> (N, G*32) fp32, w = d·q
torch::Tensor dequant_q8(torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 32 && q.scalar_type() == torch::kChar && q.is_contiguous() && q.device().is_cpu(),
              "dequant_q8: q");
  const int64_t n = q.size(0), g = q.size(1);
  TORCH_CHECK(d.numel() == n * g && d.is_contiguous() && d.device().is_cpu() && d.scalar_type() == torch::kFloat, "dequant_q8: d");
  auto w = torch::empty({n, g * 32}, d.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  over_rows(n, g * 32, [&](int64_t r) { q8_values(qp + r * g * 32, dp + r * g, g, wp + r * g * 32); });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("dequant_q4", &dequant_q4);
  mod.def("dequant_q8", &dequant_q8);
  mod.def("mv_f32", &mv_f32);
  mod.def("mv_int8", &mv_int8);
  mod.def("mv_q4", &mv_q4);
  mod.def("mv_q8", &mv_q8);
}
