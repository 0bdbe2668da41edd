// Paged decode attention: one query token per sequence over its blocks in the paged cache.

#include "bf16_dot.h"
#include "ops.h"
#include "simd.h"

namespace octavo {
namespace {


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
//   window: 0, or a sliding window (the query sees its last `window` keys); softcap: 0, or
//   scores become softcap * tanh(score / softcap) before the softmax
template <typename cache_t>
struct PagedArgs {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, group, max_blocks;
  int64_t window;
  float softcap;
  int64_t slot_stride;  // between consecutive tokens
  const float* q_base;
  int64_t q_stride;  // between sequences' queries (a row of a wider projection, or heads x dim)
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
            const at::Tensor& seq_lens, int64_t window_, double softcap_)
      : num_seqs(query.size(0)),
        num_heads(query.size(1)),
        head_dim(query.size(2)),
        block_size(key_cache.size(1)),
        num_kv_heads(key_cache.size(2)),
        group(num_heads / num_kv_heads),
        max_blocks(block_table.size(1)),
        window(window_),
        softcap(static_cast<float>(softcap_)),
        slot_stride(num_kv_heads * head_dim),
        q_base(query.data_ptr<float>()),
        q_stride(query.stride(0)),
        out_base(out.data_ptr<float>()),
        k_base(key_cache.data_ptr<cache_t>()),
        v_base(value_cache.data_ptr<cache_t>()),
        table(block_table.data_ptr<int32_t>()),
        lens(seq_lens.data_ptr<int32_t>()),
        kv_per_item(num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1),
        items_per_seq(num_kv_heads / kv_per_item),
        heads_per_item(kv_per_item * group) {}
};

// A head's scores of a sequence before its softmax: soft-capped, and those outside the window
// (every key but the last `window`) set to -inf, which the softmax turns into weight 0.
template <typename cache_t>
inline void shape_scores(const PagedArgs<cache_t>& a, float* s, int64_t seq_len) {
  if (a.softcap > 0.f) {
    for (int64_t t = 0; t < seq_len; ++t) s[t] = a.softcap * std::tanh(s[t] / a.softcap);
  }
  if (a.window > 0 && seq_len > a.window) {
    std::fill(s, s + seq_len - a.window, -std::numeric_limits<float>::infinity());
  }
}

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
      const float* q = a.q_base + seq * a.q_stride + kv_first * a.group * a.head_dim;
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
        shape_scores(a, s, seq_len);
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
      const float* q = a.q_base + seq * a.q_stride + offset * a.group;
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
        shape_scores(a, s, seq_len);
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

// What the AVX-512 kernel multiplies with, per work item, as two policies: FloatProducts
// (float32 FMAs on the cache's values widened as they are loaded) and Bf16Products (below,
// AVX512-BF16's pair dot products over a bfloat16 cache). queries(): the item's query heads as
// the scores read them; scores(): sixteen keys' scaled scores of one head; weights(): the
// softmax's exps as the value pass reads them; values(): a run of value rows into the heads'
// accumulators; store(): one 32-value run of a head's accumulators, normalised, in order.
template <int D, typename cache_t>
struct FloatProducts {
  using cache = cache_t;
  FloatProducts(int64_t /*heads*/, double scale)
      : vscale(_mm512_set1_ps(static_cast<float>(scale))) {}
  void queries(const float* q) { q_ = q; }
  __m512 scores(int64_t h, const cache_t* k, int64_t stride, int64_t n) const {
    return _mm512_mul_ps(scores16<D>(q_ + h * D, k, stride, n), vscale);
  }
  void weights(const float* /*scores*/, int64_t /*heads*/, int64_t /*seq_len*/) {}
  void values(float* acc, const float* scores, int64_t h, int64_t seq_len, int64_t t,
              const cache_t* row, int64_t stride, int64_t n, int64_t heads) const {
    weighted_heads<D>(acc, scores + h * seq_len + t, seq_len, row, stride, n, heads);
  }
  static void store(float* out, const float* sums, __m512 inv) {
    Pairs<cache_t>::store(out, _mm512_mul_ps(_mm512_loadu_ps(sums), inv),
                          _mm512_mul_ps(_mm512_loadu_ps(sums + 16), inv));
  }
  const float* q_ = nullptr;
  __m512 vscale;
};
#endif

#ifdef OCTAVO_AVX512BF16
// The bfloat16 products over a bfloat16 cache (AVX512-BF16's vdpbf16ps; Bf16Products): each
// head's query is scaled and rounded to bfloat16 once per item, so that a key's score is D / 32
// pair dot products instead of D / 16 FMAs on widened halves; the softmax's weights are rounded
// to bfloat16 too, and two value rows at a time are interleaved into pairs (t, t + 1) for the
// weighted sum. The same rounding as the prompt kernel's bfloat16 products
// (prefill_attention.cpp); float32 sums, the softmax in float32. Against the float kernel
// (30 layers, 320 tokens a sequence, Zen 4): 0.86-0.91x the time at 1-32 sequences from
// memory, 0.68x from L3.

// q . k for the n <= 16 key rows k + t * stride, in the first n lanes (the rest 0): the query's
// D / 32 pair vectors against each row's, the sixteen reduced together (hsum16).
template <int D>
inline __m512 scores16_bf16(const __m512bh* q, const c10::BFloat16* k, int64_t stride,
                            int64_t n) {
  __m512 p[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const c10::BFloat16* row = k + t * stride;
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0],
                                  (__m512bh)_mm512_loadu_si512(row));
#pragma GCC unroll 4
      for (int j = 1; j < D / 32; ++j) {
        a = _mm512_dpbf16_ps(a, q[j], (__m512bh)_mm512_loadu_si512(row + 32 * j));
      }
      p[t] = a;
    } else {
      p[t] = _mm512_setzero_ps();
    }
  }
  return hsum16(p);
}

// acc[h] += sum_t w[h * w_stride + t] * row_t for the HB heads that share the n value rows
// row + t * stride, two rows at a time: their 32-value runs interleaved by 16-bit elements
// (unpacklo / unpackhi per 128-bit lane) are pair vectors (row_t[i], row_t+1[i]) that one
// vdpbf16ps multiplies by the broadcast weight pair (w_t, w_t+1). An odd last row pairs with
// zeros. acc is kept in that interleaved order (unpack_order_store puts it back).
template <int D, int HB>
inline void weighted_rows16_bf16(float* acc, const c10::BFloat16* w, int64_t w_stride,
                                 const c10::BFloat16* row, int64_t stride, int64_t n) {
  __m512 a[HB][D / 16];
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < D / 16; ++j) a[h][j] = _mm512_loadu_ps(acc + h * D + 16 * j);
  }
  for (int64_t t = 0; t < n; t += 2, row += 2 * stride) {
    __m512bh v[D / 16];
    const bool pair = t + 1 < n;
#pragma GCC unroll 4
    for (int j = 0; j < D / 32; ++j) {
      const __m512i r0 = _mm512_loadu_si512(row + 32 * j);
      const __m512i r1 = pair ? _mm512_loadu_si512(row + stride + 32 * j) : _mm512_setzero_si512();
      v[2 * j] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
      v[2 * j + 1] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) {
      const __m512bh wt = broadcast_pair(w + h * w_stride + t);
#pragma GCC unroll 8
      for (int j = 0; j < D / 16; ++j) a[h][j] = _mm512_dpbf16_ps(a[h][j], v[j], wt);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);
  }
}

// weighted_rows16_bf16 for `heads` heads, in calls of up to kValueHeads<D>.
template <int D>
inline void weighted_heads_bf16(float* acc, const c10::BFloat16* w, int64_t w_stride,
                                const c10::BFloat16* row, int64_t stride, int64_t n,
                                int64_t heads) {
  for (int64_t h = 0; h < heads; h += kValueHeads<D>) {
    float* a = acc + h * D;
    const c10::BFloat16* wh = w + h * w_stride;
    switch (std::min<int64_t>(kValueHeads<D>, heads - h)) {
      case 1: weighted_rows16_bf16<D, 1>(a, wh, w_stride, row, stride, n); break;
      case 2: weighted_rows16_bf16<D, 2>(a, wh, w_stride, row, stride, n); break;
      case 3:
        if constexpr (kValueHeads<D> >= 3) {
          weighted_rows16_bf16<D, 3>(a, wh, w_stride, row, stride, n);
        }
        break;
      default:
        if constexpr (kValueHeads<D> >= 4) {
          weighted_rows16_bf16<D, 4>(a, wh, w_stride, row, stride, n);
        }
        break;
    }
  }
}

// 32 sums of a run in weighted_rows16_bf16's interleaved order (lo, hi: 128-bit lane L holds
// elements 8 L .. 8 L + 3 in lo, 8 L + 4 .. 8 L + 7 in hi), times inv, stored in order.
inline void unpack_order_store(float* out, __m512 lo, __m512 hi, __m512 inv) {
  lo = _mm512_mul_ps(lo, inv);
  hi = _mm512_mul_ps(hi, inv);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(
      lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(
      lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi));
}

// The policy of paged_decode_attention_avx512 for bfloat16 products (see FloatProducts).
template <int D>
struct Bf16Products {
  using cache = c10::BFloat16;
  Bf16Products(int64_t heads, double scale)
      : vscale(_mm512_set1_ps(static_cast<float>(scale))), qb(heads * (D / 32)) {}
  void queries(const float* q) {
    for (size_t i = 0; i < qb.size(); ++i) {
      const float* qi = q + 32 * i;
      qb[i] = (__m512bh)to_bf16(_mm512_mul_ps(_mm512_loadu_ps(qi), vscale),
                                _mm512_mul_ps(_mm512_loadu_ps(qi + 16), vscale));
    }
  }
  __m512 scores(int64_t h, const cache* k, int64_t stride, int64_t n) const {
    return scores16_bf16<D>(qb.data() + h * (D / 32), k, stride, n);
  }
  // (heads, seq_len + 1): the exps in bfloat16, a 0 after each head's (an odd last value row's
  // pair reads it).
  void weights(const float* scores, int64_t heads, int64_t seq_len) {
    w_stride = seq_len + 1;
    w.resize(heads * w_stride);
    for (int64_t h = 0; h < heads; ++h) {
      cache* wh = w.data() + h * w_stride;
      to_bf16_row(scores + h * seq_len, seq_len, wh);
      wh[seq_len] = cache(0.f);
    }
  }
  void values(float* acc, const float* /*scores*/, int64_t h, int64_t /*seq_len*/, int64_t t,
              const cache* row, int64_t stride, int64_t n, int64_t heads) const {
    weighted_heads_bf16<D>(acc, w.data() + h * w_stride + t, w_stride, row, stride, n, heads);
  }
  static void store(float* out, const float* sums, __m512 inv) {
    unpack_order_store(out, _mm512_loadu_ps(sums), _mm512_loadu_ps(sums + 16), inv);
  }
  __m512 vscale;
  std::vector<__m512bh> qb;  // (heads, D / 32): the scaled queries in bfloat16
  std::vector<cache> w;
  int64_t w_stride = 0;
};
#endif

#ifdef OCTAVO_AVX512
// The AVX-512 version for head_dim D (64 or 128), its products those of the policy P
// (FloatProducts, Bf16Products). Scores: sixteen keys at a time against one query head,
// reduced together; a block's keys of a kv head are read from memory for its first query head
// and from L1 for the others. Values: each value row loaded once for up to kValueHeads query
// heads. The next block is asked for in small shares as this one is read (one per sixteen keys
// of a head, one per 32 value rows of a kv head), and the last block of a pass asks for the
// first of the next pass (keys -> values -> the next item's keys). As in the AVX2 version, the
// softmax is normalised on the output.
// 30 layers at 32 sequences x 320 tokens, bfloat16 / float32 cache: no prefetch 17.4 / 23.0 ms,
// shares within a pass 14.6 / 21.8, across passes too 13.5 / 21.2.
template <int D, typename P>
void paged_decode_attention_avx512(const PagedArgs<typename P::cache>& a, double scale) {
  using cache_t = typename P::cache;
  const int64_t item_width = a.kv_per_item * D;

  at::parallel_for(0, a.num_seqs * a.items_per_seq, 1, [&](int64_t begin, int64_t end) {
    P products(a.heads_per_item, scale);
    std::vector<float> scores;  // (heads_per_item, seq_len), exps after the softmax's first pass
    std::vector<float> acc;     // (heads_per_item, D), in the order P's value products keep
    std::vector<float> inv_sum(a.heads_per_item);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / a.items_per_seq;
      const int64_t offset = (item % a.items_per_seq) * item_width;  // first kv head's column
      const int64_t seq_len = a.lens[seq];
      const int32_t* blocks = a.table + seq * a.max_blocks;
      products.queries(a.q_base + seq * a.q_stride + offset * a.group);
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
            const __m512 s = products.scores(h, k + t0 * a.slot_stride, a.slot_stride, nt);
            _mm512_mask_storeu_ps(dst + t0, static_cast<__mmask16>((1u << nt) - 1), s);
          }
        }
      }, values_first, n_values_first);
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        float* s = scores.data() + h * seq_len;
        shape_scores(a, s, seq_len);
        const float max_score = max_of(s, seq_len);
        inv_sum[h] = 1.f / exp_shifted_sum(s, seq_len, max_score);
      }
      products.weights(scores.data(), a.heads_per_item, seq_len);
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
            products.values(acc.data() + kv * a.group * D, scores.data(), kv * a.group, seq_len,
                            start + t0, block + t0 * a.slot_stride + kv * D, a.slot_stride,
                            std::min(kRun, n - t0), a.group);
          }
        }
      }, keys_next, n_keys_next);
      float* out_row = a.out_base + (seq * a.num_heads) * D + offset * a.group;
      for (int64_t h = 0; h < a.heads_per_item; ++h) {
        const __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int64_t i = 0; i < D; i += 32) {
          P::store(out_row + h * D + i, acc.data() + h * D + i, inv);
        }
      }
    }
  });
}
#endif

// The AVX-512 version for head_dim 64 or 128, the AVX2 one where head_dim allows it, else the
// generic loops.
template <typename cache_t>
void paged_decode_attention_impl(const PagedArgs<cache_t>& args, double scale) {
#ifdef OCTAVO_AVX512
  if (args.head_dim == 64) {
    paged_decode_attention_avx512<64, FloatProducts<64, cache_t>>(args, scale);
    return;
  }
  if (args.head_dim == 128) {
    paged_decode_attention_avx512<128, FloatProducts<128, cache_t>>(args, scale);
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

// bfloat16 products where this build has them for the head size, else false.
bool bf16_decode(const PagedArgs<c10::BFloat16>& args, double scale) {
#ifdef OCTAVO_AVX512BF16
  if (args.head_dim == 64) {
    paged_decode_attention_avx512<64, Bf16Products<64>>(args, scale);
    return true;
  }
  if (args.head_dim == 128) {
    paged_decode_attention_avx512<128, Bf16Products<128>>(args, scale);
    return true;
  }
#endif
  return false;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double softcap, bool bf16_products) {
  // The query's heads lie side by side in a row (its sequences may be rows of a wider
  // projection: the fused layer's q, k and v); the output is contiguous.
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode_attention: each query's heads must be contiguous");
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (key_cache.scalar_type() == at::kBFloat16) {
    const PagedArgs<c10::BFloat16> args(out, query, key_cache, value_cache, block_table,
                                        seq_lens, window, softcap);
    if (!(bf16_products && bf16_decode(args, scale))) paged_decode_attention_impl(args, scale);
  } else {
    TORCH_CHECK(!bf16_products, "paged_decode_attention: bf16_products needs a bfloat16 cache");
    const PagedArgs<float> args(out, query, key_cache, value_cache, block_table, seq_lens,
                                window, softcap);
    paged_decode_attention_impl(args, scale);
  }
  return out;
}

}  // namespace octavo
