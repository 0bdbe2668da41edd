// Paged prefill attention: causal attention of prompt chunks over keys read from the paged cache.

#include <optional>

#include "amx.h"
#include "bf16_dot.h"
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

// One key step of the online softmax for one query row: s holds its scores against the step's
// nk keys, the query sits `pos` keys after the step's first (negative: before it). The keys it
// does not see (after it, or before its window) get weight 0, up to `width` entries; the others
// exp(score - max) under a soft-cap if any; its running max and sum are updated, and its output
// so far (acc, len floats) rescaled to the new max.
inline void softmax_step(float* s, int64_t pos, int64_t nk, int64_t width, int64_t window,
                         float fcap, float& row_max, float& row_sum, float* acc, int64_t len) {
  // The row sees this step's keys lo .. seen - 1 (lo > 0 only under a window).
  const int64_t seen = std::clamp<int64_t>(pos + 1, 0, nk);
  const int64_t lo = window > 0 ? std::clamp<int64_t>(pos - window + 1, 0, seen) : 0;
  if (fcap > 0.f) {
    for (int64_t j = lo; j < seen; ++j) s[j] = fcap * std::tanh(s[j] / fcap);
  }
  const float step_max = max_of(s + lo, seen - lo);
  std::fill(s, s + lo, 0.f);
  std::fill(s + seen, s + width, 0.f);
  if (seen == lo) return;  // nothing new for this row (its max and sum stand)
  const float new_max = std::max(row_max, step_max);
  // exp(-inf) = 0 at a row's first step, where acc and the sum are still 0.
  const float alpha = new_max == row_max ? 1.f : std::exp(row_max - new_max);
  row_max = new_max;
  row_sum = row_sum * alpha + exp_shifted_sum(s + lo, seen - lo, new_max);
  if (alpha != 1.f) {
    for (int64_t d = 0; d < len; ++d) acc[d] *= alpha;
  }
}

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
            softmax_step(scores.data() + r * kKeyStep, first_pos + r % np - j0, nk, nk, window,
                         fcap, row_max[r], row_sum[r], acc.data() + r * head_dim, head_dim);
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


#ifdef OCTAVO_AVX512BF16
// The same attention for a bfloat16 cache with its two products in bfloat16 (float32 sums):
// on AMX tiles (tdpbf16ps) with `amx`, else by AVX512-BF16's pair dot products (vdpbf16ps,
// bf16_dot.h). The scaled query rows are rounded to bfloat16, and so are the softmax weights
// before they meet the values; the softmax itself stays in float32, with the same key steps,
// masks and online rescaling as above. Pass 1 lays each (chunk, kv head)'s keys out as the
// tiles' second operand for q . k (per 16 keys, rows of dimension pairs: key j, dimension d at
// [j / 16][d / 2][j % 16][d % 2], dimensions padded with zeros to a multiple of 32) and its
// values for p . v (rows of key pairs: [j / 2][d][j % 2], dimensions padded to 32), keys
// padded with zeros to a multiple of 32: a row of a tile, 16 keys or dimensions by one pair, is
// also the 64-byte vector vdpbf16ps takes. Pass 2 takes keys 32 at a time; on AMX the rows of an
// item 32 at a time (padded with zero queries): tiles 0-3 sum a 32 x 32 block (two row tiles by
// two key or dimension tiles), 4-5 hold the rows' operands, 6-7 the keys' or values'; with the
// dot products up to 12 rows at a time in registers (dot_tile).
void paged_prefill_attention_tiles(at::Tensor& out, const at::Tensor& query,
                                   const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_table, const at::Tensor& query_start,
                                   const at::Tensor& query_lens, const at::Tensor& seq_lens,
                                   double scale, int64_t window, double softcap, bool amx) {
  using bf16 = c10::BFloat16;
  auto up = [](int64_t n, int64_t to) { return (n + to - 1) / to * to; };
  constexpr int64_t kAmxRows = 16;  // rows of an AMX tile (amx.h's, where the build has AMX)
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim, out_stride = num_heads * head_dim;
  const int64_t query_stride = query.stride(0);
  const int64_t num_chunks = seq_lens.size(0);
  const int64_t dk = up(head_dim, 2 * kAmxRows);  // q . k: 32 products a tile row
  const int64_t dv = up(head_dim, 2 * kAmxRows);  // p . v: 32 output columns a block
  const int64_t max_rows = up(group * kQueryTile, 2 * kAmxRows);
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float* q_base = query.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  const bf16* k_base = key_cache.data_ptr<bf16>();
  const bf16* v_base = value_cache.data_ptr<bf16>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

  std::vector<int64_t> first_item(num_chunks + 1, 0), offset(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    first_item[c + 1] = first_item[c] + (q_lens[c] + kQueryTile - 1) / kQueryTile * num_kv_heads;
    offset[c + 1] = offset[c] + num_kv_heads * up(lens[c], 2 * kAmxRows) * (dk + dv);
  }
  const int64_t num_items = first_item[num_chunks];
  if (num_items == 0) return;
  constexpr size_t kKeptGathered = size_t{32} << 20;  // 64 MiB of bfloat16, as above
  static thread_local std::vector<bf16> kept;
  std::vector<bf16> own;
  const size_t needed = static_cast<size_t>(offset[num_chunks]);
  std::vector<bf16>& gathered = needed <= kKeptGathered ? kept : own;
  if (gathered.size() < needed) gathered.resize(needed);
  // Chunk c's keys for kv head g, then its values.
  auto key_at = [&](int64_t c, int64_t g) {
    return gathered.data() + offset[c] + g * up(lens[c], 2 * kAmxRows) * (dk + dv);
  };
  auto value_at = [&](int64_t c, int64_t g) {
    return key_at(c, g) + up(lens[c], 2 * kAmxRows) * dk;
  };

  // Pass 1: one task per (chunk, kv head, cache block); the last block also writes the zeros
  // of the padding keys.
  std::vector<int64_t> first_block(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    first_block[c + 1] = first_block[c] + num_kv_heads * ((lens[c] + block_size - 1) / block_size);
  }
  at::parallel_for(0, first_block[num_chunks], 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = std::upper_bound(first_block.begin(), first_block.end(), task) -
                        first_block.begin() - 1;
      const int64_t blocks_in_chunk = (lens[c] + block_size - 1) / block_size;
      const int64_t g = (task - first_block[c]) / blocks_in_chunk;
      const int64_t b = (task - first_block[c]) % blocks_in_chunk;
      const int64_t j_begin = b * block_size;
      const int64_t j_last = std::min<int64_t>(j_begin + block_size, lens[c]);
      const int64_t j_end = j_last == lens[c] ? up(lens[c], 2 * kAmxRows) : j_last;
      const int64_t slot0 = static_cast<int64_t>(table[c * max_blocks + b]) * block_size;
      bf16* kc = key_at(c, g);
      bf16* vc = value_at(c, g);
      auto source = [&](int64_t j) { return (slot0 + j - j_begin) * slot_stride + g * head_dim; };
      // The keys and values done by the vector loops; the scalar ones below do the rest (and
      // the padding keys).
      int64_t key_done = j_begin, value_done = j_begin;
      if (head_dim == dk && head_dim == dv && head_dim % 32 == 0) {
        // 16 keys at a time: word p (dimensions 2p, 2p + 1) of key r goes to word p * 16 + r
        // of their group, one gather per word across the 16 keys.
        const __m512i key_rows = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(static_cast<int32_t>(slot_stride / 2)));
        for (; key_done % kAmxRows == 0 && key_done + kAmxRows <= j_last; key_done += kAmxRows) {
          const int32_t* src = reinterpret_cast<const int32_t*>(k_base + source(key_done));
          int32_t* dst = reinterpret_cast<int32_t*>(kc + key_done / kAmxRows * dk * kAmxRows);
          for (int64_t p = 0; p < head_dim / 2; ++p) {
            _mm512_storeu_si512(dst + p * kAmxRows, _mm512_i32gather_epi32(key_rows, src + p, 4));
          }
        }
        // Two keys' values at a time, interleaved dimension by dimension.
        const __m512i low = _mm512_setr_epi32(
            0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005, 0x00260006,
            0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b, 0x002c000c, 0x002d000d,
            0x002e000e, 0x002f000f);
        const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
        for (; value_done % 2 == 0 && value_done + 2 <= j_last; value_done += 2) {
          const bf16* first = v_base + source(value_done);
          const bf16* second = first + slot_stride;
          bf16* dst = vc + value_done * dv;
          for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
            const __m512i a = _mm512_loadu_si512(first + d0);
            const __m512i b = _mm512_loadu_si512(second + d0);
            _mm512_storeu_si512(dst + 2 * d0, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(dst + 2 * d0 + 32, _mm512_permutex2var_epi16(a, high, b));
          }
        }
      }
      for (int64_t j = key_done; j < j_end; ++j) {
        const bool real = j < j_last;  // else a padding key: zeros
        const bf16* ksrc = k_base + (real ? source(j) : 0);
        bf16* kdst = kc + (j / kAmxRows) * dk * kAmxRows + j % kAmxRows * 2;
        for (int64_t d = 0; d < dk; ++d) {
          kdst[d / 2 * 2 * kAmxRows + d % 2] = real && d < head_dim ? ksrc[d] : bf16(0.f);
        }
      }
      for (int64_t j = value_done; j < j_end; ++j) {
        const bool real = j < j_last;
        const bf16* vsrc = v_base + (real ? source(j) : 0);
        bf16* vdst = vc + j / 2 * 2 * dv + j % 2;
        for (int64_t d = 0; d < dv; ++d) vdst[2 * d] = real && d < head_dim ? vsrc[d] : bf16(0.f);
      }
    }
  });

  // Pass 2, items in turn per thread as above.
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  // The dot products' operand layouts (bf16_dot.h): keys as 32 output columns (two runs of
  // 16 keys) over pairs of dimensions, values as 32 output dimensions over pairs of keys.
  const PairLayout key_layout{2 * kAmxRows, dk * kAmxRows, kDotPairs * 2 * kAmxRows};
  const PairLayout value_layout{2 * dv, kAmxRows * 2, kDotPairs * 2 * dv};
  at::parallel_for(0, num_threads, 1, [&](int64_t thread_begin, int64_t thread_end) {
#ifdef OCTAVO_AMX
    std::optional<AmxTiles> tiles;
    if (amx) tiles.emplace();
#endif
    std::vector<bf16> q_rows(max_rows * dk);          // (rows, dk), scaled, zero padded
    std::vector<float> scores(max_rows * kKeyStep);   // (rows, keys): scores, then weights
    std::vector<bf16> weights(max_rows * kKeyStep);  // the weights in bfloat16
    std::vector<float> acc(max_rows * dv);            // (rows, dv), unnormalised
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    constexpr int64_t kScoreStride = kKeyStep * sizeof(float);
    constexpr int64_t kWeightStride = kKeyStep * sizeof(bf16);
    const int64_t acc_stride = dv * sizeof(float), value_stride = 2 * dv * sizeof(bf16);
    for (int64_t thread = thread_begin; thread < thread_end; ++thread) {
      for (int64_t item = thread; item < num_items; item += num_threads) {
        const int64_t c = std::upper_bound(first_item.begin(), first_item.end(), item) -
                          first_item.begin() - 1;
        const int64_t tile = (item - first_item[c]) / num_kv_heads;
        const int64_t g = (item - first_item[c]) % num_kv_heads;
        const int64_t q_len = q_lens[c], seq_len = lens[c];
        const int64_t p0 = tile * kQueryTile, np = std::min(kQueryTile, q_len - p0);
        const int64_t first_pos = seq_len - q_len + p0;
        const int64_t rows = group * np, rows32 = up(rows, 2 * kAmxRows);
        const bf16* keys = key_at(c, g);
        const bf16* values = value_at(c, g);
        std::fill(q_rows.begin(), q_rows.begin() + rows32 * dk, bf16(0.f));
        const __m512 scale16 = _mm512_set1_ps(fscale);
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = q_base + (starts[c] + p0 + r % np) * query_stride +
                             (g * group + r / np) * head_dim;
          bf16* dst = q_rows.data() + r * dk;
          int64_t d = 0;
          for (; d + 16 <= head_dim; d += 16) {
            const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(src + d), scale16);
            const __m256bh rounded = _mm512_cvtneps_pbh(scaled);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)rounded);
          }
          for (; d < head_dim; ++d) dst[d] = bf16(src[d] * fscale);
        }
        // Rows past the item's (padding up to 32) weigh nothing; the others are written at
        // every key step up to that step's keys.
        std::fill(weights.begin() + rows * kKeyStep, weights.begin() + rows32 * kKeyStep,
                  bf16(0.f));
        std::fill(acc.begin(), acc.begin() + rows32 * dv, 0.f);
        std::fill(row_max.begin(), row_max.begin() + rows, kMinusInf);
        std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
        const int64_t num_keys = first_pos + np;
        const int64_t first_key = window > 0 ? std::max<int64_t>(first_pos - window + 1, 0) : 0;
        for (int64_t j0 = first_key / kKeyStep * kKeyStep; j0 < num_keys; j0 += kKeyStep) {
          const int64_t nk = std::min(kKeyStep, num_keys - j0), nk32 = up(nk, 2 * kAmxRows);
          // scores[r][jj] = q_r . k_(j0 + jj), 32 rows (12 with the dot products) by 32 keys
          // at a time.
          for (int64_t r0 = 0; !amx && r0 < rows; r0 += kDotRows) {
            for (int64_t k0 = 0; k0 < nk32; k0 += 2 * kAmxRows) {
              dot_rows(std::min<int64_t>(kDotRows, rows - r0), q_rows.data() + r0 * dk, dk,
                       keys + (j0 + k0) / kAmxRows * dk * kAmxRows, key_layout,
                       dk / (2 * kDotPairs), scores.data() + r0 * kKeyStep + k0, kKeyStep,
                       2 * kAmxRows, false);
            }
          }
#ifdef OCTAVO_AMX
          for (int64_t r0 = 0; amx && r0 < rows32; r0 += 2 * kAmxRows) {
            for (int64_t k0 = 0; k0 < nk32; k0 += 2 * kAmxRows) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
              const bf16* key_tiles = keys + (j0 + k0) / kAmxRows * dk * kAmxRows;
              for (int64_t d0 = 0; d0 < dk; d0 += 2 * kAmxRows) {
                _tile_loadd(4, q_rows.data() + r0 * dk + d0, dk * sizeof(bf16));
                _tile_loadd(5, q_rows.data() + (r0 + kAmxRows) * dk + d0, dk * sizeof(bf16));
                _tile_loadd(6, key_tiles + d0 * kAmxRows, 64);
                _tile_loadd(7, key_tiles + dk * kAmxRows + d0 * kAmxRows, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
              }
              float* at = scores.data() + r0 * kKeyStep + k0;
              _tile_stored(0, at, kScoreStride);
              _tile_stored(1, at + kAmxRows, kScoreStride);
              _tile_stored(2, at + kAmxRows * kKeyStep, kScoreStride);
              _tile_stored(3, at + kAmxRows * kKeyStep + kAmxRows, kScoreStride);
            }
          }
#endif
          for (int64_t r = 0; r < rows; ++r) {
            float* s = scores.data() + r * kKeyStep;
            softmax_step(s, first_pos + r % np - j0, nk, nk32, window, fcap, row_max[r],
                         row_sum[r], acc.data() + r * dv, dv);
            bf16* w = weights.data() + r * kKeyStep;
            for (int64_t j = 0; j < nk32; j += 2 * kAmxRows) {
              _mm512_storeu_si512(w + j,
                                  to_bf16(_mm512_loadu_ps(s + j), _mm512_loadu_ps(s + j + 16)));
            }
          }
          // acc[r] += weights[r] @ values, 32 rows (12) by 32 columns at a time.
          for (int64_t r0 = 0; !amx && r0 < rows; r0 += kDotRows) {
            for (int64_t n0 = 0; n0 < dv; n0 += 2 * kAmxRows) {
              dot_rows(std::min<int64_t>(kDotRows, rows - r0), weights.data() + r0 * kKeyStep,
                       kKeyStep, values + j0 / 2 * 2 * dv + 2 * n0, value_layout,
                       nk32 / (2 * kDotPairs), acc.data() + r0 * dv + n0, dv, 2 * kAmxRows,
                       true);
            }
          }
#ifdef OCTAVO_AMX
          for (int64_t r0 = 0; amx && r0 < rows32; r0 += 2 * kAmxRows) {
            for (int64_t n0 = 0; n0 < dv; n0 += 2 * kAmxRows) {
              const bool two = n0 + kAmxRows < dv;
              float* at = acc.data() + r0 * dv + n0;
              _tile_loadd(0, at, acc_stride);
              _tile_loadd(2, at + kAmxRows * dv, acc_stride);
              if (two) {
                _tile_loadd(1, at + kAmxRows, acc_stride);
                _tile_loadd(3, at + kAmxRows * dv + kAmxRows, acc_stride);
              }
              for (int64_t k0 = 0; k0 < nk32; k0 += 2 * kAmxRows) {
                const bf16* w = weights.data() + r0 * kKeyStep + k0;
                const bf16* v = values + (j0 + k0) / 2 * 2 * dv + 2 * n0;
                _tile_loadd(4, w, kWeightStride);
                _tile_loadd(5, w + kAmxRows * kKeyStep, kWeightStride);
                _tile_loadd(6, v, value_stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (two) {
                  _tile_loadd(7, v + 2 * kAmxRows, value_stride);
                  _tile_dpbf16ps(1, 4, 7);
                  _tile_dpbf16ps(3, 5, 7);
                }
              }
              _tile_stored(0, at, acc_stride);
              _tile_stored(2, at + kAmxRows * dv, acc_stride);
              if (two) {
                _tile_stored(1, at + kAmxRows, acc_stride);
                _tile_stored(3, at + kAmxRows * dv + kAmxRows, acc_stride);
              }
            }
          }
#endif
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = out_base + (starts[c] + p0 + r % np) * out_stride +
                       (g * group + r / np) * head_dim;
          const float inv = 1.f / row_sum[r];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[r * dv + d] * inv;
        }
      }
    }
  });
}
#endif

}  // namespace

// Writes the rows of `out` that belong to the chunks; other rows are left as they are.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double softcap, bool tiles, bool amx) {
  if (tiles) {
#ifdef OCTAVO_AVX512BF16
    TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16,
                "paged_prefill_attention: bfloat16 products need a bfloat16 cache");
#ifdef OCTAVO_AMX
    const bool use_amx = amx && amx_permitted();
#else
    const bool use_amx = false;
#endif
    paged_prefill_attention_tiles(out, query, key_cache, value_cache, block_table, query_start,
                                  query_lens, seq_lens, scale, window, softcap, use_amx);
    return;
#else
    TORCH_CHECK(false, "paged_prefill_attention: this build has no bfloat16 dot products");
#endif
  }
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
