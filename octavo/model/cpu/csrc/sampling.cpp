// The sampler's random draw in one pass over the logits.

#include "ops.h"
#include "simd.h"

namespace octavo {
namespace {

// The sampler's random draw (its inverse-CDF step) straight from the filtered logits: per row,
// the first token whose cumulative softmax probability exceeds u * (the row's total), without the
// softmax and cumulative sum that torch writes out over the whole vocabulary (two passes and two
// rows of the vocabulary's size each). The row is overwritten with exp(logit - max) and summed
// (exp_shifted_sum: a token at -inf, dropped by a filter, keeps probability exactly 0); then the
// walk takes eight tokens at a time up to the eight whose sum passes the threshold, and one token
// at a time inside them. The threshold is kept below the total, and should rounding still carry
// the walk past the end (the sums of eight are added in another order than the total), the last
// token with mass is taken: never one without.

// The first index whose running sum of e[0..] exceeds threshold (< the total of e).
inline int64_t walk_row(const float* e, int64_t n, float threshold) {
  float running = 0.f;
  int64_t i = 0;
#ifdef OCTAVO_AVX2
  for (; i + 8 <= n; i += 8) {
    const float block = hsum(_mm256_loadu_ps(e + i));
    if (running + block > threshold) break;
    running += block;
  }
#endif
  for (; i < n; ++i) {
    running += e[i];
    if (running > threshold && e[i] > 0.f) return i;
  }
  i = n - 1;
  while (i > 0 && e[i] == 0.f) --i;
  return i;
}

// The index of a row's largest value, the first of equals, a NaN counting as the largest (the
// first NaN), as torch's argmax picks: sixteen (AVX2: eight) lanes each keep their largest value and its
// index (a strictly larger one replaces it, so each lane keeps its first), then the largest of
// the lanes, the smallest index among the lanes that hold it; the tail after the last sixteen
// one at a time, again strictly. A row with a NaN is searched again for its first NaN.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();
#ifdef OCTAVO_AVX512
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, sixteen);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, larger, v);
      vidx = _mm512_mask_mov_epi32(vidx, larger, cur);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j) {
        if (std::isnan(x[j])) return j;
      }
    }
    top = _mm512_reduce_max_ps(vmax);
    const __mmask16 holders = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(holders, vidx);
  }
#elif defined(OCTAVO_AVX2)
  if (n >= 8) {  // the same on eight lanes
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    const __m256i eight = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, eight);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 larger = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
      vmax = _mm256_blendv_ps(vmax, v, larger);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx),
                                                  _mm256_castsi256_ps(cur), larger));
    }
    if (_mm256_movemask_ps(nan)) {
      for (int64_t j = 0; j < n; ++j) {
        if (std::isnan(x[j])) return j;
      }
    }
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), vidx);
    top = values[0];
    best = indices[0];
    for (int lane = 1; lane < 8; ++lane) {
      if (values[lane] > top || (values[lane] == top && indices[lane] < best)) {
        top = values[lane];
        best = indices[lane];
      }
    }
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) {
      // The first NaN of the row (the vector part had none).
      return i;
    }
    if (x[i] > top || (i == 0)) {
      top = x[i];
      best = i;
    }
  }
  return best;
}

}  // namespace

// logits: (rows, vocab) float32 contiguous. Returns (rows,) int64: each row's argmax as torch
// gives it (argmax_row).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: logits must be (rows, vocab) contiguous float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "argmax_rows: 1 to 2^31 - 1 columns");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(x + r * vocab, vocab);
  });
  return out;
}

// logits: (rows, vocab) float32 contiguous, overwritten; uniform: (rows,) float32 in [0, 1).
// Returns (rows,) int64.
at::Tensor sample_categorical(at::Tensor logits, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_categorical: logits must be (rows, vocab) contiguous float32");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.numel() == logits.size(0),
              "sample_categorical: one float32 uniform per row");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  float* x = logits.data_ptr<float>();
  const at::Tensor u = uniform.contiguous();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* e = x + r * vocab;
      const float total = exp_shifted_sum(e, vocab, max_of(e, vocab));
      // u * total can round up to total: stay strictly below it, as invert_cdf does.
      const float threshold = std::min(up[r] * total, std::nextafter(total, 0.f));
      op[r] = walk_row(e, vocab, threshold);
    }
  });
  return out;
}

}  // namespace octavo
