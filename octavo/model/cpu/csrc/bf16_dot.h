// AVX512-BF16's pair dot products (vdpbf16ps) as a register-tiled matmul: rows of bfloat16 x
// against 32 output columns of an operand stored in pairs of k, the layout AMX tiles read too.
// tiles_linear.cpp multiplies decode batches by weights with it, prefill_attention.cpp a prompt
// chunk's queries by its keys and its softmax weights by its values.

#pragma once

#include <cstring>

#include "simd.h"

#ifdef OCTAVO_AVX512BF16

namespace octavo {
// Internal linkage in every file that includes it, as for a file's own helpers.
namespace {

constexpr int kDotRows = 12;       // rows of x per register tile: 24 accumulators + 2 operands + x
constexpr int64_t kDotColumns = 32;  // output columns of a call: two vectors of 16 floats
constexpr int64_t kDotPairs = 16;    // pairs of k per slice (32 values of k)

// Where an operand in pairs of k keeps the vector of 16 columns x one pair of k: columns
// 16 h .. 16 h + 15 (h = 0, 1) at pair q = 16 s + p (k = 2q, 2q + 1) start at
// base + s * slice + p * pair + h * half, each column's two values side by side (32 bits).
//   tiles_linear's weights (packing.tile_weight): {32, 512, 1024}; prompt keys and values: see
//   prefill_attention.cpp.
struct PairLayout {
  int64_t pair, half, slice;
};

// One 32-bit pair of bfloat16 values at p, in every lane.
inline __m512bh broadcast_pair(const c10::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Row r of the register tile: x's pair at depth kk times the two halves of the operand's pair.
#define OCTAVO_DOT_ROW(r)                                  \
  if constexpr (MR > r) {                                  \
    const __m512bh xb = broadcast_pair(x##r + kk);         \
    c##r##_0 = _mm512_dpbf16_ps(c##r##_0, xb, w0);         \
    c##r##_1 = _mm512_dpbf16_ps(c##r##_1, xb, w1);         \
  }
#define OCTAVO_DOT_LOAD(r)                                                             \
  if constexpr (MR > r) {                                                              \
    if (accumulate) {                                                                  \
      c##r##_0 = _mm512_maskz_loadu_ps(lo_mask, out + r * ldo);                        \
      c##r##_1 = _mm512_maskz_loadu_ps(hi_mask, out + r * ldo + kDotColumns / 2);      \
    }                                                                                  \
  }
#define OCTAVO_DOT_STORE(r)                                                      \
  if constexpr (MR > r) {                                                        \
    _mm512_mask_storeu_ps(out + r * ldo, lo_mask, c##r##_0);                     \
    _mm512_mask_storeu_ps(out + r * ldo + kDotColumns / 2, hi_mask, c##r##_1);   \
  }

// MR rows of x (bf16, ldx apart, each slices * 32 values) against `slices` slices of the
// operand at w (layout `at`), into out (MR rows, ldo apart, the first n_valid <= 32 columns;
// added to what is there with `accumulate`). Asks for `ahead_lines` cache lines from `ahead`
// on into L2, two a pair of k, so that memory streams what comes next while this is multiplied
// (0: none). Named accumulators: compilers keep an array of vectors this size in memory.
template <int MR>
inline void dot_tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w,
                     PairLayout at, int64_t slices, float* out, int64_t ldo, int64_t n_valid,
                     bool accumulate, const char* ahead = nullptr, int64_t ahead_lines = 0) {
  static_assert(MR >= 1 && MR <= kDotRows, "rows per tile");
  const int64_t lo = std::min<int64_t>(n_valid, kDotColumns / 2);
  const int64_t hi = std::max<int64_t>(n_valid - kDotColumns / 2, 0);
  const __mmask16 lo_mask = static_cast<__mmask16>((1u << lo) - 1);
  const __mmask16 hi_mask = static_cast<__mmask16>((1u << hi) - 1);
  __m512 c0_0 = _mm512_setzero_ps(), c0_1 = c0_0, c1_0 = c0_0, c1_1 = c0_0, c2_0 = c0_0,
         c2_1 = c0_0, c3_0 = c0_0, c3_1 = c0_0, c4_0 = c0_0, c4_1 = c0_0, c5_0 = c0_0,
         c5_1 = c0_0, c6_0 = c0_0, c6_1 = c0_0, c7_0 = c0_0, c7_1 = c0_0, c8_0 = c0_0,
         c8_1 = c0_0, c9_0 = c0_0, c9_1 = c0_0, c10_0 = c0_0, c10_1 = c0_0, c11_0 = c0_0,
         c11_1 = c0_0;
  OCTAVO_DOT_LOAD(0)
  OCTAVO_DOT_LOAD(1)
  OCTAVO_DOT_LOAD(2)
  OCTAVO_DOT_LOAD(3)
  OCTAVO_DOT_LOAD(4)
  OCTAVO_DOT_LOAD(5)
  OCTAVO_DOT_LOAD(6)
  OCTAVO_DOT_LOAD(7)
  OCTAVO_DOT_LOAD(8)
  OCTAVO_DOT_LOAD(9)
  OCTAVO_DOT_LOAD(10)
  OCTAVO_DOT_LOAD(11)
  const c10::BFloat16* x0 = x;
  const c10::BFloat16* x1 = x + (MR > 1 ? 1 : 0) * ldx;
  const c10::BFloat16* x2 = x + (MR > 2 ? 2 : 0) * ldx;
  const c10::BFloat16* x3 = x + (MR > 3 ? 3 : 0) * ldx;
  const c10::BFloat16* x4 = x + (MR > 4 ? 4 : 0) * ldx;
  const c10::BFloat16* x5 = x + (MR > 5 ? 5 : 0) * ldx;
  const c10::BFloat16* x6 = x + (MR > 6 ? 6 : 0) * ldx;
  const c10::BFloat16* x7 = x + (MR > 7 ? 7 : 0) * ldx;
  const c10::BFloat16* x8 = x + (MR > 8 ? 8 : 0) * ldx;
  const c10::BFloat16* x9 = x + (MR > 9 ? 9 : 0) * ldx;
  const c10::BFloat16* x10 = x + (MR > 10 ? 10 : 0) * ldx;
  const c10::BFloat16* x11 = x + (MR > 11 ? 11 : 0) * ldx;
  int64_t line = 0;
  for (int64_t s = 0; s < slices; ++s, w += at.slice) {
    for (int64_t p = 0; p < kDotPairs; ++p) {
      if (line < ahead_lines) {
        prefetch_line<1>(ahead + 64 * line);
        prefetch_line<1>(ahead + 64 * line + 64);
        line += 2;
      }
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * at.pair);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * at.pair + at.half);
      const int64_t kk = s * 2 * kDotPairs + 2 * p;
      OCTAVO_DOT_ROW(0)
      OCTAVO_DOT_ROW(1)
      OCTAVO_DOT_ROW(2)
      OCTAVO_DOT_ROW(3)
      OCTAVO_DOT_ROW(4)
      OCTAVO_DOT_ROW(5)
      OCTAVO_DOT_ROW(6)
      OCTAVO_DOT_ROW(7)
      OCTAVO_DOT_ROW(8)
      OCTAVO_DOT_ROW(9)
      OCTAVO_DOT_ROW(10)
      OCTAVO_DOT_ROW(11)
    }
  }
  OCTAVO_DOT_STORE(0)
  OCTAVO_DOT_STORE(1)
  OCTAVO_DOT_STORE(2)
  OCTAVO_DOT_STORE(3)
  OCTAVO_DOT_STORE(4)
  OCTAVO_DOT_STORE(5)
  OCTAVO_DOT_STORE(6)
  OCTAVO_DOT_STORE(7)
  OCTAVO_DOT_STORE(8)
  OCTAVO_DOT_STORE(9)
  OCTAVO_DOT_STORE(10)
  OCTAVO_DOT_STORE(11)
}
#undef OCTAVO_DOT_ROW
#undef OCTAVO_DOT_LOAD
#undef OCTAVO_DOT_STORE

// dot_tile for 1 <= rows <= kDotRows rows (the same arguments).
inline void dot_rows(int64_t rows, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w,
                     PairLayout at, int64_t slices, float* out, int64_t ldo, int64_t n_valid,
                     bool accumulate, const char* ahead = nullptr, int64_t ahead_lines = 0) {
  switch (rows) {
#define OCTAVO_DOT_CASE(r)                                                                \
  case r:                                                                                 \
    dot_tile<r>(x, ldx, w, at, slices, out, ldo, n_valid, accumulate, ahead, ahead_lines); \
    break;
    OCTAVO_DOT_CASE(1)
    OCTAVO_DOT_CASE(2)
    OCTAVO_DOT_CASE(3)
    OCTAVO_DOT_CASE(4)
    OCTAVO_DOT_CASE(5)
    OCTAVO_DOT_CASE(6)
    OCTAVO_DOT_CASE(7)
    OCTAVO_DOT_CASE(8)
    OCTAVO_DOT_CASE(9)
    OCTAVO_DOT_CASE(10)
    OCTAVO_DOT_CASE(11)
    OCTAVO_DOT_CASE(12)
#undef OCTAVO_DOT_CASE
    default: break;
  }
}

}  // namespace
}  // namespace octavo

#endif
