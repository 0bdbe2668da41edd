// x @ W^T for a bfloat16 weight on AMX tiles, from a copy of W laid out once as the tiles read it.
//
// At a decode batch of 8-64 rows a bfloat16 weight's matmul is bound by reading the weight from
// memory once. torch's GEMM (oneDNN on the tile units) reorders the weight per call unless given
// a reordered copy, and with one still runs below the memory's bandwidth at these sizes on
// weights that come from far caches, as a decode step's do (each weight is read once a step).
// Here the weight is stored as the tiles' second operand reads it (pairs of k in a 32-bit word):
//
//   tiled[g][s][h][p][c][e] = W[32 g + 16 h + c][32 s + 2 p + e]     (zeros past n and k)
//
// so one tile (16 output columns x 32 values of k) is 1 KB of contiguous memory, and a thread
// walks its 32-column groups of W as one contiguous stream, asking for it a few slices ahead.
// x is rounded to bfloat16 row by row (the tiles' first operand reads rows as they lie), and
// tiles 0-3 hold the 32 x 32 float32 sums of 32 rows of x against a weight group across the
// whole of k, stored straight into the output. Results: the float32 sums of the bf16
// products, as torch's bf16 GEMM gives them up to summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "ops.h"

namespace octavo {
namespace {

#ifdef OCTAVO_AMX

constexpr int64_t kGroup = 2 * kAmxRows;  // output columns (and rows of x) a tile pair covers
constexpr int64_t kSliceK = 32;           // values of k per tile row (64 bytes of bf16)
constexpr int64_t kAhead = 4;             // slices of the weight stream asked for ahead
constexpr int64_t kChunkSlices = 8;       // slices of k per chunk when x has several blocks

// The 2 KB of one slice of a weight group (32 columns x 32 values), asked for into the caches.
inline void prefetch_slice(const c10::BFloat16* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < kGroup * kSliceK * 2; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// x as bfloat16 rows of kp values (k rounded up to 32), mp rows (m rounded up to 16), zeros
// past m and k.
void bf16_rows(const at::Tensor& x, int64_t mp, int64_t kp, std::vector<c10::BFloat16>& rows) {
  const int64_t m = x.size(0), k = x.size(1);
  rows.assign(mp * kp, c10::BFloat16(0.f));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      c10::BFloat16* row = rows.data() + i * kp;
      if (bf16) {
        std::memcpy(static_cast<void*>(row), x.data_ptr<c10::BFloat16>() + i * k,
                    k * sizeof(c10::BFloat16));
        continue;
      }
      const float* src = x.data_ptr<float>() + i * k;
      int64_t e = 0;
      for (; e + 32 <= k; e += 32) {
        _mm512_storeu_si512(row + e,
                            to_bf16(_mm512_loadu_ps(src + e), _mm512_loadu_ps(src + e + 16)));
      }
      for (; e < k; ++e) row[e] = c10::BFloat16(src[e]);
    }
  });
}

#endif

}  // namespace

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
#ifdef OCTAVO_AMX
  TORCH_CHECK(amx_permitted(), "amx_linear: this CPU or OS gives no AMX tiles");
  const int64_t slices = tiled.size(1), kp = slices * kSliceK, groups = tiled.size(0);
  TORCH_CHECK(kp >= k && kp - k < kSliceK && groups * kGroup >= n,
              "amx_linear: the tiled weight does not match x and n");
  if (m == 0 || n == 0) return at::empty({m, n}, x.options().dtype(at::kFloat));
  // Up to 16 rows, one tile of x against the group's two; above, blocks of 32 x 32. The
  // output is written (and read back between k chunks) by whole tiles: rows and columns
  // padded to them, cut at the end.
  const bool one_tile = m <= kAmxRows;
  const int64_t xstep = one_tile ? kAmxRows : kGroup;
  const int64_t mp = (m + xstep - 1) / xstep * xstep, np = groups * kGroup;
  at::Tensor out = at::empty({mp, np}, x.options().dtype(at::kFloat));
  std::vector<c10::BFloat16> xrows;
  bf16_rows(x, mp, kp, xrows);
  const c10::BFloat16* w = tiled.data_ptr<c10::BFloat16>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = kp * sizeof(c10::BFloat16), out_bytes = np * sizeof(float);
  // One pass of x blocks over a group's k in chunks, so that a chunk of the group's weights
  // (16 KB) stays in L1 while every block of x uses it; with one block there is one chunk.
  const int64_t chunk = mp > xstep ? kChunkSlices : slices;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    AmxTiles amx;
    for (int64_t g = begin; g < end; ++g) {
      const c10::BFloat16* wg = w + g * slices * kGroup * kSliceK;
      for (int64_t s0 = 0; s0 < slices; s0 += chunk) {
        const int64_t s1 = std::min(slices, s0 + chunk);
        for (int64_t x0 = 0; x0 < mp; x0 += xstep) {
          const c10::BFloat16* xs = xrows.data() + x0 * kp;
          float* dst = op + x0 * np + g * kGroup;
          // The first block of x streams the chunk from memory; later ones find it in L1.
          const bool stream = x0 == 0;
          if (s0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, dst, out_bytes);
            _tile_loadd(1, dst + kAmxRows, out_bytes);
            if (!one_tile) {
              _tile_loadd(2, dst + kAmxRows * np, out_bytes);
              _tile_loadd(3, dst + kAmxRows * np + kAmxRows, out_bytes);
            }
          }
          const c10::BFloat16* ws = wg + s0 * kGroup * kSliceK;
          if (one_tile) {
            for (int64_t s = s0; s < s1; ++s, ws += kGroup * kSliceK) {
              if (stream) prefetch_slice(ws + kAhead * kGroup * kSliceK);
              _tile_loadd(4, xs + s * kSliceK, row_bytes);
              _tile_loadd(6, ws, 64);
              _tile_loadd(7, ws + kAmxRows * kSliceK, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
            }
          } else {
            for (int64_t s = s0; s < s1; ++s, ws += kGroup * kSliceK) {
              if (stream) prefetch_slice(ws + kAhead * kGroup * kSliceK);
              _tile_loadd(4, xs + s * kSliceK, row_bytes);
              _tile_loadd(5, xs + kAmxRows * kp + s * kSliceK, row_bytes);
              _tile_loadd(6, ws, 64);
              _tile_loadd(7, ws + kAmxRows * kSliceK, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, dst, out_bytes);
          _tile_stored(1, dst + kAmxRows, out_bytes);
          if (!one_tile) {
            _tile_stored(2, dst + kAmxRows * np, out_bytes);
            _tile_stored(3, dst + kAmxRows * np + kAmxRows, out_bytes);
          }
        }
      }
    }
  });
  if (mp == m && np == n) return out;
  // Rows only: the first m rows of a row-major matrix are contiguous.
  return np == n ? out.narrow(0, 0, m) : out.narrow(0, 0, m).narrow(1, 0, n).contiguous();
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX path");
  return at::empty({m, n}, x.options().dtype(at::kFloat));
#endif
}

}  // namespace octavo
