// quant_linear: out = x @ W^T with W in a GGML block type (quant_blocks.h), computed on the
// blocks; quant_dequantize: the float rows they stand for.
//
// x is quantized once per call to 8 bits, one scale per 32 values (as llama.cpp's Q8_0), and
// each dot product is an integer one: 8-bit weights times 8-bit activations summed in int32
// lanes of four (AVX512-VNNI's vpdpbusd where the CPU has it, else maddubs + madd, with
// AVX-512 or AVX2). Both operands are laid out in "lane order" (to_lane_order): vector v of a
// chunk of sixteen-weight sub-blocks holds, in lane l, weights 4v..4v+3 of sub-block l, so
// four vectors' integer products summed lane by lane are whole sub-blocks' dot products, and
// the float work (the weight's scale times x's, and the bias times x's sum) is one multiply-add
// per sub-block instead of one per four weights. A weight row is unpacked once (into L1) and
// reused by every row of x, four rows at a time, so few rows (decode) stream each weight byte
// once, and more rows reuse it from cache.
//
// Rounding: every product is exact; what differs from float compute is x's rounding to 8 bits
// (a relative error of at most 1/254 of each block's largest value) and float32 summation.

#include "ops.h"
#include "quant_blocks.h"
#include "simd.h"

namespace octavo {
namespace {

#if defined(OCTAVO_AVX512) && defined(__AVX512BW__)
#define OCTAVO_INT8_512 1
constexpr int kLanes = 16;  // int32 lanes of a vector: sub-blocks per chunk
#elif defined(OCTAVO_AVX2)
#define OCTAVO_INT8_256 1
constexpr int kLanes = 8;
#else
constexpr int kLanes = 0;  // no vector path: everything stays in order
#endif
// Weights per lane-order chunk (kLanes sub-blocks of 16); what is past a row's last whole
// chunk stays in order.
constexpr int64_t kChunk = 16 * kLanes;

inline int64_t lane_order_end(int64_t k) { return kChunk == 0 ? 0 : k / kChunk * kChunk; }

// The 4-byte word of weights 4v..4v+3 of sub-block l of a chunk moves to word v * kLanes + l.
inline void to_lane_order(uint8_t* q, int64_t k) {
#ifdef OCTAVO_INT8_512
  // Word 4l + v lies in vector l / 4 of the chunk, lane 4 (l % 4) + v: lanes 0-7 of vector v
  // come from the chunk's vectors 0 and 1, lanes 8-15 from 2 and 3, by the same index.
  for (int64_t e = 0; e < lane_order_end(k); e += kChunk) {
    __m512i in[4];
    for (int a = 0; a < 4; ++a) in[a] = _mm512_loadu_si512(q + e + 64 * a);
    for (int v = 0; v < 4; ++v) {
      const __m512i index = _mm512_add_epi32(
          _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0),
          _mm512_set1_epi32(v));
      const __m512i low = _mm512_permutex2var_epi32(in[0], index, in[1]);
      const __m512i high = _mm512_permutex2var_epi32(in[2], index, in[3]);
      _mm512_storeu_si512(q + e + 64 * v, _mm512_mask_blend_epi32(0xFF00, low, high));
    }
  }
#else
  if constexpr (kLanes > 0) {
    uint8_t chunk[kChunk];
    for (int64_t e = 0; e < lane_order_end(k); e += kChunk) {
      std::memcpy(chunk, q + e, kChunk);
      for (int l = 0; l < kLanes; ++l) {
        for (int v = 0; v < 4; ++v) std::memcpy(q + e + 4 * (v * kLanes + l), chunk + 16 * l + 4 * v, 4);
      }
    }
  }
#endif
}

#ifdef OCTAVO_INT8_512
// Q4_0 / Q4_1 rows straight into lane order (what unpack_row then to_lane_order give): the
// nibbles of a chunk's eight blocks are gathered into two vectors, and lane l of vector v is
// word v of block l / 2's nibbles, its low nibbles for even l (weights 0-15 of the block),
// high for odd (16-31). Returns false for other types.
inline bool unpack_lane_order(int64_t type, const uint8_t* row, int64_t k, const Unpacked& u) {
  if (type != kQ4_0 && type != kQ4_1) return false;
  const int64_t bytes = type == kQ4_0 ? 18 : 20, nibbles_at = type == kQ4_0 ? 2 : 4;
  const int64_t full = lane_order_end(k);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  alignas(64) uint8_t gathered[128];
  for (int64_t e = 0; e < full; e += kChunk) {
    const uint8_t* blocks = row + e / 32 * bytes;
    for (int b = 0; b < 8; ++b) std::memcpy(gathered + 16 * b, blocks + b * bytes + nibbles_at, 16);
    const __m512i first = _mm512_load_si512(gathered), second = _mm512_load_si512(gathered + 64);
    for (int v = 0; v < 4; ++v) {
      const __m512i index = _mm512_add_epi32(
          _mm512_set_epi32(28, 28, 24, 24, 20, 20, 16, 16, 12, 12, 8, 8, 4, 4, 0, 0),
          _mm512_set1_epi32(v));
      __m512i words = _mm512_permutex2var_epi32(first, index, second);
      words = _mm512_mask_srli_epi32(words, 0xAAAA, words, 4);
      _mm512_storeu_si512(u.q + e + 64 * v, _mm512_and_si512(words, low4));
    }
    for (int b = 0; b < 8; ++b) {
      const uint8_t* block = blocks + b * bytes;
      const float d = load_half(block);
      set_block32(u, e / 32 + b, d, type == kQ4_0 ? -8.f * d : load_half(block + 2));
    }
  }
  if (full < k) {  // the tail stays in order
    const Unpacked tail{u.q + full, u.scale + full / 16, u.bias + full / 16};
    unpack_row(type, row + full / 32 * bytes, k - full, tail);
  }
  return true;
}
#else
inline bool unpack_lane_order(int64_t, const uint8_t*, int64_t, const Unpacked&) { return false; }
#endif

// ---- activations ------------------------------------------------------------------------------

// Rows of x as 8-bit integers in lane order: q (k per row), per sixteen values the scale d of
// their block of 32 (x ~ d * q, d = max |x| / 127) and d times the sum of their q (which a
// weight's bias multiplies): k / 16 of each.
struct QuantizedX {
  int64_t k;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum16;
  QuantizedX(int64_t rows, int64_t k_dim)
      : k(k_dim), q(rows * k_dim), scale(rows * k_dim / 16), sum16(rows * k_dim / 16) {}
  const int8_t* q_row(int64_t i) const { return q.data() + i * k; }
  const float* scale_row(int64_t i) const { return scale.data() + i * k / 16; }
  const float* sum_row(int64_t i) const { return sum16.data() + i * k / 16; }
};

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* scale, float* sum16,
                  bool lane_order) {
  int8_t* row = q;
  for (int64_t b = 0; b < k / 32; ++b, x += 32, q += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(to_float(x[j])));
    const float d = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(to_float(x[j]) * inv));
      q[j] = static_cast<int8_t>(v);
      sums[j / 16] += v;
    }
    scale[2 * b] = scale[2 * b + 1] = d;
    sum16[2 * b] = d * static_cast<float>(sums[0]);
    sum16[2 * b + 1] = d * static_cast<float>(sums[1]);
  }
  if (lane_order) to_lane_order(reinterpret_cast<uint8_t*>(row), k);
}

void quantize_x(const at::Tensor& x, QuantizedX& out, bool lane_order) {
  const int64_t m = x.size(0), k = x.size(1);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int8_t* q = out.q.data() + i * k;
      float* scale = out.scale.data() + i * k / 16;
      float* sum16 = out.sum16.data() + i * k / 16;
      if (x.scalar_type() == at::kBFloat16) {
        quantize_row(x.data_ptr<c10::BFloat16>() + i * k, k, q, scale, sum16, lane_order);
      } else {
        quantize_row(x.data_ptr<float>() + i * k, k, q, scale, sum16, lane_order);
      }
    }
  });
}

// ---- integer dot products ---------------------------------------------------------------------

#ifdef OCTAVO_INT8_512
// acc + the sums of four products of unsigned u and signed s bytes, in 16 int32 lanes.
inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  // Pairs of products fit int16 here: u <= 128 for signed weights (their magnitudes), else
  // at most 63 (Q6_K), against |s| <= 127.
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
#elif defined(OCTAVO_INT8_256)
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

// out[r] = sum_e w[e] * x[row0 + r][e] for R rows of x (x as 8-bit values with their scales
// and sums, w as its unpacked row). kSigned: q is int8 (Q8_0, no bias), else uint8.
template <int R, bool kSigned, bool kLaneOrder>
inline void dot_rows(const Unpacked& w, int64_t k, const QuantizedX& x, int64_t row0,
                     float* out) {
  const int8_t* xq[R];
  const float* xs[R];
  const float* xb[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q_row(row0 + r);
    xs[r] = x.scale_row(row0 + r);
    xb[r] = x.sum_row(row0 + r);
  }
  const int64_t full = kLaneOrder ? lane_order_end(k) : 0;
  int64_t e = 0;
  float tail[R];
#ifdef OCTAVO_INT8_512
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (; e < full; e += kChunk) {
    __m512i wv[4];
    __mmask64 negative[4] = {0, 0, 0, 0};
    for (int v = 0; v < 4; ++v) {
      wv[v] = _mm512_loadu_si512(w.q + e + 64 * v);
      if constexpr (kSigned) {
        negative[v] = _mm512_movepi8_mask(wv[v]);
        wv[v] = _mm512_abs_epi8(wv[v]);
      }
    }
    const __m512 ws = _mm512_loadu_ps(w.scale + e / 16);
    for (int r = 0; r < R; ++r) {
      __m512i sum = zero;
      for (int v = 0; v < 4; ++v) {
        __m512i xv = _mm512_loadu_si512(xq[r] + e + 64 * v);
        if constexpr (kSigned) xv = _mm512_mask_sub_epi8(xv, negative[v], zero, xv);
        sum = dot_u8s8(sum, wv[v], xv);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                               _mm512_mul_ps(ws, _mm512_loadu_ps(xs[r] + e / 16)), acc[r]);
      if constexpr (!kSigned) {
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w.bias + e / 16),
                                 _mm512_loadu_ps(xb[r] + e / 16), acc[r]);
      }
    }
  }
  if (e < k) {
    // Past the last whole chunk (or all of a row not in lane order), in order: 64 weights a
    // vector (the last may hold 32), lane i of one within sixteen i / 4, so each lane's
    // scale is picked from four.
    const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int64_t t = e; t < k; t += 64) {
      const bool whole = k - t >= 64;
      const __mmask64 bytes = whole ? ~__mmask64(0) : __mmask64(0xFFFFFFFF);
      const __mmask16 fours = whole ? 0xF : 0x3;
      __m512i wv = _mm512_maskz_loadu_epi8(bytes, w.q + t);
      __mmask64 negative = 0;
      if constexpr (kSigned) {
        negative = _mm512_movepi8_mask(wv);
        wv = _mm512_abs_epi8(wv);
      }
      const __m512 ws = _mm512_permutexvar_ps(quarter, _mm512_maskz_loadu_ps(fours, w.scale + t / 16));
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_maskz_loadu_epi8(bytes, xq[r] + t);
        if constexpr (kSigned) xv = _mm512_mask_sub_epi8(xv, negative, zero, xv);
        const __m512 xsv =
            _mm512_permutexvar_ps(quarter, _mm512_maskz_loadu_ps(fours, xs[r] + t / 16));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(zero, wv, xv)),
                                 _mm512_mul_ps(ws, xsv), acc[r]);
      }
    }
    if constexpr (!kSigned) {
      for (int64_t sub = e / 16; sub < k / 16; sub += 16) {
        const int64_t count = std::min<int64_t>(16, k / 16 - sub);
        const __mmask16 left = static_cast<__mmask16>((1u << count) - 1);
        const __m512 wb = _mm512_maskz_loadu_ps(left, w.bias + sub);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(wb, _mm512_maskz_loadu_ps(left, xb[r] + sub), acc[r]);
        }
      }
    }
    e = k;
  }
  for (int r = 0; r < R; ++r) tail[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(OCTAVO_INT8_256)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (; e < full; e += kChunk) {
    __m256i wv[4], wu[4];
    for (int v = 0; v < 4; ++v) {
      wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + e + 32 * v));
      wu[v] = kSigned ? _mm256_sign_epi8(wv[v], wv[v]) : wv[v];
    }
    const __m256 ws = _mm256_loadu_ps(w.scale + e / 16);
    for (int r = 0; r < R; ++r) {
      __m256i sum = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + e + 32 * v));
        if constexpr (kSigned) xv = _mm256_sign_epi8(xv, wv[v]);
        sum = dot_u8s8(sum, wu[v], xv);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                               _mm256_mul_ps(ws, _mm256_loadu_ps(xs[r] + e / 16)), acc[r]);
      if constexpr (!kSigned) {
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w.bias + e / 16),
                                 _mm256_loadu_ps(xb[r] + e / 16), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) tail[r] = hsum(acc[r]);
#else
  for (int r = 0; r < R; ++r) tail[r] = 0.f;
#endif
  // Past the last whole chunk (all of the row without vectors), in order, a sixteen at a time.
  for (; e < k; e += 16) {
    const int64_t sub = e / 16;
    for (int r = 0; r < R; ++r) {
      int32_t sum = 0;
      for (int j = 0; j < 16; ++j) {
        const int32_t wq = kSigned ? static_cast<int8_t>(w.q[e + j]) : w.q[e + j];
        sum += wq * xq[r][e + j];
      }
      tail[r] += w.scale[sub] * xs[r][sub] * static_cast<float>(sum);
      if constexpr (!kSigned) tail[r] += w.bias[sub] * xb[r][sub];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = tail[r];
}

// Rows of x per pass over an unpacked weight row: its vectors are loaded once for all of them.
constexpr int kXRows = 4;

// Whether a call puts weights and x in lane order: always where there are vectors, whatever m,
// so that a row's result does not depend on how many rows share the call (the in-order path
// sums in another order; the engine's batch invariance needs one). The in-order kernel
// remains for a row's tail past its last whole chunk.
inline bool use_lane_order(int64_t) { return kLanes > 0; }

template <bool kSigned, bool kLaneOrder>
void dot_all_rows(const Unpacked& w, int64_t k, const QuantizedX& x, int64_t m, float* out,
                  int64_t out_stride) {
  float result[kXRows];
  for (int64_t i = 0; i < m; i += kXRows) {
    const int64_t rows = std::min<int64_t>(kXRows, m - i);
    switch (rows) {
      case 4: dot_rows<4, kSigned, kLaneOrder>(w, k, x, i, result); break;
      case 3: dot_rows<3, kSigned, kLaneOrder>(w, k, x, i, result); break;
      case 2: dot_rows<2, kSigned, kLaneOrder>(w, k, x, i, result); break;
      default: dot_rows<1, kSigned, kLaneOrder>(w, k, x, i, result); break;
    }
    for (int64_t r = 0; r < rows; ++r) out[(i + r) * out_stride] = result[r];
  }
}

// One row's unpacked buffers, per thread.
struct RowBuffers {
  std::vector<uint8_t> q;
  std::vector<float> scale, bias;
  explicit RowBuffers(int64_t k) : q(k), scale(k / 16), bias(k / 16) {}
  Unpacked view() { return {q.data(), scale.data(), bias.data()}; }
};

// An unpacked row's weights (in order), scale[e / 16] * q[e] + bias[e / 16], as float32.
template <bool kSigned>
void expand_row(const Unpacked& w, int64_t k, float* out) {
  int64_t e = 0;
#ifdef OCTAVO_AVX512
  for (; e + 16 <= k; e += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + e));
    const __m512i q = kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    const __m512 scale = _mm512_set1_ps(w.scale[e / 16]);
    const __m512 bias = _mm512_set1_ps(kSigned ? 0.f : w.bias[e / 16]);
    _mm512_storeu_ps(out + e, _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(q), bias));
  }
#endif
  for (; e < k; ++e) {
    const float q = kSigned ? static_cast<float>(static_cast<int8_t>(w.q[e]))
                            : static_cast<float>(w.q[e]);
    out[e] = w.scale[e / 16] * q + (kSigned ? 0.f : w.bias[e / 16]);
  }
}

// float32 -> bfloat16, rounded to nearest even (as torch's conversion, for finite values).
void store_bf16(const float* src, int64_t k, c10::BFloat16* dst) {
  int64_t e = 0;
#ifdef OCTAVO_AVX512
  for (; e + 16 <= k; e += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(src + e));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e), _mm512_cvtepi32_epi16(rounded));
  }
#endif
  for (; e < k; ++e) dst[e] = c10::BFloat16(src[e]);
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  QuantizedX qx(m, k);
  const bool lane_order = use_lane_order(m);
  quantize_x(x, qx, lane_order);
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  const int64_t row_stride = blocks.size(1);
  float* op = out.data_ptr<float>();
  const bool is_signed = type == kQ8_0;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    RowBuffers buffers(k);
    const Unpacked w = buffers.view();
    for (int64_t j = begin; j < end; ++j) {
      if (!lane_order || !unpack_lane_order(type, base + j * row_stride, k, w)) {
        unpack_row(type, base + j * row_stride, k, w);
        if (lane_order) to_lane_order(w.q, k);
      }
      if (lane_order) {
        if (is_signed) {
          dot_all_rows<true, true>(w, k, qx, m, op + j, n);
        } else {
          dot_all_rows<false, true>(w, k, qx, m, op + j, n);
        }
      } else if (is_signed) {
        dot_all_rows<true, false>(w, k, qx, m, op + j, n);
      } else {
        dot_all_rows<false, false>(w, k, qx, m, op + j, n);
      }
    }
  });
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t type, int64_t k,
                            at::ScalarType dtype) {
  const int64_t rows = blocks.size(0), row_stride = blocks.size(1);
  at::Tensor out = at::empty({rows, k}, blocks.options().dtype(dtype));
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  const bool is_signed = type == kQ8_0;
  const bool to_bf16 = dtype == at::kBFloat16;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    RowBuffers buffers(k);
    const Unpacked w = buffers.view();
    std::vector<float> row(k);
    for (int64_t i = begin; i < end; ++i) {
      unpack_row(type, base + i * row_stride, k, w);
      if (is_signed) {
        expand_row<true>(w, k, row.data());
      } else {
        expand_row<false>(w, k, row.data());
      }
      if (to_bf16) {
        store_bf16(row.data(), k, out.data_ptr<c10::BFloat16>() + i * k);
      } else {
        std::copy(row.begin(), row.end(), out.data_ptr<float>() + i * k);
      }
    }
  });
  return out;
}

}  // namespace octavo
