// The vector helpers every kernel family shares: the ISA switches (OCTAVO_AVX2, OCTAVO_AVX512,
// set from the compiler's -march=native), widening loads of float32 and bfloat16, horizontal
// sums, a vectorised exp, and the max / exp-and-sum passes of a softmax. Header-only: each
// kernel file includes it and the compiler inlines what it uses.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OCTAVO_AVX2 1
#if defined(__AVX512F__)
#define OCTAVO_AVX512 1  // 16-float vectors in packed_linear's tiles and decode attention
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define OCTAVO_AVX512BF16 1  // bfloat16 pair dot products (vdpbf16ps) and roundings
#endif
#endif
#endif

namespace octavo {
// Internal linkage in every file that includes it, as for a file's own helpers: the compiler
// inlines and specialises them per kernel file.
namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef OCTAVO_AVX2
// Asks for the cache line at p to be brought into L1 (kLevel 0) or L2 (kLevel 1), as
// _mm_prefetch does, but in a form the compiler keeps. GCC counts _mm_prefetch as free of side
// effects, so a helper made only of prefetches is found pure and a call to it, whose result is
// unused, is deleted: decode attention's prefetch helpers compiled to nothing that way. A
// volatile asm statement is never deleted.
template <int kLevel>
inline void prefetch_line(const void* p) {
  static_assert(kLevel == 0 || kLevel == 1, "prefetcht0 or prefetcht1");
  if constexpr (kLevel == 0) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift into place.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#ifdef OCTAVO_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// 32 bfloat16 values at p, 64 bytes, widened without a shuffle: the low halves of the 32-bit
// words (elements 0, 2, ..., 30) shifted into place, the high halves (1, 3, ..., 31) masked.
inline void load_split32(const c10::BFloat16* p, __m512& low, __m512& high) {
  const __m512i raw = _mm512_loadu_si512(p);
  low = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  high = _mm512_castsi512_ps(
      _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#ifdef OCTAVO_AVX512BF16
// Two vectors of floats as 32 bfloat16 (lo first), rounded to nearest even (c10::BFloat16's
// rounding, in one instruction).
inline __m512i to_bf16(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
// The n floats at src as bfloat16 at dst, the same rounding (32 at a time, then one by one).
inline void to_bf16_row(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t e = 0;
  for (; e + 32 <= n; e += 32) {
    _mm512_storeu_si512(dst + e, to_bf16(_mm512_loadu_ps(src + e), _mm512_loadu_ps(src + e + 16)));
  }
  for (; e < n; ++e) dst[e] = c10::BFloat16(src[e]);
}
#endif
// The two halves of v added: the same sum in eight lanes.
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}
// The lane operations exp_nonpositive needs, for eight and for sixteen lanes, so that one body
// serves both widths (and gives the same values lane for lane).
template <typename V>
struct Lanes;
template <>
struct Lanes<__m256> {
  static __m256 set1(float v) { return _mm256_set1_ps(v); }
  static __m256 max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
  static __m256 round(__m256 x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // p * 2^n for whole-number n.
  static __m256 scale_pow2(__m256 p, __m256 n) {
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};
#ifdef OCTAVO_AVX512
template <>
struct Lanes<__m512> {
  static __m512 set1(float v) { return _mm512_set1_ps(v); }
  static __m512 max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
  static __m512 round(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static __m512 scale_pow2(__m512 p, __m512 n) {
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  }
};
#endif
// Where exp_nonpositive clamps its argument: exp(-87.3) ~ 1.2e-38, near the smallest normal
// float, so anything below comes out as that, not as 0.
constexpr float kExpFloor = -87.3f;
// exp for x <= 0 (softmax after subtracting the max): Cephes' range reduction to
// 2^n * exp(r), |r| <= ln2 / 2, and its degree-5 polynomial; relative error ~2e-7.
template <typename V>
inline V exp_nonpositive(V x) {
  using L = Lanes<V>;
  x = L::max(x, L::set1(kExpFloor));
  const V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  V r = L::fnmadd(n, L::set1(0.693359375f), x);
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  V p = L::set1(1.9875691500e-4f);
  p = L::fmadd(p, r, L::set1(1.3981999507e-3f));
  p = L::fmadd(p, r, L::set1(8.3334519073e-3f));
  p = L::fmadd(p, r, L::set1(4.1665795894e-2f));
  p = L::fmadd(p, r, L::set1(1.6666665459e-1f));
  p = L::fmadd(p, r, L::set1(5.0000001201e-1f));
  p = L::fmadd(p, L::mul(r, r), L::add(r, L::set1(1.f)));
  return L::scale_pow2(p, n);
}
// exp for any x: large arguments are clamped where the result still fits a float (~2e38).
inline __m256 exp_any(__m256 x) { return exp_nonpositive(_mm256_min_ps(x, _mm256_set1_ps(88.3f))); }
#ifdef OCTAVO_AVX512
inline __m512 exp_any(__m512 x) { return exp_nonpositive(_mm512_min_ps(x, _mm512_set1_ps(88.3f))); }
#endif
#endif

// The largest of s[0, n) (-inf for none), in vector lanes: a scalar std::max loop is one
// dependent chain, which the compiler may not reorder into lanes.
inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#ifdef OCTAVO_AVX512
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(s);
    for (t = 16; t + 16 <= n; t += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(s + t));
    m = _mm512_reduce_max_ps(v);
  }
#endif
#ifdef OCTAVO_AVX2
  if (n - t >= 8) {
    __m256 v = _mm256_max_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m));
    for (t += 8; t + 8 <= n; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

// s[t] <- exp(s[t] - max_score) for t < n; returns their sum. Below kExpFloor the vector lanes
// give 0, as std::exp does (within a denormal) for the tail: a score at -inf gets exactly 0.
inline float exp_shifted_sum(float* s, int64_t n, float max_score) {
  int64_t t = 0;
  float sum = 0.f;
#ifdef OCTAVO_AVX512
  const __m512 m16 = _mm512_set1_ps(max_score), floor16 = _mm512_set1_ps(kExpFloor);
  __m512 acc16 = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(s + t), m16);
    const __m512 e =
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, floor16, _CMP_GE_OQ), exp_nonpositive(d));
    _mm512_storeu_ps(s + t, e);
    acc16 = _mm512_add_ps(acc16, e);
  }
  sum = _mm512_reduce_add_ps(acc16);
#endif
#ifdef OCTAVO_AVX2
  const __m256 m = _mm256_set1_ps(max_score), floor = _mm256_set1_ps(kExpFloor);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(s + t), m);
    const __m256 e = _mm256_and_ps(exp_nonpositive(d), _mm256_cmp_ps(d, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum += hsum(acc);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - max_score);
    sum += s[t];
  }
  return sum;
}


}  // namespace
}  // namespace octavo
