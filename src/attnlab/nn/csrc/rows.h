// The row-level pieces of attnlab's decode kernels: one weight row (fp32, int8, 4-bit or Q8_0
// blocks of 32) times fp32 activations, and the threaded loop over rows. Shared by the tensor-level
// matvecs (matvec.cpp) and the whole decode step (step.cpp); see src/attnlab/nn/matvec.py.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTNLAB_AVX2 1
#endif

namespace attnlab {


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

// Σ_g d_g Σ_j q_gj x_gj over the Q8_0 blocks of one row. H: scales per block of 32, 1 (Q8_0) or
// 2 (one per 16, Q6_K's): elements 0-15 of block b take dr[b·H], 16-31 dr[b·H + H − 1]
template <int H>
inline float q8_row(const int8_t* qr, const float* dr, const float* x, int64_t g) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < g; ++b) {
    const int8_t* qb = qr + b * 32;
    const float* xb = x + b * 32;
    __m256 t = _mm256_mul_ps(s8x8(qb), _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(s8x8(qb + 8), _mm256_loadu_ps(xb + 8), t);
    __m256 u = _mm256_mul_ps(s8x8(qb + 16), _mm256_loadu_ps(xb + 16));
    u = _mm256_fmadd_ps(s8x8(qb + 24), _mm256_loadu_ps(xb + 24), u);
    a0 = _mm256_fmadd_ps(t, _mm256_set1_ps(dr[b * H]), a0);
    a1 = _mm256_fmadd_ps(u, _mm256_set1_ps(dr[b * H + H - 1]), a1);
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

template <int H>
inline void q8_values(const int8_t* qr, const float* dr, int64_t g, float* w) {
  for (int64_t b = 0; b < g; ++b) {
    const float d0 = dr[b * H], d1 = dr[b * H + H - 1];
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      w[b * 32 + j] = static_cast<float>(qr[b * 32 + j]) * d0;
      w[b * 32 + j + 16] = static_cast<float>(qr[b * 32 + j + 16]) * d1;
    }
  }
}

inline float row_dot(const float* w, const float* x, int64_t k) {
#ifdef ATTNLAB_AVX2
  return f32_row(w, x, k);
#else
  return dot(w, x, k);
#endif
}

// Σ a_i b_i over a short vector (a row's G block terms): one 8-lane chain, so a row pays ~n/8
// FMAs instead of `dot`'s 64-lane reduction (a serial chain of 64 adds, ~200 cycles per row)
inline float short_dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef ATTNLAB_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum8(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// one output of the 4-bit blocks of a row: Σ_g d_g Σ_j q_gj x_gj + Σ_g m_g xs_g, with xs the
// per-block sums of x (the m term)
inline float row_q4(const uint8_t* pr, const float* dr, const float* mr, const float* x,
                    const float* xs, int64_t g) {
#ifdef ATTNLAB_AVX2
#if defined(__AVX512F__)
  return q4_row512(pr, dr, x, g) + short_dot(mr, xs, g);
#else
  return q4_row(pr, dr, x, g) + short_dot(mr, xs, g);
#endif
#else
  float acc[16] = {0.f};
  for (int64_t b = 0; b < g; ++b) {
    const uint8_t* pb = pr + b * 16;
    const float* xb = x + b * 32;
    const float db = dr[b];
#pragma omp simd
    for (int j = 0; j < 16; ++j)
      acc[j] += db * (static_cast<float>(pb[j] & 15) * xb[j] +
                      static_cast<float>(pb[j] >> 4) * xb[j + 16]);
  }
  return hsum(acc, 16) + short_dot(mr, xs, g);
#endif
}

// one output of a row of Q8_0 blocks (H scales per block: q8_row)
template <int H>
inline float row_q8(const int8_t* qr, const float* dr, const float* x, int64_t g) {
#ifdef ATTNLAB_AVX2
  return q8_row<H>(qr, dr, x, g);
#else
  float acc[32] = {0.f};
  for (int64_t b = 0; b < g; ++b) {
    const int8_t* qb = qr + b * 32;
    const float* xb = x + b * 32;
    const float d0 = dr[b * H], d1 = dr[b * H + H - 1];
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      acc[j] += d0 * (static_cast<float>(qb[j]) * xb[j]);
      acc[j + 16] += d1 * (static_cast<float>(qb[j + 16]) * xb[j + 16]);
    }
  }
  return hsum(acc, 32);
#endif
}

// one output of an int8 row (its scale applied by the caller)
inline float row_i8(const int8_t* q, const float* x, int64_t k) {
#ifdef ATTNLAB_AVX2
  return i8_row(q, x, k);
#else
  return dot(q, x, k);
#endif
}

// per-block sums of x (K = 32·G): the 4-bit kernels' m term
inline void block_sums(const float* x, int64_t g, float* xs) {
  for (int64_t b = 0; b < g; ++b) xs[b] = hsum(x + b * 32, 32);
}


// ---- int8 activations (llama.cpp's scheme for its 4-bit and Q8_0 dot products) ---------------
// x is quantized in blocks of 32, as the weights are: x ≈ dx_b · xq_bj with dx_b = max_j |x_bj| / 127
// and xq = round(x / dx) (half to even, torch.round's rule); xs_b = Σ_j x_bj exactly in fp32 (the
// 4-bit m term uses the true sums). The block's dot product is then an integer one, 32 u8×s8
// products summed in int32 by one instruction (VNNI's vpdpbusd, or AVX2's vpmaddubsw +
// vpmaddwd): far fewer instructions per weight than widening every nibble to fp32.
inline void quantize_blocks(const float* x, int64_t g, int8_t* xq, float* dx, float* xs) {
  for (int64_t b = 0; b < g; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f;
    for (int j = 0; j < 32; ++j) xq[b * 32 + j] = d == 0.f ? 0 : static_cast<int8_t>(std::nearbyint(xb[j] / d));
    dx[b] = d;
    xs[b] = hsum(xb, 32);
  }
}

#ifdef ATTNLAB_AVX2
// Σ over groups of 4 of u8 × s8 products, as 8 int32 lanes (the u8 operand at most 127 per byte
// pair sum: vpmaddubsw cannot saturate here, |q| ≤ 15 or 127 and |x| ≤ 127)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i nibbles(const uint8_t* p) {  // 16 bytes -> 32 values: j low nibbles, then j + 16 high
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}
#endif

// Σ_g d_g dx_g Σ_j q_gj xq_gj + Σ_g m_g xs_g: one output of 4-bit blocks with int8 activations
inline float row_q4_x8(const uint8_t* pr, const float* dr, const float* mr, const int8_t* xq,
                       const float* dx, const float* xs, int64_t g) {
#ifdef ATTNLAB_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256 acc) {  // acc + d_b·dx_b · Σ_j q_bj xq_bj, 8 partial sums
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(nibbles(pr + b * 16), x)), _mm256_set1_ps(dr[b] * dx[b]), acc);
  };
  int64_t b = 0;
  for (; b + 2 <= g; b += 2) {
    a0 = block(b, a0);
    a1 = block(b + 1, a1);
  }
  if (b < g) a0 = block(b, a0);
  return hsum8(_mm256_add_ps(a0, a1)) + short_dot(mr, xs, g);
#else
  float s = 0.f;
  for (int64_t b = 0; b < g; ++b) {
    int32_t acc = 0;
    for (int j = 0; j < 16; ++j)
      acc += (pr[b * 16 + j] & 15) * xq[b * 32 + j] + (pr[b * 16 + j] >> 4) * xq[b * 32 + j + 16];
    s += static_cast<float>(acc) * (dr[b] * dx[b]);
  }
  return s + short_dot(mr, xs, g);
#endif
}

// Σ_g d_g dx_g Σ_j q_gj xq_gj: one output of Q8_0 blocks with int8 activations (H: q8_row)
template <int H>
inline float row_q8_x8(const int8_t* qr, const float* dr, const int8_t* xq, const float* dx, int64_t g) {
#ifdef ATTNLAB_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  auto block = [&](int64_t b, __m256 acc) {  // acc + d_b·dx_b · Σ_j q_bj xq_bj, 8 partial sums
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + b * 32));
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    // u8 × s8 wants an unsigned operand: |q| times x carrying q's sign
    const __m256i p = dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
    // lanes 0-3 hold bytes 0-15, lanes 4-7 bytes 16-31
    const __m256 s = H == 1 ? _mm256_set1_ps(dr[b] * dx[b])
                            : _mm256_set_m128(_mm_set1_ps(dr[b * H + 1] * dx[b]), _mm_set1_ps(dr[b * H] * dx[b]));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc);
  };
  int64_t b = 0;
  for (; b + 2 <= g; b += 2) {
    a0 = block(b, a0);
    a1 = block(b + 1, a1);
  }
  if (b < g) a0 = block(b, a0);
  return hsum8(_mm256_add_ps(a0, a1));
#else
  float s = 0.f;
  for (int64_t b = 0; b < g; ++b) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < 16; ++j) {
      lo += qr[b * 32 + j] * xq[b * 32 + j];
      hi += qr[b * 32 + j + 16] * xq[b * 32 + j + 16];
    }
    if (H == 1)
      s += static_cast<float>(lo + hi) * (dr[b] * dx[b]);
    else
      s += static_cast<float>(lo) * (dr[b * H] * dx[b]) + static_cast<float>(hi) * (dr[b * H + H - 1] * dx[b]);
  }
  return s;
#endif
}

}  // namespace attnlab
