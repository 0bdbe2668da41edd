// A whole Llama-style decoder layer for decode rows, as one call of the other kernels, and a
// mixture-of-experts feed-forward the same way.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "ops.h"

namespace octavo {
namespace {

// Projections given as parts (see decode_layer): projection p is parts[p] consecutive entries
// of weights / kinds / rows / limits / tile_limits, packed panels (kind -1) or GGML blocks of
// one or more types. Packed panels take up to their limit (-1: any) and, where a second part
// of kind -2 follows with the float weight, torch's GEMM on that above it, as
// formats/packed.py's PackedWeight.matmul does; between the two a part of kind -3, the weight
// in AMX tile order (tiles_linear), may take the rows from the panels' limit to its own. A
// block part's limit is the most rows its kernel takes (the weight format's max_rows; -1:
// any); above it, up to its tile limit (tiles_max_rows; 0: none) the AMX tile kernel takes it,
// and above that it is dequantized to gemm_dtype and multiplied by torch's GEMM, as
// formats/quantized.py's QuantizedWeight.matmul does, so the results are the Python formats'
// own.
struct Projections {
  at::TensorList weights;
  at::IntArrayRef kinds, rows, limits, tile_limits, parts;
  at::ScalarType gemm_dtype;
  std::vector<int64_t> first;  // each projection's first entry

  Projections(at::TensorList weights_, at::IntArrayRef kinds_, at::IntArrayRef rows_,
              at::IntArrayRef limits_, at::IntArrayRef tile_limits_, at::IntArrayRef parts_,
              at::ScalarType gemm_dtype_, const char* op)
      : weights(weights_), kinds(kinds_), rows(rows_), limits(limits_),
        tile_limits(tile_limits_), parts(parts_),
        gemm_dtype(gemm_dtype_), first(parts_.size() + 1, 0) {
    for (size_t p = 0; p < parts.size(); ++p) first[p + 1] = first[p] + parts[p];
    TORCH_CHECK(first.back() == static_cast<int64_t>(weights.size()) &&
                    kinds.size() == weights.size() && rows.size() == weights.size() &&
                    limits.size() == weights.size() && tile_limits.size() == weights.size(),
                op, ": one kind, row count, row limit and tile limit per weight part");
  }

  // Kinds of a float weight's parts: packed panels, its float weight (or the copy reordered
  // for oneDNN), its copy in AMX tile order.
  static constexpr int64_t kPanels = -1, kDense = -2, kTiles = -3;

  bool kernel_takes(int64_t entry, int64_t m) const {
    return limits[entry] < 0 || m <= limits[entry];
  }

  // x @ W^T (+ bias) for W the part at `entry` above its kernel's limit: by the AMX tiles up to
  // its tile limit (QuantizedWeight.tiles_matmul), else dequantized, by torch's GEMM
  // (QuantizedWeight.gemm_matmul).
  at::Tensor gemm(const at::Tensor& x, int64_t entry, const c10::optional<at::Tensor>& bias) const {
    if (x.size(0) <= tile_limits[entry]) {
      at::Tensor out = quant_linear_tiles(x, weights[entry], kinds[entry], rows[entry]);
      if (out.scalar_type() != x.scalar_type()) out = out.to(x.scalar_type());
      if (bias.has_value()) out.add_(*bias);
      return out;
    }
    const bool kernel_dtype = gemm_dtype == at::kFloat || gemm_dtype == at::kBFloat16;
    at::Tensor w = quant_dequantize(weights[entry], kinds[entry], x.size(1),
                                    kernel_dtype ? gemm_dtype : at::kFloat);
    if (w.scalar_type() != gemm_dtype) w = w.to(gemm_dtype);
    if (gemm_dtype == x.scalar_type()) return at::linear(x, w, bias);
    at::Tensor out = at::linear(x.to(gemm_dtype), w).to(x.scalar_type());
    return bias.has_value() ? out.add(*bias) : out;
  }

  // x @ W^T (+ bias) for a float weight by torch's GEMM in its dtype, or by oneDNN's linear
  // where the weight is its reordered copy (an mkldnn tensor), as DenseWeight.matmul does.
  static at::Tensor dense(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias) {
    auto gemm = [&](const at::Tensor& in, const c10::optional<at::Tensor>& b) {
      return w.is_mkldnn() ? onednn_linear(in, w, b) : at::linear(in, w, b);
    };
    if (w.scalar_type() == x.scalar_type()) return gemm(x, bias);
    at::Tensor out = gemm(x.to(w.scalar_type()), c10::nullopt).to(x.scalar_type());
    return bias.has_value() ? out.add_(*bias) : out;
  }

  // torch's mkldnn::_linear_pointwise (model/cpu/onednn.py's linear), without an epilogue.
  static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w,
                                  const c10::optional<at::Tensor>& bias) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, c10::string_view,
                              c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
    return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
  }

  at::Tensor operator()(const at::Tensor& x, int64_t projection,
                        const c10::optional<at::Tensor>& bias = c10::nullopt) const {
    const int64_t begin = first[projection], count = parts[projection], m = x.size(0);
    at::Tensor out;
    bool all_kernel = true;
    for (int64_t i = begin; i < begin + count; ++i) all_kernel = all_kernel && kernel_takes(i, m);
    if (kinds[begin] < 0) {
      // Packed panels, then AMX tiles (if any), each up to its limit, then the float weight.
      int64_t entry = begin;
      while (entry + 1 < begin + count && !kernel_takes(entry, m)) ++entry;
      if (kinds[entry] == kDense) return dense(x, weights[entry], bias);
      out = kinds[entry] == kTiles ? tiles_linear(x, weights[entry], rows[entry], true)
                                   : packed_linear(x, weights[entry], rows[entry]);
    } else if (all_kernel) {
      out = quant_linear_parts(x, weights.slice(begin, count), kinds.slice(begin, count),
                               rows.slice(begin, count));
    } else if (count == 1) {
      return gemm(x, begin, bias);
    } else {
      // ConcatWeight: each part's own matmul, concatenated, then the bias.
      std::vector<at::Tensor> outs;
      for (int64_t i = begin; i < begin + count; ++i) {
        outs.push_back(kernel_takes(i, m)
                           ? quant_linear_parts(x, weights.slice(i, 1), kinds.slice(i, 1),
                                                rows.slice(i, 1))
                           : gemm(x, i, c10::nullopt));
      }
      out = at::cat(outs, 1);
    }
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
};

}  // namespace

// A Llama-style layer (octavo/model/llama.py, LlamaDecoderLayer with a residual) over rows that
// are all single-token decodes, as one call of the kernels above in the order the Python layer
// calls them, so the results are the same bit for bit. It exists because at small batches the
// ~25 torch ops and Python calls around the kernels of each layer cost as much as the work.
//   residual <- hidden + residual; x <- input_norm(residual)            (in place)
//   q, k, v <- split(x @ Wqkv^T + b); q/k norms where given (per head: Qwen3; over the
//   projections: OLMoE);
//   rotary on q and k; k, v -> cache at slot_mapping
//   x <- paged_attention(q) @ Wo^T + b     (block_table and seq_lens cut for `window`, if any;
//                                           bf16_attention: its bfloat16 products)
//   x <- x * residual_multiplier                                        (Granite; else 1)
//   residual <- x + residual; x <- post_norm(residual)
//   returns down(silu(gate(x)) * up(x)) * residual_multiplier
// With no parts for gate_up and down it returns post_norm's output (the caller's MLP follows).
// The four projections (qkv, o, gate_up, down) are parts[0..3] consecutive entries of weights,
// each part of n = rows[i] output rows, concatenated: kinds[i] -1 for weights packed by
// pack_linear_weight (packed_linear up to limits[i] rows, then the weight in AMX tile order of
// a kind -3 part up to its limit, if there is one, then the float weight of a kind -2 part by
// torch's GEMM), else the GGML block type id, repacked or not, of blocks
// (quant_linear_parts) up to limits[i] rows, the AMX tiles up to tile_limits[i] and torch's
// GEMM on them dequantized to gemm_dtype above (Projections), as the Python weight formats
// multiply them. The Python wrapper checks the rest.
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
                        at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_table,
                        const at::Tensor& seq_lens) {
  const int64_t num_tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(parts.size() == 4, "decode_layer: parts of four projections");
  const Projections linear(weights, kinds, rows, limits, tile_limits, parts, gemm_dtype,
                           "decode_layer");
  rms_norm(hidden, residual, input_norm, eps, true);
  at::Tensor qkv = linear(hidden, 0, qkv_bias);
  at::Tensor key = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  const at::Tensor value =
      qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  at::Tensor query = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});
  if (qk_norm_kind == 1) {
    // Qwen3's per-head norms, as TorchOps.rms_norm_heads computes them (the same ATen ops in
    // the same order), then rotary on each result, as the Python layer does.
    auto head_norm = [&](const at::Tensor& x, const at::Tensor& weight) {
      return weight * (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps));
    };
    query = head_norm(query, *q_norm);
    key = head_norm(key, *k_norm);
    rotary(query, cos, sin);
    rotary(key, cos, sin);
  } else if (qk_norm_kind == 2) {
    // OLMoE's norms over the whole q and k projections: the norm kernel on a contiguous copy
    // (CpuKernelOps.rms_norm), then the heads' views, then rotary on each.
    auto full_norm = [&](const at::Tensor& x, const at::Tensor& weight, int64_t heads) {
      at::Tensor out = x.reshape({num_tokens, heads * head_dim}).clone();
      rms_norm(out, out, weight, eps, false);
      return out.view({num_tokens, heads, head_dim});
    };
    query = full_norm(query, *q_norm, num_heads);
    key = full_norm(key, *k_norm, num_kv_heads);
    rotary(query, cos, sin);
    rotary(key, cos, sin);
  } else {
    // Attention reads the rotated query where it lies, a view into qkv.
    rotary(qkv.narrow(1, 0, q_size + kv_size)
               .view({num_tokens, num_heads + num_kv_heads, head_dim}),
           cos, sin);
  }
  write_kv_cache(key, value, kv_cache, slot_mapping);
  const at::Tensor attn = paged_decode_attention(query, kv_cache.select(0, 0),
                                                 kv_cache.select(0, 1), block_table, seq_lens,
                                                 scale, window, /*softcap=*/0.0, bf16_attention);
  at::Tensor x = linear(attn.view({num_tokens, q_size}), 1, o_bias);
  // Granite scales each sublayer's output before its residual add (as the layer's forward).
  if (residual_multiplier != 1.0) x.mul_(residual_multiplier);
  rms_norm(x, residual, post_norm, eps, true);
  // No MLP parts: the caller runs the layer's feed-forward itself (a mixture of experts).
  if (parts[2] == 0 && parts[3] == 0) return x;
  const at::Tensor gate_up = linear(x, 2, gate_up_bias);
  at::Tensor out = linear(silu_and_mul(gate_up), 3, down_bias);
  if (residual_multiplier != 1.0) out.mul_(residual_multiplier);
  return out;
}

// A mixture-of-experts feed-forward over decode rows (SparseMoE in
// octavo/model/layers/moe.py, without a shared expert), as the same kernel and ATen calls in
// the same order as its Python forward, so the results are the same bit for bit: the
// router's logits, softmax in float32, top-k, renormalised if asked; one row runs its experts
// in ascending order (scale, then add); more rows are grouped by expert (a stable sort of
// the (row, choice) pairs), each expert runs once on its rows, and the scaled outputs are
// summed per row in that order. weights, kinds, rows, limits, tile_limits and gemm_dtype as for
// decode_layer; parts: the router's count, then each expert's gate_up and down.
at::Tensor moe_feed_forward(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                            at::IntArrayRef rows, at::IntArrayRef limits,
                            at::IntArrayRef tile_limits, at::IntArrayRef parts,
                            at::ScalarType gemm_dtype, int64_t top_k, bool renormalize) {
  const int64_t num_experts = (static_cast<int64_t>(parts.size()) - 1) / 2;
  TORCH_CHECK(num_experts > 0 && static_cast<int64_t>(parts.size()) == 1 + 2 * num_experts,
              "moe_feed_forward: parts of the router and of each expert's two projections");
  const Projections linear(weights, kinds, rows, limits, tile_limits, parts, gemm_dtype,
                           "moe_feed_forward");
  TORCH_CHECK(0 < top_k && top_k <= num_experts, "moe_feed_forward: top_k of ", num_experts);
  auto expert = [&](const at::Tensor& in, int64_t e) {
    return linear(silu_and_mul(linear(in, 1 + 2 * e)), 2 + 2 * e);
  };
  const at::Tensor probs = linear(x, 0).to(at::kFloat).softmax(-1);
  auto [chosen_weights, chosen] = probs.topk(top_k, -1);
  if (renormalize) chosen_weights = chosen_weights.div(chosen_weights.sum(-1, true));
  chosen_weights = chosen_weights.to(x.scalar_type());
  if (x.size(0) == 1) {
    std::vector<std::pair<int64_t, double>> order;
    const at::Tensor ids = chosen[0].contiguous(), scales = chosen_weights[0].to(at::kDouble);
    for (int64_t j = 0; j < top_k; ++j) {
      order.emplace_back(ids[j].item<int64_t>(), scales[j].item<double>());
    }
    std::sort(order.begin(), order.end());
    at::Tensor out;
    for (const auto& [e, scale] : order) {
      at::Tensor y = expert(x, e).mul_(scale);
      out = out.defined() ? out.add_(y) : y;
    }
    return out;
  }
  const at::Tensor choices = chosen.flatten();
  const at::Tensor order = at::argsort(choices, /*stable=*/true, 0, false);
  const at::Tensor tokens = order.div(top_k, "floor");
  const at::Tensor counts = at::bincount(choices, {}, num_experts).contiguous();
  const at::Tensor grouped = x.index_select(0, tokens);
  at::Tensor outputs = at::empty_like(grouped);
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t e = 0, start = 0; e < num_experts; ++e) {
    if (count[e] == 0) continue;
    outputs.narrow(0, start, count[e]).copy_(expert(grouped.narrow(0, start, count[e]), e));
    start += count[e];
  }
  outputs.mul_(chosen_weights.flatten().index_select(0, order).unsqueeze(1));
  return at::zeros_like(x).index_add_(0, tokens, outputs);
}

}  // namespace octavo
