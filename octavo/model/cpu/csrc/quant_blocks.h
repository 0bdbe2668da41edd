// GGML's block types, unpacked: one row of a quantized weight into a form every kernel of
// quant_linear.cpp shares, whatever the type.
//
// A row of k weights is k / block_size blocks (ggml-common.h has the layouts; block_q4_0 ...
// block_q6_K below follow it byte for byte). Unpacked, weight e of the row is
//
//   w[e] = scale[e / 16] * q[e] + bias[e / 16]
//
// with q[e] an unsigned 8-bit integer (signed for Q8_0, whose bias is 0) and one scale and one
// bias per sixteen weights (the smallest sub-block of any type). So a type's offset (Q4_0's 8,
// Q6_K's 32) and its minimum (Q4_1's m, the K-quants' dmin * min) both become the bias, which a
// dot product applies once per sixteen weights through the sum of the activations there. The Python reference is
// octavo/model/formats/ggml.py, written from the same layouts and checked against gguf's numpy.

#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace octavo {
namespace {

// GGML's type ids (the values GGUF files store; gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

inline float half_to_float(uint16_t bits) {
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion branches
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline float load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return half_to_float(bits);
}

// Where one row's unpacked form goes: q[k], scale[k / 16], bias[k / 16].
struct Unpacked {
  uint8_t* q;
  float* scale;
  float* bias;
};

// ---- 32-weight types: one scale (and minimum) per block ------------------------------------

// The 16 bytes of nibbles of a 32-weight block: weight j is the low nibble of byte j, weight
// j + 16 its high nibble.
inline void unpack_nibbles32(const uint8_t* qs, uint8_t* q) {
#ifdef __AVX2__
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xF);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_and_si128(v, mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0xF;
    q[j + 16] = qs[j] >> 4;
  }
#endif
}

// The fifth bits of a 32-weight block (a little-endian 32-bit mask, bit j for weight j).
inline void add_high_bits32(const uint8_t* qh, uint8_t* q) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  for (int j = 0; j < 32; ++j) q[j] |= ((bits >> j) & 1) << 4;
}

// Block b of the row: scale and bias for its 2 sixteens.
inline void set_block32(const Unpacked& u, int64_t b, float scale, float bias) {
  u.scale[2 * b] = u.scale[2 * b + 1] = scale;
  u.bias[2 * b] = u.bias[2 * b + 1] = bias;
}

// block_q4_0 {half d; uint8 qs[16]}: w = d * (q - 8)
inline void unpack_q4_0(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 32; ++b, row += 18) {
    const float d = load_half(row);
    unpack_nibbles32(row + 2, u.q + 32 * b);
    set_block32(u, b, d, -8.f * d);
  }
}

// block_q4_1 {half d, m; uint8 qs[16]}: w = d * q + m
inline void unpack_q4_1(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 32; ++b, row += 20) {
    unpack_nibbles32(row + 4, u.q + 32 * b);
    set_block32(u, b, load_half(row), load_half(row + 2));
  }
}

// block_q5_0 {half d; uint8 qh[4]; uint8 qs[16]}: w = d * (q - 16)
inline void unpack_q5_0(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 32; ++b, row += 22) {
    const float d = load_half(row);
    unpack_nibbles32(row + 6, u.q + 32 * b);
    add_high_bits32(row + 2, u.q + 32 * b);
    set_block32(u, b, d, -16.f * d);
  }
}

// block_q5_1 {half d, m; uint8 qh[4]; uint8 qs[16]}: w = d * q + m
inline void unpack_q5_1(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 32; ++b, row += 24) {
    unpack_nibbles32(row + 8, u.q + 32 * b);
    add_high_bits32(row + 4, u.q + 32 * b);
    set_block32(u, b, load_half(row), load_half(row + 2));
  }
}

// block_q8_0 {half d; int8 qs[32]}: w = d * q, q signed
inline void unpack_q8_0(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 32; ++b, row += 34) {
    std::memcpy(u.q + 32 * b, row + 2, 32);
    set_block32(u, b, load_half(row), 0.f);
  }
}

// ---- K-quants: 256-weight super-blocks of 16 or 32-weight sub-blocks -----------------------

// Weight 128h + 32j + l (h < 2, j < 4, l < 32) is bits 2j..2j+1 of byte 32h + l.
inline void unpack_two_bit_planes(const uint8_t* qs, uint8_t* q) {
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
    }
  }
}

// Sub-block s of 16 weights of super-block b: its scale and bias.
inline void set_sub16(const Unpacked& u, int64_t b, int s, float scale, float bias) {
  u.scale[16 * b + s] = scale;
  u.bias[16 * b + s] = bias;
}

// Sub-block s of 32 weights of super-block b.
inline void set_sub32(const Unpacked& u, int64_t b, int s, float scale, float bias) {
  u.scale[16 * b + 2 * s] = u.scale[16 * b + 2 * s + 1] = scale;
  u.bias[16 * b + 2 * s] = u.bias[16 * b + 2 * s + 1] = bias;
}

// block_q2_K {uint8 scales[16]; uint8 qs[64]; half d, dmin}: per 16 weights a 4-bit scale
// (low nibble) and a 4-bit minimum (high): w = d * scale * q - dmin * min
inline void unpack_q2_k(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 256; ++b, row += 84) {
    const float d = load_half(row + 80), dmin = load_half(row + 82);
    unpack_two_bit_planes(row + 16, u.q + 256 * b);
    for (int s = 0; s < 16; ++s) {
      set_sub16(u, b, s, d * (row[s] & 0xF), -dmin * (row[s] >> 4));
    }
  }
}

// block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d}: per 16 weights a signed
// 6-bit scale; w = d * (scale - 32) * (q2 - (high bit ? 0 : 4)), unpacked as q = q2 + 4 * high
// (0..7) with bias -4 * scale. The high bit of weight 128h + 32j + l is bit 4h + j of hmask[l].
inline void unpack_q3_k(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 256; ++b, row += 110) {
    uint8_t* q = u.q + 256 * b;
    unpack_two_bit_planes(row + 32, q);
    for (int bit = 0; bit < 8; ++bit) {
      for (int l = 0; l < 32; ++l) q[32 * bit + l] |= ((row[l] >> bit) & 1) << 2;
    }
    const uint8_t* sc = row + 96;
    const float d = load_half(row + 108);
    for (int s = 0; s < 16; ++s) {
      const int low = s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4;
      const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
      const float scale = d * static_cast<float>((low | (high << 4)) - 32);
      set_sub16(u, b, s, scale, -4.f * scale);
    }
  }
}

// The 6-bit scale and minimum of sub-block j of Q4_K / Q5_K (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 64 weights per 32 bytes: weight 64j + l is the low nibble of byte 32j + l, 64j + 32 + l the
// high one.
inline void unpack_k4_nibbles(const uint8_t* qs, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = qs[32 * j + l] & 0xF;
      q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  }
}

inline void set_k4_scales(const uint8_t* row, int64_t b, const Unpacked& u) {
  const float d = load_half(row), dmin = load_half(row + 2);
  for (int s = 0; s < 8; ++s) {
    int scale, min;
    scale_min_k4(row + 4, s, scale, min);
    set_sub32(u, b, s, d * static_cast<float>(scale), -dmin * static_cast<float>(min));
  }
}

// block_q4_K {half d, dmin; uint8 scales[12]; uint8 qs[128]}: per 32 weights a 6-bit scale
// and minimum: w = d * scale * q - dmin * min
inline void unpack_q4_k(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 256; ++b, row += 144) {
    unpack_k4_nibbles(row + 16, u.q + 256 * b);
    set_k4_scales(row, b, u);
  }
}

// block_q5_K {half d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}: Q4_K with a fifth
// bit; weight 32i + l takes bit i of qh[l].
inline void unpack_q5_k(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 256; ++b, row += 176) {
    uint8_t* q = u.q + 256 * b;
    unpack_k4_nibbles(row + 48, q);
    for (int bit = 0; bit < 8; ++bit) {
      for (int l = 0; l < 32; ++l) q[32 * bit + l] |= ((row[16 + l] >> bit) & 1) << 4;
    }
    set_k4_scales(row, b, u);
  }
}

// block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d}: per 16 weights a signed
// 8-bit scale: w = d * scale * (q - 32). In half h of 128 weights, weight 32i + l has its low 4
// bits in ql[64h + 32(i % 2) + l] (the low nibble for i < 2, else the high) and its high 2 bits
// at bit 2i of qh[32h + l].
inline void unpack_q6_k(const uint8_t* row, int64_t k, const Unpacked& u) {
  for (int64_t b = 0; b < k / 256; ++b, row += 210) {
    uint8_t* q = u.q + 256 * b;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = row + 64 * h;
      const uint8_t* qh = row + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        q[128 * h + l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
        q[128 * h + 32 + l] = (ql[32 + l] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        q[128 * h + 64 + l] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        q[128 * h + 96 + l] = (ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    const float d = load_half(row + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    for (int s = 0; s < 16; ++s) {
      const float scale = d * static_cast<float>(sc[s]);
      set_sub16(u, b, s, scale, -32.f * scale);
    }
  }
}

// Bytes per block and weights per block of a type; 0 for a type this file does not know.
inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

inline int64_t block_weights(int64_t type) { return type >= kQ2_K ? 256 : 32; }

// Unpack one row of k weights of `type` (checked by the caller) into u.
inline void unpack_row(int64_t type, const uint8_t* row, int64_t k, const Unpacked& u) {
  switch (type) {
    case kQ4_0: unpack_q4_0(row, k, u); break;
    case kQ4_1: unpack_q4_1(row, k, u); break;
    case kQ5_0: unpack_q5_0(row, k, u); break;
    case kQ5_1: unpack_q5_1(row, k, u); break;
    case kQ8_0: unpack_q8_0(row, k, u); break;
    case kQ2_K: unpack_q2_k(row, k, u); break;
    case kQ3_K: unpack_q3_k(row, k, u); break;
    case kQ4_K: unpack_q4_k(row, k, u); break;
    case kQ5_K: unpack_q5_k(row, k, u); break;
    case kQ6_K: unpack_q6_k(row, k, u); break;
    default: break;
  }
}

}  // namespace
}  // namespace octavo
