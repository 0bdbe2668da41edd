// The register-tiled matmul over packed weight panels: packed_linear's core, which paged prefill
// attention reuses for its query x key and weight x value products.

#pragma once

#include "simd.h"

namespace octavo {
// Internal linkage in every file that includes it, as for a file's own helpers: the compiler
// inlines and specialises them per kernel file.
namespace {

// ---- packed linear ----------------------------------------------------------------------------
//
// out = x @ W^T (prompt chunks and decode batches alike), from a copy of W packed once at load
// time into panels of kPanel output columns (two vectors: 32 with AVX-512, else 16):
//
//   packed[p][k][j] = W[kPanel * p + j][k]     (N padded to a multiple of kPanel with zero rows)
//
// so a thread streams its panels as one contiguous run of memory, and for each k the weights of
// a panel are two vector loads that every row of x reuses (a broadcast of x[m][k] and two FMAs
// per row). bfloat16 panels interleave their two halves (see panel_slot), so that one load
// widens to float32 with a shift (the first half) and a mask (the second). Accumulation is in
// float32 in both cases. The layout depends on the build: Python asks packed_panel() for it.

#ifdef OCTAVO_AVX2
// The tile's vector: 16 floats where the CPU has AVX-512, else 8 (AVX2). A panel is two of them.
#ifdef OCTAVO_AVX512
using vec_t = __m512;
inline vec_t vzero() { return _mm512_setzero_ps(); }
inline vec_t vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
inline vec_t vadd(vec_t a, vec_t b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, vec_t v) { _mm512_storeu_ps(p, v); }
inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
constexpr int kTileRows = 12;  // rows of x per register tile: 24 accumulators + 2 weights + x
#else
using vec_t = __m256;
inline vec_t vzero() { return _mm256_setzero_ps(); }
inline vec_t vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
inline vec_t vadd(vec_t a, vec_t b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, vec_t v) { _mm256_storeu_ps(p, v); }
inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
constexpr int kTileRows = 6;  // rows of x per register tile: 12 accumulators + 2 weights + x
#endif
constexpr int64_t kPanel = 2 * static_cast<int64_t>(sizeof(vec_t) / sizeof(float));
#else
constexpr int64_t kPanel = 16;
constexpr int kTileRows = 6;
#endif

// Position of column j of a panel in its packed row: bfloat16 panels interleave the two
// halves (0, h, 1, h + 1, ...), so that each 32-bit word holds column i in its low half and
// column h + i in its high half, and one load widens to both vectors with a shift and a mask.
inline int64_t panel_slot(int64_t j, bool bf16) {
  constexpr int64_t h = kPanel / 2;
  return bf16 ? (j < h ? 2 * j : 2 * (j - h) + 1) : j;
}

#ifdef OCTAVO_AVX2
inline void load_panel(const float* p, vec_t& lo, vec_t& hi) {
#ifdef OCTAVO_AVX512
  lo = _mm512_loadu_ps(p);
  hi = _mm512_loadu_ps(p + kPanel / 2);
#else
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + kPanel / 2);
#endif
}
inline void load_panel(const c10::BFloat16* p, vec_t& lo, vec_t& hi) {
#ifdef OCTAVO_AVX512
  load_split32(p, lo, hi);
#else
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(
      _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
}

// Row r of the tile times the panel's weights b0/b1 at depth kk, into c<r>_0 / c<r>_1.
#define OCTAVO_TILE_ROW(r, kk)                  \
  if constexpr (MR > r) {                       \
    const vec_t xb = vbroadcast(x##r + (kk));   \
    c##r##_0 = vfma(b0, xb, c##r##_0);          \
    c##r##_1 = vfma(b1, xb, c##r##_1);          \
  }

// A panel is read front to back, on the first tile of a chunk mostly from memory: each depth
// asks for the one kPrefetchDepth ahead, since the hardware prefetcher stops at every 4 KiB
// page. Past the end this touches the next panel (prefetches never fault). 64 depths (4 KiB of
// bf16 panel) cover a memory access at 32 rows; 16 did not (30 layers' matmuls, 1 / 8 / 32
// rows: 8.6 / 11.8 / 27.1 -> 8.0 / 9.8 / 25.1 ms).
constexpr int64_t kPrefetchDepth = 64;
template <typename weight_t>
inline void prefetch_depth(const weight_t* panel, int64_t ldp, int64_t k) {
  const char* ahead = reinterpret_cast<const char*>(panel + (k + kPrefetchDepth) * ldp);
  prefetch_line<0>(ahead);
  if constexpr (sizeof(weight_t) * kPanel > 64) prefetch_line<0>(ahead + 64);
}

// MR rows of x against one panel over all of K; the panel's row for depth k is at
// panel + k * ldp (kPanel for packed weights). With `accumulate`, out += the result. The
// accumulators are named variables, not an array: compilers keep an array of vectors this size
// in memory and store it every iteration.
template <int MR, typename weight_t>
inline void packed_tile(const float* x, int64_t ldx, const weight_t* panel, int64_t ldp,
                        int64_t k_dim, float* out, int64_t ldo, int64_t n_valid,
                        bool accumulate) {
  static_assert(MR >= 1 && MR <= kTileRows, "rows per tile");
  vec_t c0_0 = vzero(), c0_1 = c0_0, c1_0 = c0_0, c1_1 = c0_0, c2_0 = c0_0, c2_1 = c0_0,
        c3_0 = c0_0, c3_1 = c0_0, c4_0 = c0_0, c4_1 = c0_0, c5_0 = c0_0, c5_1 = c0_0;
#ifdef OCTAVO_AVX512
  vec_t c6_0 = c0_0, c6_1 = c0_0, c7_0 = c0_0, c7_1 = c0_0, c8_0 = c0_0, c8_1 = c0_0,
        c9_0 = c0_0, c9_1 = c0_0, c10_0 = c0_0, c10_1 = c0_0, c11_0 = c0_0, c11_1 = c0_0;
#endif
  // One pointer per row keeps the inner loop's addressing to base + index.
  const float* x0 = x;
  const float* x1 = x + (MR > 1 ? 1 : 0) * ldx;
  const float* x2 = x + (MR > 2 ? 2 : 0) * ldx;
  const float* x3 = x + (MR > 3 ? 3 : 0) * ldx;
  const float* x4 = x + (MR > 4 ? 4 : 0) * ldx;
  const float* x5 = x + (MR > 5 ? 5 : 0) * ldx;
#ifdef OCTAVO_AVX512
  const float* x6 = x + (MR > 6 ? 6 : 0) * ldx;
  const float* x7 = x + (MR > 7 ? 7 : 0) * ldx;
  const float* x8 = x + (MR > 8 ? 8 : 0) * ldx;
  const float* x9 = x + (MR > 9 ? 9 : 0) * ldx;
  const float* x10 = x + (MR > 10 ? 10 : 0) * ldx;
  const float* x11 = x + (MR > 11 ? 11 : 0) * ldx;
#endif
  int64_t k = 0;
  if constexpr (MR <= 2) {
    // One or two rows make too few independent FMA chains to hide their latency: the odd
    // depths go to a second set of accumulators (c2_*, c3_*), added in at the end.
    for (; k + 2 <= k_dim; k += 2) {
      vec_t b0, b1;
      prefetch_depth(panel, ldp, k);
      prefetch_depth(panel, ldp, k + 1);
      load_panel(panel + k * ldp, b0, b1);
      OCTAVO_TILE_ROW(0, k)
      OCTAVO_TILE_ROW(1, k)
      load_panel(panel + (k + 1) * ldp, b0, b1);
      const vec_t xa = vbroadcast(x0 + k + 1);
      c2_0 = vfma(b0, xa, c2_0);
      c2_1 = vfma(b1, xa, c2_1);
      if constexpr (MR > 1) {
        const vec_t xb = vbroadcast(x1 + k + 1);
        c3_0 = vfma(b0, xb, c3_0);
        c3_1 = vfma(b1, xb, c3_1);
      }
    }
  }
  for (; k < k_dim; ++k) {
    vec_t b0, b1;
    prefetch_depth(panel, ldp, k);
    load_panel(panel + k * ldp, b0, b1);
    OCTAVO_TILE_ROW(0, k)
    OCTAVO_TILE_ROW(1, k)
    OCTAVO_TILE_ROW(2, k)
    OCTAVO_TILE_ROW(3, k)
    OCTAVO_TILE_ROW(4, k)
    OCTAVO_TILE_ROW(5, k)
#ifdef OCTAVO_AVX512
    OCTAVO_TILE_ROW(6, k)
    OCTAVO_TILE_ROW(7, k)
    OCTAVO_TILE_ROW(8, k)
    OCTAVO_TILE_ROW(9, k)
    OCTAVO_TILE_ROW(10, k)
    OCTAVO_TILE_ROW(11, k)
#endif
  }
  if constexpr (MR <= 2) {
    c0_0 = vadd(c0_0, c2_0);
    c0_1 = vadd(c0_1, c2_1);
    c1_0 = vadd(c1_0, c3_0);
    c1_1 = vadd(c1_1, c3_1);
  }
  const vec_t acc[kTileRows][2] = {
      {c0_0, c0_1}, {c1_0, c1_1}, {c2_0, c2_1}, {c3_0, c3_1}, {c4_0, c4_1}, {c5_0, c5_1},
#ifdef OCTAVO_AVX512
      {c6_0, c6_1}, {c7_0, c7_1}, {c8_0, c8_1}, {c9_0, c9_1}, {c10_0, c10_1}, {c11_0, c11_1},
#endif
  };
  for (int r = 0; r < MR; ++r) {
    float* o = out + r * ldo;
    if (n_valid == kPanel) {
      vstore(o, accumulate ? vadd(acc[r][0], vload(o)) : acc[r][0]);
      vstore(o + kPanel / 2, accumulate ? vadd(acc[r][1], vload(o + kPanel / 2)) : acc[r][1]);
    } else {
      float tmp[kPanel];
      vstore(tmp, acc[r][0]);
      vstore(tmp + kPanel / 2, acc[r][1]);
      for (int64_t j = 0; j < n_valid; ++j) o[j] = accumulate ? o[j] + tmp[j] : tmp[j];
    }
  }
}
#undef OCTAVO_TILE_ROW
#endif

// `rows` rows of x against one panel: full tiles, then one tile for the remainder. The panel's
// row for depth k is at panel + k * ldp; with `accumulate`, out += x @ panel.
template <typename weight_t>
void packed_rows(const float* x, int64_t ldx, const weight_t* panel, int64_t k_dim, float* out,
                 int64_t ldo, int64_t n_valid, int64_t rows, int64_t ldp = kPanel,
                 bool accumulate = false) {
#ifdef OCTAVO_AVX2
  int64_t m = 0;
  auto tile = [&](auto mr) {
    packed_tile<decltype(mr)::value>(x + m * ldx, ldx, panel, ldp, k_dim, out + m * ldo, ldo,
                                     n_valid, accumulate);
  };
  for (; m + kTileRows <= rows; m += kTileRows) tile(std::integral_constant<int, kTileRows>{});
  switch (rows - m) {
    case 1: tile(std::integral_constant<int, 1>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    case 4: tile(std::integral_constant<int, 4>{}); break;
    case 5: tile(std::integral_constant<int, 5>{}); break;
#ifdef OCTAVO_AVX512
    case 6: tile(std::integral_constant<int, 6>{}); break;
    case 7: tile(std::integral_constant<int, 7>{}); break;
    case 8: tile(std::integral_constant<int, 8>{}); break;
    case 9: tile(std::integral_constant<int, 9>{}); break;
    case 10: tile(std::integral_constant<int, 10>{}); break;
    case 11: tile(std::integral_constant<int, 11>{}); break;
#endif
    default: break;
  }
#else
  constexpr bool bf16 = std::is_same_v<weight_t, c10::BFloat16>;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < n_valid; ++j) {
      const weight_t* w = panel + panel_slot(j, bf16);
      float s = 0.f;
      for (int64_t k = 0; k < k_dim; ++k) s += x[m * ldx + k] * to_float(w[k * ldp]);
      out[m * ldo + j] = accumulate ? out[m * ldo + j] + s : s;
    }
  }
#endif
}


}  // namespace
}  // namespace octavo
