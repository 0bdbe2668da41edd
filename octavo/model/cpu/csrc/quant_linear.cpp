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

#include <optional>


#include "amx.h"
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
// Weights per lane-order chunk (kLanes sub-blocks of 16).
constexpr int64_t kChunk = 16 * kLanes;

inline int64_t lane_order_end(int64_t k) { return kChunk == 0 ? 0 : k / kChunk * kChunk; }

// A row's length in the kernels' buffers: whole chunks, the last one padded with zeros (whose
// products are zero), so every row is all chunks in lane order, with no ragged tail path.
inline int64_t padded(int64_t k) { return kChunk == 0 ? k : (k + kChunk - 1) / kChunk * kChunk; }

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

// ---- activations ------------------------------------------------------------------------------

// Rows of x as 8-bit integers in lane order: q (k per row), per sixteen values the scale d of
// their block of 32 (x ~ d * q, d = max |x| / 127) and d times the sum of their q (which a
// weight's bias multiplies): k / 16 of each.
struct QuantizedX {
  int64_t kp;  // padded(k): rows lie kp apart, zeros past k
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum16;
  QuantizedX(int64_t rows, int64_t k)
      : kp(padded(k)), q(rows * kp), scale(rows * kp / 16), sum16(rows * kp / 16) {}
  int8_t* q_row(int64_t i) { return q.data() + i * kp; }
  float* scale_row(int64_t i) { return scale.data() + i * kp / 16; }
  float* sum_row(int64_t i) { return sum16.data() + i * kp / 16; }
  const int8_t* q_row(int64_t i) const { return q.data() + i * kp; }
  const float* scale_row(int64_t i) const { return scale.data() + i * kp / 16; }
  const float* sum_row(int64_t i) const { return sum16.data() + i * kp / 16; }
};

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* scale, float* sum16) {
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
  to_lane_order(reinterpret_cast<uint8_t*>(row), padded(k));
}

void quantize_x(const at::Tensor& x, QuantizedX& out) {
  const int64_t m = x.size(0), k = x.size(1);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int8_t* q = out.q_row(i);
      float* scale = out.scale_row(i);
      float* sum16 = out.sum_row(i);
      if (x.scalar_type() == at::kBFloat16) {
        quantize_row(x.data_ptr<c10::BFloat16>() + i * k, k, q, scale, sum16);
      } else {
        quantize_row(x.data_ptr<float>() + i * k, k, q, scale, sum16);
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

#ifdef OCTAVO_INT8_512
// A weight row's chunks as vectors: chunk(e, wv, ws, wb) gives the chunk at weight e in lane
// order (four vectors of bytes) with the scale and bias of its sixteen sub-blocks.
struct UnpackedChunks {
  const Unpacked& w;
  void operator()(int64_t e, __m512i* wv, __m512& ws, __m512& wb) const {
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(w.q + e + 64 * v);
    ws = _mm512_loadu_ps(w.scale + e / 16);
    wb = _mm512_loadu_ps(w.bias + e / 16);
  }
};

// out[r] = the dot products of a weight row (its chunks, kp weights) with R rows of x, each
// sub-block's integer sum scaled once (see the top of the file).
template <int R, bool kSigned, typename Chunks>
inline void dot_chunks(const Chunks& chunks, int64_t kp, const QuantizedX& x, int64_t row0,
                       float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t e = 0; e < kp; e += kChunk) {
    __m512i wv[4];
    __m512 ws, wb;
    chunks(e, wv, ws, wb);
    __mmask64 negative[4] = {0, 0, 0, 0};
    if constexpr (kSigned) {
      for (int v = 0; v < 4; ++v) {
        negative[v] = _mm512_movepi8_mask(wv[v]);
        wv[v] = _mm512_abs_epi8(wv[v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q_row(row0 + r) + e;
      __m512i sum = zero;
      for (int v = 0; v < 4; ++v) {
        __m512i xv = _mm512_loadu_si512(xq + 64 * v);
        if constexpr (kSigned) xv = _mm512_mask_sub_epi8(xv, negative[v], zero, xv);
        sum = dot_u8s8(sum, wv[v], xv);
      }
      acc[r] = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(sum),
          _mm512_mul_ps(ws, _mm512_loadu_ps(x.scale_row(row0 + r) + e / 16)), acc[r]);
      if constexpr (!kSigned) {
        acc[r] = _mm512_fmadd_ps(wb, _mm512_loadu_ps(x.sum_row(row0 + r) + e / 16), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

// ---- repacked rows ----------------------------------------------------------------------------
//
// Where a type has a repacked layout (quant_repack, at load), a chunk's lane-order vectors come
// out of a few 64-byte loads, shifts and masks, in registers, with no unpacking through memory:
// a decode step then streams each weight byte once and does little else. Same bytes as the
// blocks. A chunk is 8 blocks of a 32-weight type (p <= 8 in a row's last) or one K-quant
// super-block (p = 8), and with Vv its lane-order vector v (lanes 0..2p-1, 8p bytes; the rest,
// past the row, zero) and n = 8p:
//   Q8_0:             V0 V1 V2 V3 (n bytes each) d (2p)
//   Q4_0, Q5_0:       L0 L1 [H] d (2p)               L0 = V0 | V1 << 4, L1 = V2 | V3 << 4
//   Q4_1, Q5_1:       L0 L1 [H] d (2p) m (2p)        (the low nibbles of the 5-bit types)
//   Q4_K, Q5_K:       L0 L1 [H] S (12) d dmin (2 each)
//   Q6_K:             L0 L1 H6 (64) scales (16, int8) d (2)
// H (5-bit types): four masks of n bits, mask v bit i = the fifth bit of byte i of Vv; H6: byte
// i holds bits 4-5 of byte i of Vv at bits 2v..2v+1; S: byte j = the low nibbles of sub-block
// j's 6-bit scale | its minimum's << 4, then two 16-bit words of their high two bits (bits 2j..
// 2j+1; scales, then minimums). d, m, dmin: float16. Type ids: the GGML id | kRepacked.
constexpr int64_t kRepacked = 0x100;

inline bool repackable(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K:
      return true;
    default:
      return false;
  }
}

inline bool five_bit(int64_t type) { return type == kQ5_0 || type == kQ5_1 || type == kQ5_K; }

// Blocks of the type per repacked chunk.
inline int64_t chunk_blocks(int64_t type) { return type >= kQ2_K ? 1 : 8; }

#ifdef OCTAVO_INT8_512
struct RepackedChunks {
  int64_t type;  // the GGML type
  const uint8_t* row;
  int64_t num_blocks;
  void operator()(int64_t e, __m512i* wv, __m512& ws, __m512& wb) const {
    const int64_t first = e / block_weights(type);
    const int64_t p = type >= kQ2_K ? 8 : std::min<int64_t>(8, num_blocks - first), n = 8 * p;
    const uint8_t* c = row + first * block_bytes(type);
    const __mmask64 bytes = p == 8 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
    const __mmask8 halves = static_cast<__mmask8>((1u << p) - 1);
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    // The float16 values of the chunk's blocks, each for its two sixteens.
    auto per_block = [&](const uint8_t* at) {
      const __m256 eight = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(halves, at));
      return _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(eight));
    };
    if (type == kQ8_0) {
      for (int v = 0; v < 4; ++v) wv[v] = _mm512_maskz_loadu_epi8(bytes, c + n * v);
      ws = per_block(c + 4 * n);
      wb = _mm512_setzero_ps();
      return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int a = 0; a < 2; ++a) {
      const __m512i both = _mm512_maskz_loadu_epi8(bytes, c + n * a);
      wv[2 * a] = _mm512_and_si512(both, low4);
      wv[2 * a + 1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low4);
    }
    const uint8_t* s = c + 2 * n;  // what follows the nibbles
    if (five_bit(type)) {
      const __m512i sixteen = _mm512_set1_epi8(0x10);
      const __mmask16 mask_bytes = static_cast<__mmask16>((1u << p) - 1);
      for (int v = 0; v < 4; ++v, s += p) {
        uint64_t mask;
        if (p == 8) {
          std::memcpy(&mask, s, 8);
        } else {
          mask = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_maskz_loadu_epi8(mask_bytes, s)));
        }
        wv[v] = _mm512_mask_add_epi8(wv[v], mask, wv[v], sixteen);  // nibble + 16 = nibble | 16
      }
    } else if (type == kQ6_K) {
      const __m512i high = _mm512_loadu_si512(s);
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      wv[0] = _mm512_or_si512(wv[0], _mm512_and_si512(_mm512_slli_epi16(high, 4), bits45));
      wv[1] = _mm512_or_si512(wv[1], _mm512_and_si512(_mm512_slli_epi16(high, 2), bits45));
      wv[2] = _mm512_or_si512(wv[2], _mm512_and_si512(high, bits45));
      wv[3] = _mm512_or_si512(wv[3], _mm512_and_si512(_mm512_srli_epi16(high, 2), bits45));
      s += 64;
    }
    switch (type) {
      case kQ4_0:
      case kQ5_0:
        ws = per_block(s);
        wb = _mm512_mul_ps(ws, _mm512_set1_ps(type == kQ4_0 ? -8.f : -16.f));
        break;
      case kQ4_1:
      case kQ5_1:
        ws = per_block(s);
        wb = per_block(s + 2 * p);
        break;
      case kQ6_K: {
        const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
        ws = _mm512_mul_ps(_mm512_set1_ps(load_half(s + 16)),
                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)));
        wb = _mm512_mul_ps(ws, _mm512_set1_ps(-32.f));
        break;
      }
      default: {  // Q4_K, Q5_K: lane l is sub-block l / 2 of 32 weights
        const __m128i low = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
        const __m512i both = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, low));
        uint32_t high;
        std::memcpy(&high, s + 8, 4);
        const __m512i shift = _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
        const __m512i h = _mm512_set1_epi32(static_cast<int>(high)), three = _mm512_set1_epi32(3);
        const __m512i f = _mm512_set1_epi32(0xF);
        const __m512i scale = _mm512_or_si512(
            _mm512_and_si512(both, f),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, shift), three), 4));
        const __m512i min = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32(both, 4), f),
            _mm512_slli_epi32(
                _mm512_and_si512(_mm512_srlv_epi32(h, _mm512_add_epi32(shift, _mm512_set1_epi32(16))), three), 4));
        ws = _mm512_mul_ps(_mm512_set1_ps(load_half(s + 12)), _mm512_cvtepi32_ps(scale));
        wb = _mm512_mul_ps(_mm512_set1_ps(-load_half(s + 14)), _mm512_cvtepi32_ps(min));
        break;
      }
    }
  }
};
#endif

// One chunk of a row in the repacked layout (see above): `lanes` its weights unpacked in lane
// order (vectors 64 bytes apart), `blocks` its p blocks as the file has them.
void repack_chunk(int64_t type, const uint8_t* lanes, const uint8_t* blocks, int64_t p, uint8_t* c) {
  const int64_t n = 8 * p, bytes = block_bytes(type);
  if (type == kQ8_0) {
    for (int v = 0; v < 4; ++v) std::memcpy(c + n * v, lanes + 64 * v, n);
    for (int b = 0; b < p; ++b) std::memcpy(c + 4 * n + 2 * b, blocks + b * bytes, 2);
    return;
  }
  for (int a = 0; a < 2; ++a) {
    for (int64_t i = 0; i < n; ++i) {
      c[n * a + i] = static_cast<uint8_t>((lanes[128 * a + i] & 0xF) | ((lanes[128 * a + 64 + i] & 0xF) << 4));
    }
  }
  uint8_t* s = c + 2 * n;
  if (five_bit(type)) {
    for (int v = 0; v < 4; ++v, s += p) {
      uint64_t mask = 0;
      for (int64_t i = 0; i < n; ++i) mask |= static_cast<uint64_t>((lanes[64 * v + i] >> 4) & 1) << i;
      std::memcpy(s, &mask, p);
    }
  } else if (type == kQ6_K) {
    for (int i = 0; i < 64; ++i) {
      int high = 0;
      for (int v = 0; v < 4; ++v) high |= ((lanes[64 * v + i] >> 4) & 3) << (2 * v);
      s[i] = static_cast<uint8_t>(high);
    }
    s += 64;
  }
  switch (type) {
    case kQ4_0:
    case kQ5_0:
      for (int b = 0; b < p; ++b) std::memcpy(s + 2 * b, blocks + b * bytes, 2);
      break;
    case kQ4_1:
    case kQ5_1:
      for (int b = 0; b < p; ++b) {
        std::memcpy(s + 2 * b, blocks + b * bytes, 2);
        std::memcpy(s + 2 * p + 2 * b, blocks + b * bytes + 2, 2);
      }
      break;
    case kQ6_K:
      std::memcpy(s, blocks + 192, 18);  // the int8 scales, then d
      break;
    default: {  // Q4_K, Q5_K
      uint16_t high[2] = {0, 0};
      for (int j = 0; j < 8; ++j) {
        int scale, min;
        scale_min_k4(blocks + 4, j, scale, min);
        s[j] = static_cast<uint8_t>((scale & 0xF) | ((min & 0xF) << 4));
        high[0] |= static_cast<uint16_t>((scale >> 4) << (2 * j));
        high[1] |= static_cast<uint16_t>((min >> 4) << (2 * j));
      }
      std::memcpy(s + 8, high, 4);
      std::memcpy(s + 12, blocks, 4);  // d, dmin
      break;
    }
  }
}

// out[r] = sum_e w[e] * x[row0 + r][e] for R rows of x (x as 8-bit values with their scales
// and sums, w as its unpacked row). kSigned: q is int8 (Q8_0, no bias), else uint8.
template <int R, bool kSigned>
inline void dot_rows(const Unpacked& w, int64_t k, const QuantizedX& x, int64_t row0,
                     float* out) {
#ifdef OCTAVO_INT8_512
  dot_chunks<R, kSigned>(UnpackedChunks{w}, padded(k), x, row0, out);
#elif defined(OCTAVO_INT8_256)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t e = 0; e < padded(k); e += kChunk) {
    __m256i wv[4], wu[4];
    for (int v = 0; v < 4; ++v) {
      wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + e + 32 * v));
      wu[v] = kSigned ? _mm256_sign_epi8(wv[v], wv[v]) : wv[v];
    }
    const __m256 ws = _mm256_loadu_ps(w.scale + e / 16);
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q_row(row0 + r) + e;
      __m256i sum = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * v));
        if constexpr (kSigned) xv = _mm256_sign_epi8(xv, wv[v]);
        sum = dot_u8s8(sum, wu[v], xv);
      }
      acc[r] = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(sum),
          _mm256_mul_ps(ws, _mm256_loadu_ps(x.scale_row(row0 + r) + e / 16)), acc[r]);
      if constexpr (!kSigned) {
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w.bias + e / 16),
                                 _mm256_loadu_ps(x.sum_row(row0 + r) + e / 16), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#else
  // Without vectors the rows stay in order: a sixteen at a time.
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = x.q_row(row0 + r);
    const float* xs = x.scale_row(row0 + r);
    const float* xb = x.sum_row(row0 + r);
    float total = 0.f;
    for (int64_t e = 0; e < k; e += 16) {
      int32_t sum = 0;
      for (int j = 0; j < 16; ++j) {
        const int32_t wq = kSigned ? static_cast<int8_t>(w.q[e + j]) : w.q[e + j];
        sum += wq * xq[e + j];
      }
      total += w.scale[e / 16] * xs[e / 16] * static_cast<float>(sum);
      if constexpr (!kSigned) total += w.bias[e / 16] * xb[e / 16];
    }
    out[r] = total;
  }
#endif
}

// Rows of x per pass over an unpacked weight row: its vectors are loaded once for all of them.
constexpr int kXRows = 4;

template <bool kSigned>
void dot_all_rows(const Unpacked& w, int64_t k, const QuantizedX& x, int64_t m, float* out,
                  int64_t out_stride) {
  float result[kXRows];
  for (int64_t i = 0; i < m; i += kXRows) {
    const int64_t rows = std::min<int64_t>(kXRows, m - i);
    switch (rows) {
      case 4: dot_rows<4, kSigned>(w, k, x, i, result); break;
      case 3: dot_rows<3, kSigned>(w, k, x, i, result); break;
      case 2: dot_rows<2, kSigned>(w, k, x, i, result); break;
      default: dot_rows<1, kSigned>(w, k, x, i, result); break;
    }
    for (int64_t r = 0; r < rows; ++r) out[(i + r) * out_stride] = result[r];
  }
}

#ifdef OCTAVO_INT8_512
// dot_all_rows for a repacked weight row: its chunks are decoded again for each tile of x rows.
template <bool kSigned>
void dot_all_chunks(const RepackedChunks& chunks, int64_t k, const QuantizedX& x, int64_t m,
                    float* out, int64_t out_stride) {
  float result[kXRows];
  const int64_t kp = padded(k);
  for (int64_t i = 0; i < m; i += kXRows) {
    const int64_t rows = std::min<int64_t>(kXRows, m - i);
    switch (rows) {
      case 4: dot_chunks<4, kSigned>(chunks, kp, x, i, result); break;
      case 3: dot_chunks<3, kSigned>(chunks, kp, x, i, result); break;
      case 2: dot_chunks<2, kSigned>(chunks, kp, x, i, result); break;
      default: dot_chunks<1, kSigned>(chunks, kp, x, i, result); break;
    }
    for (int64_t r = 0; r < rows; ++r) out[(i + r) * out_stride] = result[r];
  }
}
#endif

// A row of `type` unpacked into w in lane order, its padding past k zeros (a buffer's last row
// can leave bytes there after its reordering).
inline void unpack_lanes(int64_t type, const uint8_t* row, int64_t k, const Unpacked& w) {
  unpack_row(type, row, k, w);
  std::memset(w.q + k, 0, padded(k) - k);
  to_lane_order(w.q, padded(k));
}

// One row's unpacked buffers, per thread.
struct RowBuffers {
  std::vector<uint8_t> q;
  std::vector<float> scale, bias;
  // Zeros past k: the padding of the last chunk (kept zero by the unpackers).
  explicit RowBuffers(int64_t k) : q(padded(k)), scale(padded(k) / 16), bias(padded(k) / 16) {}
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

#ifdef OCTAVO_INT8_512
// A repacked row, unpacked in order (what unpack_row gives for the original blocks).
void unpack_repacked_row(int64_t type, const uint8_t* row, int64_t k, const Unpacked& u) {
  const RepackedChunks chunks{type, row, k / block_weights(type)};
  alignas(64) uint8_t lanes[kChunk];
  alignas(64) float scale[16], bias[16];
  for (int64_t e = 0; e < k; e += kChunk) {
    __m512i wv[4];
    __m512 ws, wb;
    chunks(e, wv, ws, wb);
    for (int v = 0; v < 4; ++v) _mm512_store_si512(lanes + 64 * v, wv[v]);
    _mm512_store_ps(scale, ws);
    _mm512_store_ps(bias, wb);
    const int64_t subs = std::min<int64_t>(16, (k - e) / 16);
    for (int l = 0; l < subs; ++l) {
      for (int v = 0; v < 4; ++v) std::memcpy(u.q + e + 16 * l + 4 * v, lanes + 4 * (v * kLanes + l), 4);
      u.scale[e / 16 + l] = scale[l];
      u.bias[e / 16 + l] = bias[l];
    }
  }
}
#endif

// Unpack a row of `type`, repacked or not.
inline void unpack_any(int64_t type, const uint8_t* row, int64_t k, const Unpacked& u) {
#ifdef OCTAVO_INT8_512
  if (type & kRepacked) {
    unpack_repacked_row(type & ~kRepacked, row, k, u);
    return;
  }
#endif
  unpack_row(type, row, k, u);
}

// ---- AMX tiles: many rows on the weights dequantized to bfloat16 ----------------------------
//
// Where the CPU has AMX-BF16 (and the OS lets this process use its tile registers), a matmul
// of more rows than the block kernel is best at runs here instead of dequantizing the whole
// weight to memory for torch's GEMM. Each thread takes 32 weight rows at a time and walks
// their length in slices of kSlice weights: a slice is dequantized into a 32 KB buffer that
// stays in L1 (bfloat16, exactly the rounding of quant_dequantize) and multiplied with x
// rounded to bfloat16 by tile dot products (tdpbf16ps: 16 x 16 outputs, 32 products each,
// float32 sums), the sums kept in tile registers (up to 32 rows of x) or in memory between
// slices. The weights stay in lane order (the chunks the block kernel reads; a row's last,
// partial chunk without its padding: each of its four vectors cut to the 8p bytes of its p
// blocks) and x is packed in the same order, which a dot product does not see. Results: the
// float32 product of the bf16-rounded operands, up to float32 summation order.
// Tiles 0-3 hold the four 16 x 16 float sums (weight rows x x rows), 4-5 two 16-row slices of
// dequantized weights (32 bf16 each), 6-7 two 16-row slices of x in the pair-interleaved
// layout tdpbf16ps takes for its second operand (amx.h's AmxTiles).
#ifdef OCTAVO_AMX

constexpr int64_t kWeightTile = 2 * kAmxRows;  // weight rows dequantized together
constexpr int64_t kSlice = 2 * kChunk;          // weights of a row per slice: 32 x 512 bf16 in L1
constexpr int64_t kXPass = 256;                 // x rows per pass over the weights

// 16 floats (lanes of one chunk vector's 16-byte quarter) from its bytes, scaled.
template <bool kSigned>
inline __m512 expand16(__m128i bytes, __m512 scale, __m512 bias) {
  const __m512i q = kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  return _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(q), bias);
}


// Weights of a partial last chunk of p blocks of 32 (k - e of them) in the tiles' order: each
// chunk vector's first 8p values, one vector after another.
inline int64_t partial_blocks(int64_t k, int64_t e) { return std::min<int64_t>(8, (k - e) / 32); }

// A row of k weights, [e0, e1) of it (chunk-aligned e0), in lane order as bfloat16 at
// out[0, e1 - e0), the last chunk compacted where it is partial.
template <bool kSigned, typename Chunks>
void dequantize_lanes(const Chunks& chunks, int64_t k, int64_t e0, int64_t e1,
                      c10::BFloat16* out) {
  // Byte b of a chunk vector is in lane b / 4: quarter g of the vector (16 bytes) spans lanes
  // 4g..4g+3, each four times.
  __m512i spread[4];
  for (int g = 0; g < 4; ++g) {
    spread[g] = _mm512_setr_epi32(4 * g, 4 * g, 4 * g, 4 * g, 4 * g + 1, 4 * g + 1, 4 * g + 1,
                                  4 * g + 1, 4 * g + 2, 4 * g + 2, 4 * g + 2, 4 * g + 2,
                                  4 * g + 3, 4 * g + 3, 4 * g + 3, 4 * g + 3);
  }
  for (int64_t e = e0; e < e1; e += kChunk) {
    __m512i wv[4];
    __m512 ws, wb;
    chunks(e, wv, ws, wb);
    __m512 scale[4], bias[4];
    for (int g = 0; g < 4; ++g) {
      scale[g] = _mm512_permutexvar_ps(spread[g], ws);
      bias[g] = _mm512_permutexvar_ps(spread[g], wb);
    }
    const int64_t p = partial_blocks(k, e);
    alignas(64) c10::BFloat16 partial[kChunk];
    c10::BFloat16* o = p == 8 ? out + (e - e0) : partial;
    for (int v = 0; v < 4; ++v) {
      const __m512 q0 = expand16<kSigned>(_mm512_extracti32x4_epi32(wv[v], 0), scale[0], bias[0]);
      const __m512 q1 = expand16<kSigned>(_mm512_extracti32x4_epi32(wv[v], 1), scale[1], bias[1]);
      const __m512 q2 = expand16<kSigned>(_mm512_extracti32x4_epi32(wv[v], 2), scale[2], bias[2]);
      const __m512 q3 = expand16<kSigned>(_mm512_extracti32x4_epi32(wv[v], 3), scale[3], bias[3]);
      _mm512_storeu_si512(o + 64 * v, to_bf16(q0, q1));
      _mm512_storeu_si512(o + 64 * v + 32, to_bf16(q2, q3));
    }
    if (p < 8) {
      for (int v = 0; v < 4; ++v) {
        std::memcpy(static_cast<void*>(out + (e - e0) + 8 * p * v), partial + 64 * v,
                    8 * p * sizeof(c10::BFloat16));
      }
    }
  }
}

// kWeightTile weight rows of one part, [row0, row0 + count): their chunks, sliced.
struct WeightTile {
  int64_t type, base_type, k, count;
  bool is_signed;
  std::vector<const uint8_t*> rows;     // repacked rows
  std::vector<RowBuffers> unpacked;     // other types: each row unpacked in lane order

  WeightTile(int64_t type_, int64_t k_)
      : type(type_), base_type(type_ & ~kRepacked), k(k_), count(0),
        is_signed(base_type == kQ8_0), rows(kWeightTile) {
    if (!(type & kRepacked)) {
      for (int64_t r = 0; r < kWeightTile; ++r) unpacked.emplace_back(k);
    }
  }

  void take(const uint8_t* base, int64_t stride, int64_t row0, int64_t count_) {
    count = count_;
    for (int64_t r = 0; r < count; ++r) {
      rows[r] = base + (row0 + r) * stride;
      if (!(type & kRepacked)) unpack_lanes(type, rows[r], k, unpacked[r].view());
    }
  }

  // Weights [e0, e1) of every row into out (rows e1 - e0 apart; zeros past count).
  void dequantize(int64_t e0, int64_t e1, c10::BFloat16* out) {
    const int64_t len = e1 - e0;
    for (int64_t r = 0; r < kWeightTile; ++r) {
      c10::BFloat16* o = out + r * len;
      if (r >= count) {
        std::memset(static_cast<void*>(o), 0, len * sizeof(c10::BFloat16));
      } else if (type & kRepacked) {
        const RepackedChunks chunks{base_type, rows[r], k / block_weights(base_type)};
        is_signed ? dequantize_lanes<true>(chunks, k, e0, e1, o)
                  : dequantize_lanes<false>(chunks, k, e0, e1, o);
      } else {
        const UnpackedChunks chunks{unpacked[r].view()};
        is_signed ? dequantize_lanes<true>(chunks, k, e0, e1, o)
                  : dequantize_lanes<false>(chunks, k, e0, e1, o);
      }
    }
  }
};

// x's rows [row0, row0 + m) as tdpbf16ps's second operand, in the weights' order
// (dequantize_lanes): for each 16 rows and each 32 values (16 pairs), 16 x 16 words, word
// (pair j, row r) the pair of bf16 values at positions 2j, 2j + 1 of row r (zeros past the
// rows).
std::vector<uint32_t> pack_x(const at::Tensor& x, int64_t row0, int64_t m) {
  const int64_t k = x.size(1), kp = padded(k), groups = (m + kAmxRows - 1) / kAmxRows;
  std::vector<uint32_t> packed(groups * kAmxRows * k / 2, 0);
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> row(kp, c10::BFloat16(0.f));
    for (int64_t i = begin; i < end; ++i) {
      if (x.scalar_type() == at::kBFloat16) {
        std::memcpy(static_cast<void*>(row.data()), x.data_ptr<c10::BFloat16>() + (row0 + i) * k,
                    k * sizeof(c10::BFloat16));
      } else {
        store_bf16(x.data_ptr<float>() + (row0 + i) * k, k, row.data());
      }
      uint32_t words[kChunk / 2];
      uint32_t* group = packed.data() + (i / kAmxRows) * kAmxRows * k / 2;
      for (int64_t e = 0; e < k; e += kChunk) {
        // Word w of a chunk of p blocks (value 2w of its 4 x 8p: vector v = 2w / 8p, byte b =
        // 2w % 8p of it, so lane l = b / 4, half h = b % 4 / 2) holds in-order values
        // 16 l + 4 v + 2 h and the next.
        std::memcpy(words, row.data() + e, sizeof(words));
        const int64_t segment = 8 * partial_blocks(k, e);
        for (int64_t w = 0; w < segment * 2; ++w) {
          const int64_t v = 2 * w / segment, b = 2 * w % segment, l = b / 4, h = b % 4 / 2;
          const int64_t pair = (e / 2 + w);  // index among the row's lane-order pairs
          group[(pair / 16) * 256 + (pair % 16) * 16 + i % kAmxRows] = words[8 * l + 2 * v + h];
        }
      }
    }
  });
  return packed;
}

// Tiles 0-3 += a slice of 32 weight rows (`weights`, len apart) times one or two 16-row groups
// of packed x at the same slice (`x`, the second group `group_words` on).
template <int kGroups>
inline void slice_products(const c10::BFloat16* weights, int64_t len, const uint32_t* x,
                           int64_t group_words) {
  const int64_t stride = len * sizeof(c10::BFloat16);
  for (int64_t e = 0; e < len; e += 32) {
    _tile_loadd(4, weights + e, stride);
    _tile_loadd(5, weights + kAmxRows * len + e, stride);
    _tile_loadd(6, x + e / 2 * kAmxRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (kGroups == 2) {
      _tile_loadd(7, x + group_words + e / 2 * kAmxRows, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

inline void store_sums(float* sums) {
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + kAmxFloats, 64);
  _tile_stored(2, sums + 2 * kAmxFloats, 64);
  _tile_stored(3, sums + 3 * kAmxFloats, 64);
}

inline void load_sums(const float* sums) {
  _tile_loadd(0, sums, 64);
  _tile_loadd(1, sums + kAmxFloats, 64);
  _tile_loadd(2, sums + 2 * kAmxFloats, 64);
  _tile_loadd(3, sums + 3 * kAmxFloats, 64);
}

// out[i][j] for 32 rows of x and 32 weight rows from their four tiles' sums: tile 2 g + s holds
// weight rows 16 s + w against x rows 16 g + r at [w * 16 + r].
inline void write_sums(const float* sums, int64_t xcount, int64_t wcount, float* out,
                       int64_t out_stride) {
  for (int64_t i = 0; i < xcount; ++i) {
    const int64_t g = i / kAmxRows, r = i % kAmxRows;
    for (int64_t j = 0; j < wcount; ++j) {
      out[i * out_stride + j] =
          sums[(2 * g + j / kAmxRows) * kAmxFloats + (j % kAmxRows) * kAmxRows + r];
    }
  }
}

// One weight tile against `rows` rows of packed x, walking the weights slice by slice.
void weight_tile_products(WeightTile& tile, c10::BFloat16* slice, const uint32_t* xpacked,
                          int64_t rows, std::vector<float>& sums, float* out, int64_t out_stride) {
  const int64_t k = tile.k, group_words = kAmxRows * k / 2;
  const int64_t pairs = (rows + 2 * kAmxRows - 1) / (2 * kAmxRows);  // 32-row groups of x
  for (int64_t e0 = 0; e0 < k; e0 += kSlice) {
    const int64_t e1 = std::min(k, e0 + kSlice), len = e1 - e0;
    tile.dequantize(e0, e1, slice);
    for (int64_t p = 0; p < pairs; ++p) {
      // One pair of x groups keeps its sums in the tiles across slices; more take turns.
      if (pairs > 1 || e0 == 0) {
        if (e0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          load_sums(sums.data() + p * 4 * kAmxFloats);
        }
      }
      const uint32_t* x = xpacked + 2 * p * group_words + e0 / 2 * kAmxRows;
      if (rows - 2 * kAmxRows * p > kAmxRows) {
        slice_products<2>(slice, len, x, group_words);
      } else {
        slice_products<1>(slice, len, x, group_words);
      }
      if (pairs > 1 || e1 == k) store_sums(sums.data() + p * 4 * kAmxFloats);
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    write_sums(sums.data() + p * 4 * kAmxFloats, std::min(2 * kAmxRows, rows - 2 * kAmxRows * p),
               tile.count, out + 2 * kAmxRows * p * out_stride, out_stride);
  }
}

#endif

}  // namespace

bool amx_tiles_available() {
#ifdef OCTAVO_AMX
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor quant_linear_tiles(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                              int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#ifdef OCTAVO_AMX
  TORCH_CHECK(amx_permitted(), "quant_linear_tiles: this CPU or OS gives no AMX tiles");
  if (m == 0 || n == 0) return out;
  const int64_t stride = blocks.stride(0);
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = (n + kWeightTile - 1) / kWeightTile;
  for (int64_t x0 = 0; x0 < m; x0 += kXPass) {
    const int64_t rows = std::min(kXPass, m - x0);
    const std::vector<uint32_t> xpacked = pack_x(x, x0, rows);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      AmxTiles amx;
      WeightTile tile(type, k);
      std::vector<c10::BFloat16> slice(kWeightTile * kSlice);
      std::vector<float> sums((rows + 2 * kAmxRows - 1) / (2 * kAmxRows) * 4 * kAmxFloats);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t col0 = t * kWeightTile;
        tile.take(base, stride, col0, std::min(kWeightTile, n - col0));
        weight_tile_products(tile, slice.data(), xpacked.data(), rows, sums, op + x0 * n + col0, n);
      }
    });
  }
  return out;
#else
  TORCH_CHECK(false, "quant_linear_tiles: this build has no AMX path");
  return out;
#endif
}

int64_t quant_repacked_type(int64_t type) {
#ifdef OCTAVO_INT8_512
  if (repackable(type)) return type | kRepacked;
#endif
  return type;
}

at::Tensor quant_repack(const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(quant_repacked_type(type) != type, "quant_repack: type ", type, " is not repackable");
  const int64_t rows = blocks.size(0), row_stride = blocks.size(1);
  at::Tensor out = at::empty_like(blocks);
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t bytes = block_bytes(type), num_blocks = k / block_weights(type);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    RowBuffers buffers(k);
    const Unpacked w = buffers.view();
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = base + i * row_stride;
      uint8_t* packed = dst + i * row_stride;
      unpack_lanes(type, row, k, w);
      for (int64_t first = 0; first < num_blocks; first += chunk_blocks(type)) {
        const int64_t p = type >= kQ2_K ? 8 : std::min<int64_t>(8, num_blocks - first);
        repack_chunk(type, w.q + first * block_weights(type), row + first * bytes, p,
                     packed + first * bytes);
      }
    }
  });
  return out;
}

at::Tensor quant_linear_parts(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                              at::IntArrayRef rows) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<int64_t> first(blocks.size() + 1, 0);  // each part's first output column
  std::vector<const uint8_t*> bases(blocks.size());
  bool unpacks = false;  // whether some part is unpacked through memory (not repacked)
  for (size_t p = 0; p < blocks.size(); ++p) {
    first[p + 1] = first[p] + rows[p];
    bases[p] = blocks[p].data_ptr<uint8_t>();
    unpacks = unpacks || !(types[p] & kRepacked);
  }
  const int64_t n = first.back();
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  QuantizedX qx(m, k);
  quantize_x(x, qx);
  float* op = out.data_ptr<float>();
  // One parallel pass over every part's rows (x is quantized once for all of them).
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::optional<RowBuffers> buffers;
    if (unpacks) buffers.emplace(k);
    size_t p = 0;
    for (int64_t j = begin; j < end; ++j) {
      while (j >= first[p + 1]) ++p;
      const int64_t type = types[p], base_type = type & ~kRepacked;
      const uint8_t* row = bases[p] + (j - first[p]) * blocks[p].stride(0);
      const bool is_signed = base_type == kQ8_0;
#ifdef OCTAVO_INT8_512
      if (type & kRepacked) {
        const RepackedChunks chunks{base_type, row, k / block_weights(base_type)};
        if (is_signed) {
          dot_all_chunks<true>(chunks, k, qx, m, op + j, n);
        } else {
          dot_all_chunks<false>(chunks, k, qx, m, op + j, n);
        }
        continue;
      }
#endif
      const Unpacked w = buffers->view();
      unpack_lanes(type, row, k, w);
      if (is_signed) {
        dot_all_rows<true>(w, k, qx, m, op + j, n);
      } else {
        dot_all_rows<false>(w, k, qx, m, op + j, n);
      }
    }
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n) {
  return quant_linear_parts(x, {blocks}, {type}, {n});
}

at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t type, int64_t k,
                            at::ScalarType dtype) {
  const int64_t rows = blocks.size(0), row_stride = blocks.size(1);
  at::Tensor out = at::empty({rows, k}, blocks.options().dtype(dtype));
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  const bool is_signed = (type & ~kRepacked) == kQ8_0;
  const bool to_bf16 = dtype == at::kBFloat16;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    RowBuffers buffers(k);
    const Unpacked w = buffers.view();
    std::vector<float> row(k);
    for (int64_t i = begin; i < end; ++i) {
      unpack_any(type, base + i * row_stride, k, w);
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
