// One pass each for the small ops around the matmuls: RMSNorm with the residual add, rotary
// embedding, SiLU-and-mul and the KV cache write.

#include "ops.h"
#include "simd.h"

namespace octavo {
namespace {


// One row of rms_norm's first pass: rr <- xr + rr where rr is given (the row then read is rr,
// else xr), and the sum of squares of the row read. In vector lanes with two accumulators: a
// scalar sum is one chain of dependent adds, which the compiler may not split into lanes, and
// it made the norm as slow as a small matmul.
inline float add_and_sum_squares(const float* xr, float* rr, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef OCTAVO_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    __m512 v0 = _mm512_loadu_ps(xr + i), v1 = _mm512_loadu_ps(xr + i + 16);
    if (rr != nullptr) {
      v0 = _mm512_add_ps(v0, _mm512_loadu_ps(rr + i));
      v1 = _mm512_add_ps(v1, _mm512_loadu_ps(rr + i + 16));
      _mm512_storeu_ps(rr + i, v0);
      _mm512_storeu_ps(rr + i + 16, v1);
    }
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  sum = hsum(fold16(_mm512_add_ps(a0, a1)));
#elif defined(OCTAVO_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
    if (rr != nullptr) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(rr + i));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(rr + i + 8));
      _mm256_storeu_ps(rr + i, v0);
      _mm256_storeu_ps(rr + i + 8, v1);
    }
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  sum = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) {
    const float v = rr != nullptr ? (rr[i] += xr[i]) : xr[i];
    sum += v * v;
  }
  return sum;
}

}  // namespace

// x, residual: (num_tokens, hidden) float32, contiguous, updated in place:
//   residual <- x + residual;  x <- weight * (residual * rsqrt(mean(residual^2) + eps))
// (with has_residual false, residual is ignored and x is normalised in place).
void rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps,
              bool has_residual) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = has_residual ? residual.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * hidden;
      float* rr = has_residual ? rp + t * hidden : nullptr;
      const float sum_sq = add_and_sum_squares(xr, rr, hidden);
      const float* src = has_residual ? rr : xr;
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + feps);
      for (int64_t i = 0; i < hidden; ++i) xr[i] = wp[i] * (src[i] * inv);
    }
  });
}

// x: (num_tokens, num_heads, head_dim) float32 with unit stride in head_dim (rows may be views
// into a wider packed projection); cos, sin: (num_tokens, head_dim) float32 contiguous.
// In place: x <- x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] of the two halves.
void rotary(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1), half = head_dim / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* row = xp + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = row[i], x2 = row[i + half];
          row[i] = x1 * c[i] - x2 * s[i];
          row[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

// ---- SiLU-and-mul and the KV cache write -----------------------------------------------------

namespace {

// Eight floats as bfloat16, rounded to nearest even (as torch converts finite values).
#ifdef OCTAVO_AVX2
inline void store8(c10::BFloat16* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#endif
#ifdef OCTAVO_AVX512
// Sixteen floats, as store8 rounds them.
inline void store16(c10::BFloat16* p, __m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif

template <typename T>
void silu_and_mul_rows(const T* in, T* op, int64_t num_tokens, int64_t inter) {
  // A few rows per task: one decode row is ~2 us of work, less than waking a thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = in + t * 2 * inter;
      const T* up = gate + inter;
      T* o = op + t * inter;
      int64_t i = 0;
#ifdef OCTAVO_AVX512
      // The AVX2 loop's operations on sixteen lanes, so the same results in half the
      // instructions (Zen 4, 2048 x 1536 bfloat16: 1.2-1.5 -> 0.75-0.86 ms).
      const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
      for (; i + 16 <= inter; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 e = exp_any(_mm512_sub_ps(zero16, g));
        store16(o + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one16, e)), load16(up + i)));
      }
#endif
#ifdef OCTAVO_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= inter; i += 8) {
        const __m256 g = load8(gate + i);
        const __m256 e = exp_any(_mm256_sub_ps(zero, g));
        store8(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), load8(up + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float g = to_float(gate[i]);
        o[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_float(up[i]));
      }
    }
  });
}

}  // namespace

// gate_up: (num_tokens, 2 * inter) float32 or bfloat16 contiguous, the gate's columns first
// (the packed gate/up projection). Returns silu(gate) * up = gate / (1 + exp(-gate)) * up,
// shape (num_tokens, inter), in gate_up's dtype: computed in float32, a bfloat16 result
// rounded once to nearest even.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t num_tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({num_tokens, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_and_mul_rows(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                      num_tokens, inter);
  } else {
    silu_and_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), num_tokens, inter);
  }
  return out;
}

namespace {

// key, value: (num_tokens, num_kv_heads, head_dim) float32 whose heads are contiguous within a
// token (rows may be views into a wider packed projection); kv_cache: (2, num_blocks,
// block_size, num_kv_heads, head_dim) contiguous, float32 or bfloat16 (rounded to nearest
// even, as torch converts); slot_mapping: (num_tokens,) int64. Token t's key and value go to
// slot slot_mapping[t] of the key and value halves.
template <typename cache_t>
void write_kv_cache_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);  // one token's heads
  const int64_t key_stride = key.stride(0), value_stride = value.stride(0);
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  cache_t* key_cache = kv_cache.data_ptr<cache_t>();
  cache_t* value_cache = key_cache + kv_cache.stride(0);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " is outside the cache's ",
                  num_slots, " slots");
      std::copy(kp + t * key_stride, kp + t * key_stride + row, key_cache + slot * row);
      std::copy(vp + t * value_stride, vp + t * value_stride + row, value_cache + slot * row);
    }
  });
}

}  // namespace

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping) {
  if (kv_cache.scalar_type() == at::kBFloat16) {
    write_kv_cache_impl<c10::BFloat16>(key, value, kv_cache, slot_mapping);
  } else {
    write_kv_cache_impl<float>(key, value, kv_cache, slot_mapping);
  }
}

}  // namespace octavo
