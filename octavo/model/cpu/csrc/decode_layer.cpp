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
// With no parts for gate_up and down it returns post_norm's output (the caller's MLP follows).
// The four projections (qkv, o, gate_up, down) are parts[0..3] consecutive entries of weights,
// each part of n = rows[i] output rows, concatenated: kinds[i] -1 for weights packed by
// pack_linear_weight (packed_linear, one part), else the GGML block type id, repacked or not, of
// blocks (quant_linear_parts), as the Python weight formats multiply them. The Python wrapper
// checks the rest.
at::Tensor decode_layer(at::Tensor hidden, at::Tensor residual, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, at::TensorList weights,
                        at::IntArrayRef kinds, at::IntArrayRef rows, at::IntArrayRef parts,
                        const c10::optional<at::Tensor>& qkv_bias,
                        const c10::optional<at::Tensor>& o_bias,
                        const c10::optional<at::Tensor>& gate_up_bias,
                        const c10::optional<at::Tensor>& down_bias, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_table,
                        const at::Tensor& seq_lens) {
  const int64_t num_tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(parts.size() == 4, "decode_layer: parts of four projections");
  int64_t first[5] = {0};
  for (int p = 0; p < 4; ++p) first[p + 1] = first[p] + parts[p];
  TORCH_CHECK(first[4] == static_cast<int64_t>(weights.size()) &&
                  kinds.size() == weights.size() && rows.size() == weights.size(),
              "decode_layer: one kind and row count per weight part");
  auto linear = [&](const at::Tensor& x, int projection, const c10::optional<at::Tensor>& bias) {
    const int64_t begin = first[projection], count = parts[projection];
    // Packed weights are one part; block weights of one or more types one call.
    at::Tensor out = kinds[begin] < 0
                         ? packed_linear(x, weights[begin], rows[begin])
                         : quant_linear_parts(x, weights.slice(begin, count),
                                              kinds.slice(begin, count), rows.slice(begin, count));
    if (bias.has_value()) out.add_(*bias);
    return out;
  };
  rms_norm(hidden, residual, input_norm, eps, true);
  at::Tensor qkv = linear(hidden, 0, qkv_bias);
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
  at::Tensor x = linear(attn.view({num_tokens, q_size}), 1, o_bias);
  rms_norm(x, residual, post_norm, eps, true);
  // No MLP parts: the caller runs the layer's feed-forward itself (a mixture of experts).
  if (parts[2] == 0 && parts[3] == 0) return x;
  const at::Tensor gate_up = linear(x, 2, gate_up_bias);
  return linear(silu_and_mul(gate_up), 3, down_bias);
}

}  // namespace octavo
