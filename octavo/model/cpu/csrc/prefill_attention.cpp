// Paged prefill attention: causal attention of prompt chunks over keys read from the paged cache.

#include "ops.h"
#include "panels.h"

namespace octavo {
namespace {

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
// A causal mask only ever cuts a row's tail, so masked keys get weight 0 without being scored;
// a sliding window cuts its head as well, and key steps before every row's window are skipped.
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
                                  double scale, int64_t window, double softcap) {
  // query: (num_tokens, num_heads, head_dim) float32 with its heads contiguous within a token
  // (a view into a wider projection is fine); out: the same shape, contiguous; key_cache,
  // value_cache: (num_blocks, block_size, num_kv_heads, head_dim); block_table: (num_chunks,
  // max_blocks) int32; query_start, query_lens, seq_lens: (num_chunks,) int32; chunk c is rows
  // query_start[c] .. query_start[c] + query_lens[c]. window: 0, or a sliding window (a
  // query at position p sees keys p - window + 1 .. p); softcap: 0, or scores become softcap *
  // tanh(score / softcap) before the softmax.
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
  const float fcap = static_cast<float>(softcap);
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
        // Under a window, key steps wholly before the first query's window hold nothing.
        const int64_t first_key = window > 0 ? std::max<int64_t>(first_pos - window + 1, 0) : 0;
        for (int64_t j0 = first_key / kKeyStep * kKeyStep; j0 < num_keys; j0 += kKeyStep) {
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
            // The row sees this step's keys lo .. seen - 1 (lo > 0 only under a window).
            const int64_t pos = first_pos + r % np;
            const int64_t seen = std::clamp<int64_t>(pos - j0 + 1, 0, nk);
            const int64_t lo =
                window > 0 ? std::clamp<int64_t>(pos - window + 1 - j0, 0, seen) : 0;
            if (fcap > 0.f) {
              for (int64_t j = lo; j < seen; ++j) s[j] = fcap * std::tanh(s[j] / fcap);
            }
            const float step_max = max_of(s + lo, seen - lo);
            std::fill(s, s + lo, 0.f);
            std::fill(s + seen, s + nk, 0.f);
            if (seen == lo) continue;  // nothing new for this row (its max and sum stand)
            const float new_max = std::max(row_max[r], step_max);
            // exp(-inf) = 0 at a row's first step, where acc and the sum are still 0.
            const float alpha = new_max == row_max[r] ? 1.f : std::exp(row_max[r] - new_max);
            row_max[r] = new_max;
            row_sum[r] = row_sum[r] * alpha + exp_shifted_sum(s + lo, seen - lo, new_max);
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

}  // namespace

// Writes the rows of `out` that belong to the chunks; other rows are left as they are.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double softcap) {
  if (key_cache.scalar_type() == at::kBFloat16) {
    paged_prefill_attention_impl<c10::BFloat16>(out, query, key_cache, value_cache, block_table,
                                                query_start, query_lens, seq_lens, scale, window,
                                                softcap);
  } else {
    paged_prefill_attention_impl<float>(out, query, key_cache, value_cache, block_table,
                                        query_start, query_lens, seq_lens, scale, window,
                                        softcap);
  }
}

}  // namespace octavo
