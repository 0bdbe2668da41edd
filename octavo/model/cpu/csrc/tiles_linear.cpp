// x @ W^T for a bfloat16 weight from a copy of W laid out once in pairs of k, as AMX tiles and
// AVX512-BF16's pair dot products (vdpbf16ps) both read it.
//
// At a decode batch of 8-64 rows a bfloat16 weight's matmul is bound by reading the weight from
// memory once, or, where each product is a float32 FMA, by the FMAs. torch's GEMM (oneDNN)
// reorders the weight per call unless given a reordered copy, and with one still runs below
// the memory's bandwidth at these sizes on weights that come from far caches, as a decode
// step's do (each weight is read once a step). Here the weight is stored as the tiles' second
// operand reads it (pairs of k in a 32-bit word):
//
//   tiled[g][s][h][p][c][e] = W[32 g + 16 h + c][32 s + 2 p + e]     (zeros past n and k)
//
// so one tile (16 output columns x 32 values of k) is 1 KB of contiguous memory, and a thread
// walks its 32-column groups of W as one contiguous stream, asking for it a few slices ahead.
// x is rounded to bfloat16 row by row. Two kernels read the layout:
// - AMX (where the CPU has the tiles and the OS grants them): tiles 0-3 hold the 32 x 32
//   float32 sums of 32 rows of x against a weight group across the whole of k, stored straight
//   into the output;
// - AVX512-BF16 (CPUs with bfloat16 dot products but no tiles, such as AMD's Zen 4): a row of a
//   tile, 16 columns x one pair of k, is one 64-byte vector, and vdpbf16ps adds a row of x's
//   pair (broadcast) times it into 16 float32 sums: 12 rows of x x 32 columns in 24
//   accumulators, twice the products of a float32 FMA per instruction.
// Results: the float32 sums of the bf16 products, as torch's bf16 GEMM gives them up to
// summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_dot.h"
#include "ops.h"

namespace octavo {
namespace {

#ifdef OCTAVO_AVX512BF16

constexpr int64_t kGroup = 32;   // output columns of a weight group (two tiles' or vectors')
constexpr int64_t kSliceK = 32;  // values of k per tile row (64 bytes of bf16)
constexpr int64_t kAhead = 4;    // slices of the weight stream AMX asks for ahead
constexpr int64_t kSliceElems = kGroup * kSliceK;  // bf16 values of one slice of a group

// The 2 KB of one slice of a weight group (32 columns x 32 values), asked for into the caches.
inline void prefetch_slice(const c10::BFloat16* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < kSliceElems * 2; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
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
      to_bf16_row(x.data_ptr<float>() + i * k, k, row);
    }
  });
}

// Slices of k per chunk of dot_linear: a chunk of a weight group (16 KB) stays in L1 while every
// block of x passes over it, and the next chunk is asked for meanwhile.
constexpr int64_t kDotChunkSlices = 8;

// The AVX512-BF16 kernel: threads take runs of weight groups, a group is taken in chunks of k,
// and each chunk meets x in blocks of up to kDotRows rows (adding into the output after the
// first chunk) while the next chunk, the next in memory, is asked for a share per block.
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t n) {
  const int64_t m = x.size(0), slices = tiled.size(1), kp = slices * kSliceK;
  const int64_t groups = tiled.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  std::vector<c10::BFloat16> xrows;
  bf16_rows(x, m, kp, xrows);
  const c10::BFloat16* w = tiled.data_ptr<c10::BFloat16>();
  float* op = out.data_ptr<float>();
  constexpr PairLayout layout{kGroup, kSliceElems / 2, kSliceElems};
  // Blocks of as equal a size as whole blocks allow (32 rows: 11, 11, 10, not 12, 12, 8).
  const int64_t num_blocks = (m + kDotRows - 1) / kDotRows;
  const int64_t block = (m + num_blocks - 1) / num_blocks;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const c10::BFloat16* wg = w + g * slices * kSliceElems;
      const int64_t n_valid = std::min(kGroup, n - g * kGroup);
      for (int64_t s0 = 0; s0 < slices; s0 += kDotChunkSlices) {
        const int64_t chunk = std::min(kDotChunkSlices, slices - s0);
        const c10::BFloat16* ws = wg + s0 * kSliceElems;
        // The next chunk starts where this one ends (the next group's first, past the last);
        // its lines are asked for in equal shares by the blocks.
        const char* next = reinterpret_cast<const char*>(ws + chunk * kSliceElems);
        const int64_t lines = kDotChunkSlices * kSliceElems * 2 / 64;
        const int64_t share = (lines / num_blocks + 1) / 2 * 2;
        for (int64_t b = 0, r0 = 0; r0 < m; ++b, r0 += block) {
          dot_rows(std::min(block, m - r0), xrows.data() + r0 * kp + s0 * kSliceK, kp, ws,
                   layout, chunk, op + r0 * n + g * kGroup, n, n_valid, s0 > 0,
                   next + 64 * b * share, std::min(share, lines - b * share));
        }
      }
    }
  });
  return out;
}

#endif

#ifdef OCTAVO_AMX

constexpr int64_t kChunkSlices = 8;  // slices of k per chunk when x has several blocks

// The AMX kernel (amx_permitted() checked by the caller).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t slices = tiled.size(1), kp = slices * kSliceK, groups = tiled.size(0);
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
}

#endif

}  // namespace

bool bf16_tiles_available() {
#ifdef OCTAVO_AVX512BF16
  return true;
#else
  return false;
#endif
}

at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t n, bool amx) {
#ifdef OCTAVO_AVX512BF16
  const int64_t k = x.size(1), kp = tiled.size(1) * kSliceK;
  TORCH_CHECK(kp >= k && kp - k < kSliceK && tiled.size(0) * kGroup >= n,
              "tiles_linear: the tiled weight does not match x and n");
#ifdef OCTAVO_AMX
  if (amx && amx_permitted()) return amx_linear(x, tiled, n);
#endif
  return dot_linear(x, tiled, n);
#else
  TORCH_CHECK(false, "tiles_linear: this build has no bfloat16 dot products (AVX512-BF16)");
  return at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
#endif
}

}  // namespace octavo
