// CPU kernels for the places where a general-purpose library does badly on this workload:
//
//  - paged_decode_attention (decode_attention.cpp): one query token per request attends to its
//    keys and values where they lie in the paged cache, block by block, with no gather into a
//    padded copy, and paged_prefill_attention (prefill_attention.cpp), the same for prompt
//    chunks (causal, flash-attention style);
//  - packed_linear (packed_linear.cpp, panels.h): out = x @ W^T from a copy of W packed at load
//    time into panels of columns (float32, or bfloat16 widened in registers; accumulation in
//    fp32): at decode sizes BLAS GEMMs run far below memory bandwidth, and up to prompt sizes it
//    keeps level with them.
//  - quant_linear (quant_linear.cpp, quant_blocks.h): the same product with W in one of GGML's
//    block types (Q4_0 ... Q6_K), on the blocks: x quantized to 8 bits, integer dot products;
//    and quant_dequantize, the float rows the blocks stand for.
//
// Beside them (elementwise.cpp), RMSNorm (with the residual add), rotary embedding, SiLU-and-mul
// and the KV cache write, one pass each over the data instead of the half-dozen ops (and
// temporaries) they take in torch, which dominate a decode step's op count once the matmuls are
// fast; the sampler's draw (sampling.cpp); and a whole decoder layer for decode rows as one call
// of the others (decode_layer.cpp). simd.h holds the vector helpers they share.
//
// All are registered here as torch operators (torch.ops.octavo.*) and parallelised with
// at::parallel_for, so they share torch's thread pool instead of starting another one.

#include <torch/library.h>

#include "ops.h"
#include "panels.h"

namespace octavo {

int64_t packed_panel() { return kPanel; }

bool vectorized() {
#ifdef OCTAVO_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace octavo

TORCH_LIBRARY(octavo, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, float scale, int window, float softcap, "
      "bool bf16_products=False) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, Tensor query_start, Tensor query_lens, "
      "Tensor seq_lens, float scale, int window, float softcap, bool tiles=False, "
      "bool amx=True) -> ()");
  m.def("packed_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor blocks, int type, int n) -> Tensor");
  // Block weights of one or more types as one projection (x quantized once, one parallel pass).
  m.def("quant_linear_parts(Tensor x, Tensor[] blocks, int[] types, int[] rows) -> Tensor");
  m.def("quant_dequantize(Tensor blocks, int type, int k, ScalarType dtype) -> Tensor");
  m.def("quant_repack(Tensor blocks, int type, int k) -> Tensor");
  // Many rows on block weights by AMX tiles, where amx_tiles_available().
  m.def("quant_linear_tiles(Tensor x, Tensor blocks, int type, int n) -> Tensor");
  m.def("amx_tiles_available() -> bool", &octavo::amx_tiles_available);
  // Decode batches on a bfloat16 weight in tile order, by AMX tiles or AVX512-BF16 dot
  // products, where bf16_tiles_available().
  m.def("tiles_linear(Tensor x, Tensor tiled, int n, bool amx=True) -> Tensor");
  m.def("bf16_tiles_available() -> bool", &octavo::bf16_tiles_available);
  // The type id of a repacked layout of `type` in this build; `type` itself if it has none.
  m.def("quant_repacked_type(int type) -> int", &octavo::quant_repacked_type);
  // Columns per packed_linear panel in this build (the layout pack_linear_weight must write).
  m.def("packed_panel() -> int", &octavo::packed_panel);
  m.def(
      "rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, bool has_residual)"
      " -> ()");
  m.def("rotary(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("sample_categorical(Tensor(a!) logits, Tensor uniform) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  // Whether this build has the AVX2 paths (else every kernel runs its plain loops).
  m.def("vectorized() -> bool", &octavo::vectorized);
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping)"
      " -> ()");
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor(b!) residual, Tensor input_norm, "
      "Tensor post_norm, float eps, Tensor[] weights, int[] kinds, int[] rows, int[] limits, "
      "int[] tile_limits, int[] parts, ScalarType gemm_dtype, "
      "Tensor? qkv_bias, Tensor? o_bias, Tensor? gate_up_bias, Tensor? down_bias, "
      "Tensor? q_norm, Tensor? k_norm, int qk_norm_kind, float residual_multiplier, "
      "int num_heads, int num_kv_heads, int head_dim, bool bf16_attention, float scale, "
      "int window, Tensor cos, "
      "Tensor sin, Tensor(c!) kv_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor seq_lens) -> Tensor");
  m.def(
      "moe_feed_forward(Tensor x, Tensor[] weights, int[] kinds, int[] rows, int[] limits, "
      "int[] tile_limits, int[] parts, ScalarType gemm_dtype, int top_k, bool renormalize) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(octavo, CPU, m) {
  m.impl("paged_decode_attention", &octavo::paged_decode_attention);
  m.impl("paged_prefill_attention", &octavo::paged_prefill_attention);
  m.impl("packed_linear", &octavo::packed_linear);
  m.impl("quant_linear", &octavo::quant_linear);
  m.impl("quant_linear_parts", &octavo::quant_linear_parts);
  m.impl("quant_dequantize", &octavo::quant_dequantize);
  m.impl("quant_repack", &octavo::quant_repack);
  m.impl("quant_linear_tiles", &octavo::quant_linear_tiles);
  m.impl("tiles_linear", &octavo::tiles_linear);
  m.impl("rms_norm", &octavo::rms_norm);
  m.impl("rotary", &octavo::rotary);
  m.impl("silu_and_mul", &octavo::silu_and_mul);
  m.impl("sample_categorical", &octavo::sample_categorical);
  m.impl("argmax_rows", &octavo::argmax_rows);
  m.impl("write_kv_cache", &octavo::write_kv_cache);
  m.impl("decode_layer", &octavo::decode_layer);
  m.impl("moe_feed_forward", &octavo::moe_feed_forward);
}

// The one-call layers also take float weights reordered for oneDNN (mkldnn tensors, kind -2
// parts; model/cpu/onednn.py), whose dispatch key is MkldnnCPU: the same CPU implementations.
TORCH_LIBRARY_IMPL(octavo, MkldnnCPU, m) {
  m.impl("decode_layer", &octavo::decode_layer);
  m.impl("moe_feed_forward", &octavo::moe_feed_forward);
}
