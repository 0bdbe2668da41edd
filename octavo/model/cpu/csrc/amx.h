// AMX (Intel's tile registers and their bfloat16 dot products, tdpbf16ps): what the kernels
// that use them share. OCTAVO_AMX is set where the build (-march=native) has AMX-BF16 and
// AVX512-BF16; a kernel must still ask amx_permitted() at run time, since Linux gives a process
// the tile registers only on request.

#pragma once

#include "simd.h"

#if defined(OCTAVO_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define OCTAVO_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

namespace octavo {
namespace {

constexpr int64_t kAmxRows = 16;                     // rows of a tile
constexpr int64_t kAmxFloats = kAmxRows * kAmxRows;  // a 16 x 16 float32 tile

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The eight tiles as 16 rows of 64 bytes each (16 floats, or 32 bfloat16, a row), for the
// lifetime of the object on this thread.
struct AmxTiles {
  AmxTiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = kAmxRows;
    }
    _tile_loadconfig(&config);
  }
  ~AmxTiles() { _tile_release(); }
};

// Whether this process may use the tile registers: Linux hands out their state per process,
// on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel without it answers no.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

}  // namespace
}  // namespace octavo

#endif
