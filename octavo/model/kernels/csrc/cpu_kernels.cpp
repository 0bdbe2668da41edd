// CPU kernels for the places where a general-purpose library does badly on this workload:
//
//  - paged_decode_attention: one query token per request attends to its keys and values where
//    they lie in the paged cache, block by block, with no gather into a padded copy, and
//    paged_prefill_attention, the same for prompt chunks (causal, flash-attention style);
//  - packed_linear: out = x @ W^T from a copy of W packed at load time into panels of columns
//    (float32, or bfloat16 widened in registers; accumulation in fp32): at decode sizes BLAS
//    GEMMs run far below memory bandwidth, and up to prompt sizes it keeps level with them.
//
// Beside them, RMSNorm (with the residual add), rotary embedding, SiLU-and-mul and the KV cache
// write, one pass each over the data instead of the half-dozen ops (and temporaries) they take
// in torch, which dominate a decode step's op count once the matmuls are fast.
//
// All are registered as torch operators (torch.ops.octavo.*) and parallelised with
// at::parallel_for, so they share torch's thread pool instead of starting another one.
// Inputs are checked by the Python wrappers (octavo/model/kernels/__init__.py), which also hold
// the plain-torch versions these are tested against.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

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
#endif
#endif

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
#endif

// ---- paged decode attention -----------------------------------------------------------------

template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t d) {
  int64_t i = 0;
  float acc = 0.f;
#ifdef OCTAVO_AVX2
  // Two accumulators: one FMA chain would wait on its own latency every step.
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a1);
  }
  for (; i + 8 <= d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
  acc = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < d; ++i) acc += q[i] * to_float(k[i]);
  return acc;
}

template <typename cache_t>
inline void axpy(float* acc, float p, const cache_t* v, int64_t d) {
  int64_t i = 0;
#ifdef OCTAVO_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(acc + i)));
  }
#endif
  for (; i < d; ++i) acc[i] += p * to_float(v[i]);
}

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

// fn(t, row) for each token t < seq_len of a sequence whose cache blocks are `blocks`, `row`
// pointing at its slot in `base` plus `offset`. Block by block: a block's slots are contiguous,
// so there is no division per token.
template <typename cache_t, typename Fn>
inline void for_each_token_row(const cache_t* base, const int32_t* blocks, int64_t seq_len,
                               int64_t block_size, int64_t slot_stride, int64_t offset, Fn&& fn) {
  for (int64_t start = 0, b = 0; start < seq_len; start += block_size, ++b) {
    const int64_t n = std::min(block_size, seq_len - start);
    const cache_t* row =
        base + static_cast<int64_t>(blocks[b]) * block_size * slot_stride + offset;
    for (int64_t o = 0; o < n; ++o, row += slot_stride) fn(start + o, row);
  }
}

// What both versions read from their arguments: shapes, pointers, and the split into work items.
//   query, out: (num_seqs, num_heads, head_dim) float32
//   key_cache, value_cache: (num_blocks, block_size, num_kv_heads, head_dim)
//   block_table: (num_seqs, max_blocks) int32; seq_lens: (num_seqs,) int32
template <typename cache_t>
struct PagedArgs {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, group, max_blocks;
  int64_t slot_stride;  // between consecutive tokens
  const float* q_base;
  float* out_base;
  const cache_t* k_base;
  const cache_t* v_base;
  const int32_t* table;
  const int32_t* lens;
  // A work item is one sequence and a run of its kv heads: all of them when there are enough
  // sequences to keep every thread busy, so each token's K/V row (all heads, contiguous) is
  // read once while it is in cache; else one kv head, to spread a few long sequences.
  int64_t kv_per_item, items_per_seq, heads_per_item;

  PagedArgs(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const at::Tensor& block_table,
            const at::Tensor& seq_lens)
      : num_seqs(query.size(0)),
        num_heads(query.size(1)),
        head_dim(query.size(2)),
        block_size(key_cache.size(1)),
        num_kv_heads(key_cache.size(2)),
        group(num_heads / num_kv_heads),
        max_blocks(block_table.size(1)),
        slot_stride(num_kv_heads * head_dim),
        q_base(query.data_ptr<float>()),
        out_base(out.data_ptr<float>()),
        k_base(key_cache.data_ptr<cache_t>()),
        v_base(value_cache.data_ptr<cache_t>()),
        table(block_table.data_ptr<int32_t>()),
        lens(seq_lens.data_ptr<int32_t>()),
        kv_per_item(num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1),
        items_per_seq(num_kv_heads / kv_per_item),
        heads_per_item(kv_per_item * group) {}
};

template <typename cache_t>
void paged_decode_attention_generic(const PagedArgs<cache_t>& a, double scale) {
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, a.num_seqs * a.items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // (heads_per_item, seq_len), reused across the range
    std::vector<float> acc;     // (heads_per_item, head_dim)
    std::vector<int64_t> row_offset(a.heads_per_item);  // query head -> its kv head in a row
    for (int64_t h = 0; h < a.heads_per_item; ++h) row_offset[h] = (h / a.group) * a.head_dim;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / a.items_per_seq;
      const int64_t kv_first = (item % a.items_per_seq) * a.kv_per_item;
      const int64_t seq_len = a.lens[seq];
      const int32_t* blocks = a.table + seq * a.max_blocks;
      const float* q = a.q_base + (seq * a.num_heads + kv_first * a.group) * a.head_dim;
      scores.resize(a.heads_per_item * seq_len);
      // Scores; each key row is read once for every query head it serves.
      for_each_token_row(a.k_base, blocks, seq_len, a.block_size, a.slot_stride,
                         kv_first * a.head_dim,
                         [&](int64_t t, const cache_t* k) {
                           for (int64_t h = 0; h < a.heads_per_item; ++h) {
                             scores[h * seq_len + t] =
                                 dot(q + h * a.head_dim, k + row_offset[h], a.head_dim) * fscale;
                           }
                         });
      // Softmax per head, in float32.
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        float* s = scores.data() + h * seq_len;
        const float max_score = max_of(s, seq_len);
        const float inv = 1.f / exp_shifted_sum(s, seq_len, max_score);
        for (int64_t t = 0; t < seq_len; ++t) s[t] *= inv;
      }
      // Weighted values, again one read of each value row for all its heads.
      acc.assign(a.heads_per_item * a.head_dim, 0.f);
      for_each_token_row(a.v_base, blocks, seq_len, a.block_size, a.slot_stride,
                         kv_first * a.head_dim,
                         [&](int64_t t, const cache_t* v) {
                           for (int64_t h = 0; h < a.heads_per_item; ++h) {
                             axpy(acc.data() + h * a.head_dim, scores[h * seq_len + t],
                                  v + row_offset[h], a.head_dim);
                           }
                         });
      float* out_row = a.out_base + (seq * a.num_heads + kv_first * a.group) * a.head_dim;
      std::copy(acc.begin(), acc.end(), out_row);
    }
  });
}

#ifdef OCTAVO_AVX2
// [sum(a0), ..., sum(a7)]: eight horizontal sums in one vector.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  // u0 = [a0..a3 low-half sums | a0..a3 high-half sums], u1 the same for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The eight lanes whose sum is q . k (d a multiple of 8): two FMA chains, no reduction yet.
template <typename cache_t>
inline __m256 dot_lanes(const float* q, const cache_t* k, int64_t d) {
#ifdef OCTAVO_AVX512
  if (d % 16 == 0) {  // the same with 16-lane vectors, folded to eight lanes at the end
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
    __m512 a1 = _mm512_setzero_ps();
    int64_t i = 16;
    for (; i + 32 <= d; i += 32) {
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), a1);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load16(k + i + 16), a0);
    }
    if (i < d) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), a1);
    return fold16(_mm512_add_ps(a0, a1));
  }
#endif
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  __m256 a1 = _mm256_setzero_ps();
  int64_t i = 8;
  for (; i + 16 <= d; i += 16) {
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a1);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a0);
  }
  if (i < d) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a1);
  return _mm256_add_ps(a0, a1);
}

// acc[0, d) += sum_t p[t] * row_t[0, d) over the n rows row + t * stride; d a multiple of 8.
// 64 columns at a time in eight registers, so acc is loaded and stored once per call, not once
// per row.
template <typename cache_t>
inline void weighted_rows(float* acc, const float* p, const cache_t* row, int64_t stride,
                          int64_t n, int64_t d) {
  int64_t i = 0;
#ifdef OCTAVO_AVX512
  for (; i + 64 <= d; i += 64) {  // four 16-lane accumulators
    __m512 a0 = _mm512_loadu_ps(acc + i), a1 = _mm512_loadu_ps(acc + i + 16),
           a2 = _mm512_loadu_ps(acc + i + 32), a3 = _mm512_loadu_ps(acc + i + 48);
    const cache_t* v = row + i;
    for (int64_t t = 0; t < n; ++t, v += stride) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      a0 = _mm512_fmadd_ps(pt, load16(v), a0);
      a1 = _mm512_fmadd_ps(pt, load16(v + 16), a1);
      a2 = _mm512_fmadd_ps(pt, load16(v + 32), a2);
      a3 = _mm512_fmadd_ps(pt, load16(v + 48), a3);
    }
    _mm512_storeu_ps(acc + i, a0);
    _mm512_storeu_ps(acc + i + 16, a1);
    _mm512_storeu_ps(acc + i + 32, a2);
    _mm512_storeu_ps(acc + i + 48, a3);
  }
#endif
  for (; i + 64 <= d; i += 64) {
    __m256 a0 = _mm256_loadu_ps(acc + i), a1 = _mm256_loadu_ps(acc + i + 8),
           a2 = _mm256_loadu_ps(acc + i + 16), a3 = _mm256_loadu_ps(acc + i + 24),
           a4 = _mm256_loadu_ps(acc + i + 32), a5 = _mm256_loadu_ps(acc + i + 40),
           a6 = _mm256_loadu_ps(acc + i + 48), a7 = _mm256_loadu_ps(acc + i + 56);
    const cache_t* v = row + i;
    for (int64_t t = 0; t < n; ++t, v += stride) {
      const __m256 pt = _mm256_broadcast_ss(p + t);
      a0 = _mm256_fmadd_ps(pt, load8(v), a0);
      a1 = _mm256_fmadd_ps(pt, load8(v + 8), a1);
      a2 = _mm256_fmadd_ps(pt, load8(v + 16), a2);
      a3 = _mm256_fmadd_ps(pt, load8(v + 24), a3);
      a4 = _mm256_fmadd_ps(pt, load8(v + 32), a4);
      a5 = _mm256_fmadd_ps(pt, load8(v + 40), a5);
      a6 = _mm256_fmadd_ps(pt, load8(v + 48), a6);
      a7 = _mm256_fmadd_ps(pt, load8(v + 56), a7);
    }
    _mm256_storeu_ps(acc + i, a0);
    _mm256_storeu_ps(acc + i + 8, a1);
    _mm256_storeu_ps(acc + i + 16, a2);
    _mm256_storeu_ps(acc + i + 24, a3);
    _mm256_storeu_ps(acc + i + 32, a4);
    _mm256_storeu_ps(acc + i + 40, a5);
    _mm256_storeu_ps(acc + i + 48, a6);
    _mm256_storeu_ps(acc + i + 56, a7);
  }
  for (; i < d; i += 8) {
    __m256 a = _mm256_loadu_ps(acc + i);
    const cache_t* v = row + i;
    for (int64_t t = 0; t < n; ++t, v += stride) {
      a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), load8(v), a);
    }
    _mm256_storeu_ps(acc + i, a);
  }
}

// Asks for the n rows of `len` elements at row + r * stride to be brought into cache: the next
// block of a sequence lies anywhere in the pool, where the hardware prefetcher cannot guess it.
// Into L2, not L1: L1 has few outstanding-miss slots, which capped the rows in flight (30
// layers at 32 sequences x 320 tokens, float32: 30.4 -> 25.8 ms).
template <typename cache_t>
inline void prefetch_rows(const cache_t* row, int64_t n, int64_t stride, int64_t len) {
  const int64_t bytes = len * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t r = 0; r < n; ++r) {
    const char* p = reinterpret_cast<const char*>(row + r * stride);
    for (int64_t off = 0; off < bytes; off += 64) prefetch_line<1>(p + off);
  }
}

// Head h's share of the n_next rows of the next block at `next` (prefetch_rows), for an item of
// `heads` heads that each ask for theirs as they start: the requests spread over the block's
// work instead of coming at once.
template <typename cache_t>
inline void prefetch_share(const cache_t* next, int64_t n_next, int64_t h, int64_t heads,
                           int64_t stride, int64_t len) {
  const int64_t r0 = h * n_next / heads, r1 = (h + 1) * n_next / heads;
  if (r1 > r0) prefetch_rows(next + r0 * stride, r1 - r0, stride, len);
}

// fn(start, n, block, next, n_next) for each block of a sequence whose cache blocks are
// `blocks`: its first token, its number of tokens, its first row in `base` plus `offset`, and the
// same for the next block, whose rows fn prefetches as it goes. At the last block, "next" is
// `after` (n_after rows; none by default): whatever the caller reads once this pass is done.
// The first row of cache block `block` in `base` (keys or values), at column `offset`.
template <typename cache_t>
inline const cache_t* block_rows(const cache_t* base, int32_t block, int64_t block_size,
                                 int64_t slot_stride, int64_t offset) {
  return base + block * block_size * slot_stride + offset;
}

template <typename cache_t, typename Fn>
inline void for_each_block(const cache_t* base, const int32_t* blocks, int64_t seq_len,
                           int64_t block_size, int64_t slot_stride, int64_t offset, Fn&& fn,
                           const cache_t* after = nullptr, int64_t n_after = 0) {
  for (int64_t start = 0, b = 0; start < seq_len; start += block_size, ++b) {
    const int64_t n = std::min(block_size, seq_len - start);
    const cache_t* block = block_rows(base, blocks[b], block_size, slot_stride, offset);
    if (start + n < seq_len) {
      fn(start, n, block, block_rows(base, blocks[b + 1], block_size, slot_stride, offset),
         std::min(block_size, seq_len - start - n));
    } else {
      fn(start, n, block, after, n_after);
    }
  }
}

// The first block of a sequence's keys or values (`base`) for the item at column `offset`, and
// its number of tokens.
template <typename cache_t>
inline const cache_t* first_block(const PagedArgs<cache_t>& a, const cache_t* base, int64_t seq,
                                  int64_t offset, int64_t& n) {
  n = std::min<int64_t>(a.block_size, a.lens[seq]);
  return block_rows(base, a.table[seq * a.max_blocks], a.block_size, a.slot_stride, offset);
}

// The AVX2 version for head_dim a multiple of 8. Scores: key rows are read in order, and each
// head's eight-lane partial dot products of eight tokens are reduced together (hsum8), not one
// reduction per dot product. Values: a block's rows are added with broadcast weights into
// register accumulators (weighted_rows). The next block is prefetched a row or two at a time as
// the current one is read (the whole block at once measured ~15% slower at 32 sequences); the
// softmax is normalised once, on the output.
template <typename cache_t>
void paged_decode_attention_tiled(const PagedArgs<cache_t>& a, double scale) {
  const int64_t item_width = a.kv_per_item * a.head_dim;  // elements of a token row an item reads
  const __m256 vscale = _mm256_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, a.num_seqs * a.items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // (heads_per_item, seq_len)
    std::vector<float> acc;     // (heads_per_item, head_dim)
    std::vector<float> inv_sum(a.heads_per_item);
    std::vector<__m256> partial(a.heads_per_item * 8, _mm256_setzero_ps());  // (head, token)
    alignas(32) float lanes[8];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / a.items_per_seq;
      const int64_t offset = (item % a.items_per_seq) * item_width;  // first kv head's column
      const int64_t seq_len = a.lens[seq];
      const int32_t* blocks = a.table + seq * a.max_blocks;
      const float* q = a.q_base + (seq * a.num_heads) * a.head_dim + offset * a.group;
      scores.resize(a.heads_per_item * seq_len);
      for_each_block(a.k_base, blocks, seq_len, a.block_size, a.slot_stride, offset,
                     [&](int64_t start, int64_t n, const cache_t* block, const cache_t* next,
                         int64_t n_next) {
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
          const int64_t nt = std::min<int64_t>(8, n - t0);
          // Each token's row is read once, front to back, for all the item's heads.
          for (int64_t t = 0; t < nt; ++t) {
            const cache_t* k = block + (t0 + t) * a.slot_stride;
            if (t0 + t < n_next) {  // the same row of the next block, one row at a time
              prefetch_rows(next + (t0 + t) * a.slot_stride, 1, a.slot_stride, item_width);
            }
            for (int64_t h = 0; h < a.heads_per_item; ++h) {
              partial[h * 8 + t] = dot_lanes(q + h * a.head_dim, k + (h / a.group) * a.head_dim,
                                             a.head_dim);
            }
          }
          for (int64_t h = 0; h < a.heads_per_item; ++h) {
            const __m256* p = partial.data() + h * 8;
            const __m256 s =
                _mm256_mul_ps(hsum8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]), vscale);
            float* dst = scores.data() + h * seq_len + start + t0;
            if (nt == 8) {
              _mm256_storeu_ps(dst, s);
            } else {
              _mm256_store_ps(lanes, s);
              std::copy(lanes, lanes + nt, dst);
            }
          }
        }
      });
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        float* s = scores.data() + h * seq_len;
        const float max_score = max_of(s, seq_len);
        inv_sum[h] = 1.f / exp_shifted_sum(s, seq_len, max_score);
      }
      acc.assign(a.heads_per_item * a.head_dim, 0.f);
      for_each_block(a.v_base, blocks, seq_len, a.block_size, a.slot_stride, offset,
                     [&](int64_t start, int64_t n, const cache_t* block, const cache_t* next,
                         int64_t n_next) {
        for (int64_t h = 0; h < a.heads_per_item; ++h) {
          prefetch_share(next, n_next, h, a.heads_per_item, a.slot_stride, item_width);
          weighted_rows(acc.data() + h * a.head_dim, scores.data() + h * seq_len + start,
                        block + (h / a.group) * a.head_dim, a.slot_stride, n, a.head_dim);
        }
      });
      float* out_row = a.out_base + (seq * a.num_heads) * a.head_dim + offset * a.group;
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        for (int64_t i = 0; i < a.head_dim; ++i) {
          out_row[h * a.head_dim + i] = acc[h * a.head_dim + i] * inv_sum[h];
        }
      }
    }
  });
}
#endif

#ifdef OCTAVO_AVX512
// [sum(v[0]), ..., sum(v[15])]: sixteen horizontal sums in one vector, by four rounds of shuffles
// and adds that halve the vectors each time (45 instructions, where a reduction per vector
// takes eight each).
inline __m512 hsum16(const __m512 (&v)[16]) {
  __m512 s[8];  // lane pairs added: per 128-bit lane, [v2i: 0+2, v2i+1: 0+2, v2i: 1+3, v2i+1: 1+3]
  for (int i = 0; i < 8; ++i) {
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 t[4];  // per 128-bit lane, that lane's sum of v4i .. v4i+3
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Then across 128-bit lanes: 0x88 takes lanes 0 and 2 of each operand, 0xDD lanes 1 and 3.
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88),
                                 _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88),
                                 _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// Thirty-two cache values as two vectors of sixteen floats, and the matching query and output
// orders. A float32 row is read as it lies. A bfloat16 row is read 64 bytes at a time and split
// into even and odd elements without shuffles (load_split32, as the packed matmul reads its
// panels). The query is split the same way as it is loaded into registers, the value
// accumulators hold even and odd elements apart, and store() interleaves them back on the
// output.
template <typename cache_t>
struct Pairs;
template <>
struct Pairs<float> {
  static void load(const float* p, __m512& even, __m512& odd) {
    even = _mm512_loadu_ps(p);
    odd = _mm512_loadu_ps(p + 16);
  }
  static void query(const float* q, __m512& even, __m512& odd) { load(q, even, odd); }
  static void store(float* out, __m512 even, __m512 odd) {
    _mm512_storeu_ps(out, even);
    _mm512_storeu_ps(out + 16, odd);
  }
};
template <>
struct Pairs<c10::BFloat16> {
  static void load(const c10::BFloat16* p, __m512& even, __m512& odd) {
    load_split32(p, even, odd);
  }
  static void query(const float* q, __m512& even, __m512& odd) {
    const __m512 a = _mm512_loadu_ps(q), b = _mm512_loadu_ps(q + 16);
    even = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20,
                                                       22, 24, 26, 28, 30), b);
    odd = _mm512_permutex2var_ps(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                                      25, 27, 29, 31), b);
  }
  static void store(float* out, __m512 even, __m512 odd) {
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(
        even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(
        even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
        odd));
  }
};

// q . k for the n <= 16 key rows k + t * stride, in the first n lanes (the rest 0). The query's
// D floats stay in registers (in Pairs' order); each dot product is two FMA chains, and the
// sixteen are reduced together (hsum16).
template <int D, typename cache_t>
inline __m512 scores16(const float* q, const cache_t* k, int64_t stride, int64_t n) {
  static_assert(D % 32 == 0, "two chains of 16 lanes");
  __m512 qv[D / 16];
#pragma GCC unroll 4
  for (int j = 0; j < D / 32; ++j) Pairs<cache_t>::query(q + 32 * j, qv[2 * j], qv[2 * j + 1]);
  __m512 p[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const cache_t* row = k + t * stride;
      __m512 k0, k1;
      Pairs<cache_t>::load(row, k0, k1);
      __m512 a = _mm512_mul_ps(qv[0], k0);
      __m512 b = _mm512_mul_ps(qv[1], k1);
#pragma GCC unroll 4
      for (int j = 1; j < D / 32; ++j) {
        Pairs<cache_t>::load(row + 32 * j, k0, k1);
        a = _mm512_fmadd_ps(qv[2 * j], k0, a);
        b = _mm512_fmadd_ps(qv[2 * j + 1], k1, b);
      }
      p[t] = _mm512_add_ps(a, b);
    } else {
      p[t] = _mm512_setzero_ps();
    }
  }
  return hsum16(p);
}

// acc[h][0, D) += sum_t p[h * p_stride + t] * row_t[0, D) for the HB heads h < HB that share
// the n value rows row + t * stride: each row is loaded once into registers for all HB heads,
// whose HB x D / 16 accumulators are as many independent FMA chains. acc is in Pairs' order.
template <int D, int HB, typename cache_t>
inline void weighted_rows16(float* acc, const float* p, int64_t p_stride, const cache_t* row,
                            int64_t stride, int64_t n) {
  __m512 a[HB][D / 16];
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < D / 16; ++j) a[h][j] = _mm512_loadu_ps(acc + h * D + 16 * j);
  }
  for (int64_t t = 0; t < n; ++t, row += stride) {
    __m512 v[D / 16];
#pragma GCC unroll 4
    for (int j = 0; j < D / 32; ++j) Pairs<cache_t>::load(row + 32 * j, v[2 * j], v[2 * j + 1]);
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) {
      const __m512 pt = _mm512_set1_ps(p[h * p_stride + t]);
#pragma GCC unroll 8
      for (int j = 0; j < D / 16; ++j) a[h][j] = _mm512_fmadd_ps(pt, v[j], a[h][j]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);
  }
}

// Heads per weighted_rows16 call: sixteen accumulators at most, so that they, a value row and
// the broadcast weight fit the 32 vector registers.
template <int D>
constexpr int kValueHeads = 256 / D;

// weighted_rows16 for `heads` heads (any number), in calls of up to kValueHeads<D>.
template <int D, typename cache_t>
inline void weighted_heads(float* acc, const float* p, int64_t p_stride, const cache_t* row,
                           int64_t stride, int64_t n, int64_t heads) {
  for (int64_t h = 0; h < heads; h += kValueHeads<D>) {
    float* a = acc + h * D;
    const float* ph = p + h * p_stride;
    switch (std::min<int64_t>(kValueHeads<D>, heads - h)) {
      case 1: weighted_rows16<D, 1>(a, ph, p_stride, row, stride, n); break;
      case 2: weighted_rows16<D, 2>(a, ph, p_stride, row, stride, n); break;
      case 3:
        if constexpr (kValueHeads<D> >= 3) weighted_rows16<D, 3>(a, ph, p_stride, row, stride, n);
        break;
      default:
        if constexpr (kValueHeads<D> >= 4) weighted_rows16<D, 4>(a, ph, p_stride, row, stride, n);
        break;
    }
  }
}

// The AVX-512 version for head_dim D (64 or 128). Scores: sixteen keys at a time against one
// query head held in registers, reduced together (scores16); a block's keys of a kv head are
// read from memory for its first query head and from L1 for the others. Values: each value row
// loaded once for up to kValueHeads query heads (weighted_heads). The next block is asked for
// in small shares as this one is read (one per sixteen keys of a head, one per 32 value rows of
// a kv head), and the last block of a pass asks for the first of the next pass (keys -> values
// -> the next item's keys). As in the AVX2 version, the softmax is normalised on the output.
// 30 layers at 32 sequences x 320 tokens, bfloat16 / float32 cache: no prefetch 17.4 / 23.0 ms,
// shares within a pass 14.6 / 21.8, across passes too 13.5 / 21.2.
template <int D, typename cache_t>
void paged_decode_attention_avx512(const PagedArgs<cache_t>& a, double scale) {
  const int64_t item_width = a.kv_per_item * D;
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, a.num_seqs * a.items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // (heads_per_item, seq_len), exps after the softmax's first pass
    std::vector<float> acc;     // (heads_per_item, D)
    std::vector<float> inv_sum(a.heads_per_item);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / a.items_per_seq;
      const int64_t offset = (item % a.items_per_seq) * item_width;  // first kv head's column
      const int64_t seq_len = a.lens[seq];
      const int32_t* blocks = a.table + seq * a.max_blocks;
      const float* q = a.q_base + (seq * a.num_heads) * D + offset * a.group;
      scores.resize(a.heads_per_item * seq_len);
      // The keys' last block prefetches the values' first, and the values' last the next
      // item's first keys: one stream of prefetches through the item's work.
      int64_t n_values_first = 0, n_keys_next = 0;
      const cache_t* values_first = first_block(a, a.v_base, seq, offset, n_values_first);
      const cache_t* keys_next = nullptr;
      if (item + 1 < end) {
        keys_next = first_block(a, a.k_base, (item + 1) / a.items_per_seq,
                                ((item + 1) % a.items_per_seq) * item_width, n_keys_next);
      }
      for_each_block(a.k_base, blocks, seq_len, a.block_size, a.slot_stride, offset,
                     [&](int64_t start, int64_t n, const cache_t* block, const cache_t* next,
                         int64_t n_next) {
        const int64_t runs = (n + 15) / 16;
        for (int64_t h = 0; h < a.heads_per_item; ++h) {
          const cache_t* k = block + (h / a.group) * D;
          float* dst = scores.data() + h * seq_len + start;
          for (int64_t t0 = 0; t0 < n; t0 += 16) {
            prefetch_share(next, n_next, h * runs + t0 / 16, a.heads_per_item * runs,
                           a.slot_stride, item_width);
            const int64_t nt = std::min<int64_t>(16, n - t0);
            const __m512 s = _mm512_mul_ps(
                scores16<D>(q + h * D, k + t0 * a.slot_stride, a.slot_stride, nt), vscale);
            _mm512_mask_storeu_ps(dst + t0, static_cast<__mmask16>((1u << nt) - 1), s);
          }
        }
      }, values_first, n_values_first);
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        float* s = scores.data() + h * seq_len;
        const float max_score = max_of(s, seq_len);
        inv_sum[h] = 1.f / exp_shifted_sum(s, seq_len, max_score);
      }
      acc.assign(a.heads_per_item * D, 0.f);
      for_each_block(a.v_base, blocks, seq_len, a.block_size, a.slot_stride, offset,
                     [&](int64_t start, int64_t n, const cache_t* block, const cache_t* next,
                         int64_t n_next) {
        constexpr int64_t kRun = 32;
        const int64_t runs = (n + kRun - 1) / kRun;
        for (int64_t t0 = 0; t0 < n; t0 += kRun) {
          for (int64_t kv = 0; kv < a.kv_per_item; ++kv) {
            prefetch_share(next, n_next, (t0 / kRun) * a.kv_per_item + kv, runs * a.kv_per_item,
                           a.slot_stride, item_width);
            weighted_heads<D>(acc.data() + kv * a.group * D,
                              scores.data() + kv * a.group * seq_len + start + t0, seq_len,
                              block + t0 * a.slot_stride + kv * D, a.slot_stride,
                              std::min(kRun, n - t0), a.group);
          }
        }
      }, keys_next, n_keys_next);
      float* out_row = a.out_base + (seq * a.num_heads) * D + offset * a.group;
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        const __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int64_t i = 0; i < D; i += 32) {
          const float* sums = acc.data() + h * D + i;
          Pairs<cache_t>::store(out_row + h * D + i, _mm512_mul_ps(_mm512_loadu_ps(sums), inv),
                                _mm512_mul_ps(_mm512_loadu_ps(sums + 16), inv));
        }
      }
    }
  });
}
#endif

// The AVX-512 version for head_dim 64 or 128, the AVX2 one where head_dim allows it, else the
// generic loops.
template <typename cache_t>
void paged_decode_attention_impl(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                                 double scale) {
  const PagedArgs<cache_t> args(out, query, key_cache, value_cache, block_table, seq_lens);
#ifdef OCTAVO_AVX512
  if (args.head_dim == 64) {
    paged_decode_attention_avx512<64>(args, scale);
    return;
  }
  if (args.head_dim == 128) {
    paged_decode_attention_avx512<128>(args, scale);
    return;
  }
#endif
#ifdef OCTAVO_AVX2
  if (args.head_dim % 8 == 0) {
    paged_decode_attention_tiled(args, scale);
    return;
  }
#endif
  paged_decode_attention_generic(args, scale);
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale) {
  at::Tensor out = at::empty_like(query);
  if (key_cache.scalar_type() == at::kBFloat16) {
    paged_decode_attention_impl<c10::BFloat16>(out, query, key_cache, value_cache, block_table,
                                               seq_lens, scale);
  } else {
    paged_decode_attention_impl<float>(out, query, key_cache, value_cache, block_table,
                                       seq_lens, scale);
  }
  return out;
}

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

// Bytes of x per chunk of packed_linear: a quarter of the L2 cache, at least 256 KB.
inline int64_t x_chunk_bytes() {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the system does not say
  return std::max<int64_t>(256 * 1024, l2 > 0 ? l2 / 4 : 0);
}

template <typename weight_t>
void packed_linear_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                        int64_t n_dim) {
  // x: (M, K) float32; packed: (ceil(N / kPanel), K, kPanel); out: (M, N) float32.
  const int64_t m_rows = x.size(0), k_dim = x.size(1), num_panels = packed.size(0);
  if (m_rows == 0) return;  // e.g. logits of a step in which no request samples
  const float* xp = x.data_ptr<float>();
  const weight_t* wp = packed.data_ptr<weight_t>();
  float* op = out.data_ptr<float>();
  // Rows per chunk: a chunk of x stays in L2 while the panels pass over it, and each chunk
  // streams every panel once, so chunks are as large as a quarter of L2 allows (at least
  // 256 KB: 512 KB with a 2 MB L2 made 256-row matmuls ~10% faster than 256 KB did).
  // Chunks of equal size (in whole tiles), so that no short last chunk streams every panel for
  // a handful of rows.
  static const int64_t chunk_floats = x_chunk_bytes() / static_cast<int64_t>(sizeof(float));
  const int64_t max_chunk = std::max<int64_t>(
      kTileRows, (chunk_floats / std::max<int64_t>(k_dim, 1)) / kTileRows * kTileRows);
  const int64_t num_chunks = (m_rows + max_chunk - 1) / max_chunk;
  const int64_t chunk =
      ((m_rows + num_chunks - 1) / num_chunks + kTileRows - 1) / kTileRows * kTileRows;
  // Work item = (chunk of rows, panel); threads take contiguous runs of panels.
  at::parallel_for(0, num_chunks * num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / num_panels, p = item % num_panels;
      const int64_t m0 = c * chunk, n0 = p * kPanel;
      packed_rows(xp + m0 * k_dim, k_dim, wp + p * k_dim * kPanel, k_dim, op + m0 * n_dim + n0,
                  n_dim, std::min(kPanel, n_dim - n0), std::min(chunk, m_rows - m0));
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_dim) {
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (packed.scalar_type() == at::kBFloat16) {
    packed_linear_impl<c10::BFloat16>(out, x, packed, n_dim);
  } else {
    packed_linear_impl<float>(out, x, packed, n_dim);
  }
  return out;
}

// ---- paged prefill attention -----------------------------------------------------------------
//
// Chunks of several query tokens (a prompt, or the part of one after its cached prefix), each
// attending causally to its sequence's keys where they lie in the paged cache: query i of a
// chunk of q_len tokens in a sequence of seq_len sits at position seq_len - q_len + i and sees
// keys 0..that position. Two passes. First each (chunk, kv head)'s keys and values are read out
// of their blocks once, in float32: the keys as panels of kPanel keys (a transposed copy), the
// values as rows. Then flash-attention style: a work item is one chunk's tile of kQueryTile
// positions for all the query heads of one kv head (so each key serves every head that reads
// it), copied once as scaled rows; keys are taken kKeyStep at a time, the scores of every query
// row against them are one packed_rows call per panel (query rows x keys), the softmax is kept
// online along each row (a running max and sum), so nothing of seq_len x seq_len is ever held,
// and the weights meet the values in a second packed_rows call that adds into the output rows.
// A causal mask only ever cuts a row's tail, so masked keys get weight 0 without being scored.
// (Gathering inside the items instead read every key once per query tile after it: about half
// the kernel's time for 256-token prompts.)

constexpr int64_t kQueryTile = 32;  // query positions per work item
// Keys per step, a multiple of kPanel: every row is rescaled once per step, and a step's scores
// (rows x keys) still sit in L2. 256 rather than 64: ~8% faster for 256-token prompts.
constexpr int64_t kKeyStep = 256;

template <typename cache_t>
void paged_prefill_attention_impl(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_table, const at::Tensor& query_start,
                                  const at::Tensor& query_lens, const at::Tensor& seq_lens,
                                  double scale) {
  // query: (num_tokens, num_heads, head_dim) float32 with its heads contiguous within a token
  // (a view into a wider projection is fine); out: the same shape, contiguous; key_cache,
  // value_cache: (num_blocks, block_size, num_kv_heads, head_dim); block_table: (num_chunks,
  // max_blocks) int32; query_start, query_lens, seq_lens: (num_chunks,) int32; chunk c is rows
  // query_start[c] .. query_start[c] + query_lens[c].
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim, out_stride = num_heads * head_dim;
  const int64_t query_stride = query.stride(0);
  const int64_t num_chunks = seq_lens.size(0);
  const int64_t d_panels = (head_dim + kPanel - 1) / kPanel;
  const int64_t max_rows = group * kQueryTile;
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float* q_base = query.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  const cache_t* k_base = key_cache.data_ptr<cache_t>();
  const cache_t* v_base = value_cache.data_ptr<cache_t>();
  const float fscale = static_cast<float>(scale);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

  // Work items in the order (chunk, query tile, kv head); first_item[c] is chunk c's first.
  // Chunk c's keys and values for kv head g: key_at(c, g) holds its key panels ((keys rounded
  // up to kPanel) x head_dim floats, key kPanel * p + i of a panel at [p][d][i]), value_at(c,
  // g) its value rows (keys x head_dim, then one panel's width of slack: a panel of the last
  // columns reads a whole vector past a row's end where head_dim is not a multiple of kPanel).
  std::vector<int64_t> first_item(num_chunks + 1, 0), key_offset(num_chunks + 1, 0),
      value_offset(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t tiles = (q_lens[c] + kQueryTile - 1) / kQueryTile;
    first_item[c + 1] = first_item[c] + tiles * num_kv_heads;
    const int64_t padded = (lens[c] + kPanel - 1) / kPanel * kPanel;
    key_offset[c + 1] = key_offset[c] + num_kv_heads * padded * head_dim;
    value_offset[c + 1] = value_offset[c] + num_kv_heads * (lens[c] * head_dim + kPanel);
  }
  const int64_t num_items = first_item[num_chunks];
  if (num_items == 0) return;
  // Kept by the calling thread between calls up to kKeptGatherFloats (a fresh allocation would
  // fault its pages in on every call); a step with more context than that allocates its own.
  constexpr size_t kKeptGatherFloats = size_t{16} << 20;  // 64 MiB
  static thread_local std::vector<float> kept;
  std::vector<float> own;
  const size_t needed = static_cast<size_t>(key_offset[num_chunks] + value_offset[num_chunks]);
  std::vector<float>& gathered = needed <= kKeptGatherFloats ? kept : own;
  if (gathered.size() < needed) gathered.resize(needed);
  float* const keys_base = gathered.data();
  float* const values_base = keys_base + key_offset[num_chunks];
  auto key_at = [&](int64_t c, int64_t g) {
    const int64_t padded = (lens[c] + kPanel - 1) / kPanel * kPanel;
    return keys_base + key_offset[c] + g * padded * head_dim;
  };
  auto value_at = [&](int64_t c, int64_t g) {
    return values_base + value_offset[c] + g * (lens[c] * head_dim + kPanel);
  };

  // Pass 1: one task per (chunk, kv head, cache block).
  std::vector<int64_t> first_block(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t blocks = (lens[c] + block_size - 1) / block_size;
    first_block[c + 1] = first_block[c] + num_kv_heads * blocks;
  }
  at::parallel_for(0, first_block[num_chunks], 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = std::upper_bound(first_block.begin(), first_block.end(), task) -
                        first_block.begin() - 1;
      const int64_t blocks_in_chunk = (lens[c] + block_size - 1) / block_size;
      const int64_t g = (task - first_block[c]) / blocks_in_chunk;
      const int64_t b = (task - first_block[c]) % blocks_in_chunk;
      const int64_t j_begin = b * block_size;
      const int64_t j_end = std::min<int64_t>(j_begin + block_size, lens[c]);
      const int64_t slot0 = static_cast<int64_t>(table[c * max_blocks + b]) * block_size;
      float* kc = key_at(c, g);
      float* vc = value_at(c, g);
      for (int64_t j = j_begin; j < j_end; ++j) {
        const int64_t slot = slot0 + (j - j_begin);
        const cache_t* ksrc = k_base + slot * slot_stride + g * head_dim;
        const cache_t* vsrc = v_base + slot * slot_stride + g * head_dim;
        float* kdst = kc + (j / kPanel) * head_dim * kPanel + j % kPanel;
        for (int64_t d = 0; d < head_dim; ++d) kdst[d * kPanel] = to_float(ksrc[d]);
        float* vdst = vc + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) vdst[d] = to_float(vsrc[d]);
      }
      if (j_end == lens[c]) {  // the last block: zero the last panel's unused keys, the slack
        for (int64_t j = j_end; j % kPanel != 0; ++j) {
          float* kdst = kc + (j / kPanel) * head_dim * kPanel + j % kPanel;
          for (int64_t d = 0; d < head_dim; ++d) kdst[d * kPanel] = 0.f;
        }
        std::fill(vc + lens[c] * head_dim, vc + lens[c] * head_dim + kPanel, 0.f);
      }
    }
  });

  // Pass 2. Later tiles of a chunk see more keys, so threads take items in turn (item %
  // threads) rather than in contiguous runs, which would give one thread all the long ones.
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_threads, 1, [&](int64_t thread_begin, int64_t thread_end) {
    std::vector<float> q_rows(max_rows * head_dim);  // (rows, head_dim), scaled
    std::vector<float> scores(max_rows * kKeyStep);  // (rows, keys): scores, then weights
    std::vector<float> acc(max_rows * head_dim);     // (rows, head_dim), unnormalised
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    for (int64_t thread = thread_begin; thread < thread_end; ++thread) {
      for (int64_t item = thread; item < num_items; item += num_threads) {
        const int64_t c = std::upper_bound(first_item.begin(), first_item.end(), item) -
                          first_item.begin() - 1;
        const int64_t tile = (item - first_item[c]) / num_kv_heads;
        const int64_t g = (item - first_item[c]) % num_kv_heads;
        const int64_t q_len = q_lens[c], seq_len = lens[c];
        const int64_t p0 = tile * kQueryTile, np = std::min(kQueryTile, q_len - p0);
        const int64_t first_pos = seq_len - q_len + p0;  // position of the tile's first query
        const int64_t rows = group * np;                 // row r: head r / np, query r % np
        const float* keys = key_at(c, g);
        const float* values = value_at(c, g);
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = q_base + (starts[c] + p0 + r % np) * query_stride +
                             (g * group + r / np) * head_dim;
          float* dst = q_rows.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = src[d] * fscale;
        }
        std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
        std::fill(row_max.begin(), row_max.begin() + rows, kMinusInf);
        std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
        const int64_t num_keys = first_pos + np;  // the last query sees keys 0..num_keys-1
        for (int64_t j0 = 0; j0 < num_keys; j0 += kKeyStep) {
          const int64_t nk = std::min(kKeyStep, num_keys - j0);
          // scores[r][jj] = q_r . k_(j0 + jj) (scaled).
          for (int64_t p = 0; p * kPanel < nk; ++p) {
            packed_rows(q_rows.data(), head_dim, keys + (j0 / kPanel + p) * head_dim * kPanel,
                        head_dim, scores.data() + p * kPanel, kKeyStep,
                        std::min(kPanel, nk - p * kPanel), rows);
          }
          // Online softmax along each row, over the keys it sees (a prefix of this step's).
          for (int64_t r = 0; r < rows; ++r) {
            float* s = scores.data() + r * kKeyStep;
            const int64_t seen = std::clamp<int64_t>(first_pos + r % np - j0 + 1, 0, nk);
            const float step_max = max_of(s, seen);
            std::fill(s + seen, s + nk, 0.f);
            if (seen == 0) continue;  // nothing new for this row (its max and sum stand)
            const float new_max = std::max(row_max[r], step_max);
            // exp(-inf) = 0 at a row's first step, where acc and the sum are still 0.
            const float alpha = new_max == row_max[r] ? 1.f : std::exp(row_max[r] - new_max);
            row_max[r] = new_max;
            row_sum[r] = row_sum[r] * alpha + exp_shifted_sum(s, seen, new_max);
            if (alpha != 1.f) {
              float* a = acc.data() + r * head_dim;
              for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
            }
          }
          // acc[r] += weights[r] @ values.
          for (int64_t dp = 0; dp < d_panels; ++dp) {
            packed_rows(scores.data(), kKeyStep, values + j0 * head_dim + dp * kPanel, nk,
                        acc.data() + dp * kPanel, head_dim,
                        std::min(kPanel, head_dim - dp * kPanel), rows, head_dim, true);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = out_base + (starts[c] + p0 + r % np) * out_stride +
                       (g * group + r / np) * head_dim;
          const float inv = 1.f / row_sum[r];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[r * head_dim + d] * inv;
        }
      }
    }
  });
}

// Writes the rows of `out` that belong to the chunks; other rows are left as they are.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale) {
  if (key_cache.scalar_type() == at::kBFloat16) {
    paged_prefill_attention_impl<c10::BFloat16>(out, query, key_cache, value_cache, block_table,
                                                query_start, query_lens, seq_lens, scale);
  } else {
    paged_prefill_attention_impl<float>(out, query, key_cache, value_cache, block_table,
                                        query_start, query_lens, seq_lens, scale);
  }
}

// ---- RMSNorm with the residual add, and rotary embedding --------------------------------------

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

// gate_up: (num_tokens, 2 * inter) float32 contiguous, the gate's columns first (the packed
// gate/up projection). Returns silu(gate) * up = gate / (1 + exp(-gate)) * up, shape
// (num_tokens, inter).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t num_tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({num_tokens, inter}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // A few rows per task: one decode row is ~2 us of work, less than waking a thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = in + t * 2 * inter;
      const float* up = gate + inter;
      float* o = op + t * inter;
      int64_t i = 0;
#ifdef OCTAVO_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + 8 <= inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_any(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < inter; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

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

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping) {
  if (kv_cache.scalar_type() == at::kBFloat16) {
    write_kv_cache_impl<c10::BFloat16>(key, value, kv_cache, slot_mapping);
  } else {
    write_kv_cache_impl<float>(key, value, kv_cache, slot_mapping);
  }
}

// ---- one decoder layer for a batch of decode rows ---------------------------------------------
//
// A Llama-style layer (octavo/model/llama.py, LlamaDecoderLayer with a residual) over rows that
// are all single-token decodes, as one call of the kernels above in the order the Python layer
// calls them, so the results are the same bit for bit. It exists because at small batches the
// ~25 torch ops and Python calls around the kernels of each layer cost as much as the work.
//   residual <- hidden + residual; x <- input_norm(residual)            (in place)
//   q, k, v <- split(x @ Wqkv^T + b); rotary on q and k; k, v -> cache at slot_mapping
//   x <- paged_attention(q) @ Wo^T + b
//   residual <- x + residual; x <- post_norm(residual)
//   returns down(silu(gate(x)) * up(x))
// Packed weights are from pack_linear_weight; the Python wrapper checks the rest.
at::Tensor decode_layer(at::Tensor hidden, at::Tensor residual, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& qkv_weight,
                        const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                        const c10::optional<at::Tensor>& o_bias,
                        const at::Tensor& gate_up_weight,
                        const c10::optional<at::Tensor>& gate_up_bias,
                        const at::Tensor& down_weight, const c10::optional<at::Tensor>& down_bias,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t intermediate_size, double scale, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_table,
                        const at::Tensor& seq_lens) {
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto linear = [](const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias, int64_t n) {
    at::Tensor out = packed_linear(x, weight, n);
    if (bias.has_value()) out.add_(*bias);
    return out;
  };
  rms_norm(hidden, residual, input_norm, eps, true);
  at::Tensor qkv = linear(hidden, qkv_weight, qkv_bias, q_size + 2 * kv_size);
  rotary(qkv.narrow(1, 0, q_size + kv_size).view({num_tokens, num_heads + num_kv_heads, head_dim}),
         cos, sin);
  const at::Tensor key = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  const at::Tensor value =
      qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  write_kv_cache(key, value, kv_cache, slot_mapping);
  const at::Tensor query =
      qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim}).contiguous();
  const at::Tensor attn = paged_decode_attention(query, kv_cache.select(0, 0),
                                                 kv_cache.select(0, 1), block_table, seq_lens,
                                                 scale);
  at::Tensor x = linear(attn.view({num_tokens, q_size}), o_weight, o_bias, hidden_size);
  rms_norm(x, residual, post_norm, eps, true);
  const at::Tensor gate_up = linear(x, gate_up_weight, gate_up_bias, 2 * intermediate_size);
  return linear(silu_and_mul(gate_up), down_weight, down_bias, hidden_size);
}

// ---- sampling ---------------------------------------------------------------------------------
//
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

}  // namespace

TORCH_LIBRARY(octavo, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, float scale) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, Tensor query_start, Tensor query_lens, "
      "Tensor seq_lens, float scale) -> ()");
  m.def("packed_linear(Tensor x, Tensor packed, int n) -> Tensor");
  // Columns per packed_linear panel in this build (the layout pack_linear_weight must write).
  m.def("packed_panel() -> int", []() -> int64_t { return kPanel; });
  m.def(
      "rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, bool has_residual)"
      " -> ()");
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("sample_categorical(Tensor(a!) logits, Tensor uniform) -> Tensor");
  // Whether this build has the AVX2 paths (else every kernel runs its plain loops).
  m.def("vectorized() -> bool", []() -> bool {
#ifdef OCTAVO_AVX2
    return true;
#else
    return false;
#endif
  });
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping)"
      " -> ()");
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor(b!) residual, Tensor input_norm, "
      "Tensor post_norm, float eps, Tensor qkv_weight, Tensor? qkv_bias, Tensor o_weight, "
      "Tensor? o_bias, Tensor gate_up_weight, Tensor? gate_up_bias, Tensor down_weight, "
      "Tensor? down_bias, int num_heads, int num_kv_heads, int head_dim, "
      "int intermediate_size, float scale, Tensor cos, Tensor sin, Tensor(c!) kv_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor seq_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(octavo, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("packed_linear", &packed_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("sample_categorical", &sample_categorical);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("decode_layer", &decode_layer);
}
