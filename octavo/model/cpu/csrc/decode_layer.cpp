// A whole Llama-style decoder layer for decode rows, as one call of the other kernels.

#include "ops.h"

namespace octavo {

// A Llama-style layer (octavo/model/llama.py, LlamaDecoderLayer with a residual) over rows that
// are all single-token decodes, as one call of the kernels above in the order the Python layer
// calls them, so the results are the same bit for bit. It exists because at small batches the
// ~25 torch ops and Python calls around the kernels of each layer cost as much as the work.
//   residual <- hidden + residual; x <- input_norm(residual)            (in place)
//   q, k, v <- split(x @ Wqkv^T + b); rotary on q and k; k, v -> cache at slot_mapping
//   x <- paged_attention(q) @ Wo^T + b
//   residual <- x + residual; x <- post_norm(residual)
//   returns down(silu(gate(x)) * up(x))
// Packed weights are from pack_linear_weight; the Python wrapper checks the rest.
at::Tensor decode_layer(at::Tensor hidden, at::Tensor residual, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& qkv_weight,
                        const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                        const c10::optional<at::Tensor>& o_bias,
                        const at::Tensor& gate_up_weight,
                        const c10::optional<at::Tensor>& gate_up_bias,
                        const at::Tensor& down_weight, const c10::optional<at::Tensor>& down_bias,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t intermediate_size, double scale, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_table,
                        const at::Tensor& seq_lens) {
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto linear = [](const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias, int64_t n) {
    at::Tensor out = packed_linear(x, weight, n);
    if (bias.has_value()) out.add_(*bias);
    return out;
  };
  rms_norm(hidden, residual, input_norm, eps, true);
  at::Tensor qkv = linear(hidden, qkv_weight, qkv_bias, q_size + 2 * kv_size);
  rotary(qkv.narrow(1, 0, q_size + kv_size).view({num_tokens, num_heads + num_kv_heads, head_dim}),
         cos, sin);
  const at::Tensor key = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  const at::Tensor value =
      qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  write_kv_cache(key, value, kv_cache, slot_mapping);
  const at::Tensor query =
      qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim}).contiguous();
  const at::Tensor attn = paged_decode_attention(query, kv_cache.select(0, 0),
                                                 kv_cache.select(0, 1), block_table, seq_lens,
                                                 scale);
  at::Tensor x = linear(attn.view({num_tokens, q_size}), o_weight, o_bias, hidden_size);
  rms_norm(x, residual, post_norm, eps, true);
  const at::Tensor gate_up = linear(x, gate_up_weight, gate_up_bias, 2 * intermediate_size);
  return linear(silu_and_mul(gate_up), down_weight, down_bias, hidden_size);
}

}  // namespace octavo
