// The operators this library registers as torch.ops.octavo.* (registration.cpp), one kernel
// family per source file. Shapes, dtypes and layouts are checked by the Python wrappers
// (octavo/model/cpu/ops.py), whose docstrings give each contract; the plain-torch versions the
// tests compare against are in octavo/model/cpu/reference.py.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace octavo {

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double softcap, bool bf16_products);

// prefill_attention.cpp (tiles: the products in bfloat16 for a bfloat16 cache, on AMX tiles
// where the OS grants them and `amx`, else by AVX512-BF16 dot products; where
// bf16_tiles_available())
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& query_lens,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double softcap, bool tiles, bool amx);

// packed_linear.cpp
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_dim);
int64_t packed_panel();

// quant_linear.cpp
// quant_linear over several weights of one x, their outputs side by side (parts of one
// projection; quantizes x once).
at::Tensor quant_linear_parts(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                              at::IntArrayRef rows);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n);
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t type, int64_t k,
                            at::ScalarType dtype);
at::Tensor quant_repack(const at::Tensor& blocks, int64_t type, int64_t k);
int64_t quant_repacked_type(int64_t type);
// x @ W^T for many rows by AMX-BF16 tiles on the weights dequantized a few rows at a time
// (float32 sums of bf16-rounded operands), where amx_tiles_available().
at::Tensor quant_linear_tiles(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                              int64_t n);
bool amx_tiles_available();

// tiles_linear.cpp
// x @ W^T for a bfloat16 weight laid out once in AMX tile order (float32 sums of bf16-rounded
// operands): AMX tiles where the OS grants them and `amx`, else AVX512-BF16 dot products;
// where bf16_tiles_available().
at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t n, bool amx);
bool bf16_tiles_available();

// elementwise.cpp
void rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps,
              bool has_residual);
void rotary(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping);

// decode_layer.cpp
at::Tensor decode_layer(at::Tensor hidden, at::Tensor residual, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef rows, at::IntArrayRef limits,
                        at::IntArrayRef tile_limits, at::IntArrayRef parts,
                        at::ScalarType gemm_dtype,
                        const c10::optional<at::Tensor>& qkv_bias,
                        const c10::optional<at::Tensor>& o_bias,
                        const c10::optional<at::Tensor>& gate_up_bias,
                        const c10::optional<at::Tensor>& down_bias,
                        const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, int64_t qk_norm_kind,
                        double residual_multiplier, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, bool bf16_attention,
                        double scale, int64_t window, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor kv_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& seq_lens);
at::Tensor moe_feed_forward(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                            at::IntArrayRef rows, at::IntArrayRef limits,
                            at::IntArrayRef tile_limits, at::IntArrayRef parts,
                            at::ScalarType gemm_dtype, int64_t top_k, bool renormalize);

// sampling.cpp
at::Tensor sample_categorical(at::Tensor logits, const at::Tensor& uniform);
at::Tensor argmax_rows(const at::Tensor& logits);

// registration.cpp: whether this build has the AVX2 paths (else every kernel runs plain loops).
bool vectorized();

}  // namespace octavo
