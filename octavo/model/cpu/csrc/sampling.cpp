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

}  // namespace

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
