// packed_linear: x @ W^T from weights packed into panels (panels.h has the layout and tiles).

#include "ops.h"
#include "panels.h"

namespace octavo {
namespace {

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

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_dim) {
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (packed.scalar_type() == at::kBFloat16) {
    packed_linear_impl<c10::BFloat16>(out, x, packed, n_dim);
  } else {
    packed_linear_impl<float>(out, x, packed, n_dim);
  }
  return out;
}

}  // namespace octavo
