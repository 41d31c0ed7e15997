// The decode model's bodies (decode_stack.h): a decoder layer from its normed input to its MLP output
// (layer_to_mlp), every layer in one call (DecoderStack), the embedding lookup (RowLookup) and the greedy decode
// steps (DecodeModel), each the same kernel calls in the same order as the Python step makes them.
#include "decode_stack.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"

void LoRAProjection::add(at::Tensor& y, const at::Tensor& x, const at::Tensor& runs, int64_t matmul_rows) const {
  if (!as.empty() && runs.size(0) > 0) lora_add(y, x, as, bs, col0s, ranks, runs, matmul_rows);
}

namespace {

// A decoder layer, for a batch whose tokens all read their context from the cache (decodes and later prefill
// chunks), from its normed input xn to its MLP output, with the attention's residual added to x in place (the MLP's
// is left to the caller). `w` holds input_norm, qkv weight, qkv bias (or an empty tensor), o_proj, post_norm,
// gate_up, down, then the packed copies of qkv, o_proj, gate_up and down (or empty tensors), then their
// per-feature scales (int8 weights; else empty tensors).
at::Tensor layer_to_mlp(at::Tensor x, const at::Tensor& xn, const std::vector<at::Tensor>& w, int64_t num_heads,
                        int64_t num_kv_heads, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& q_rows, const at::Tensor& kv_lens,
                        const LayerLoRA* lora, const at::Tensor& lora_runs, int64_t lora_matmul_rows) {
  const int64_t T = x.size(0), D = k_cache.size(3);
  c10::optional<at::Tensor> qkv_bias;
  if (w[2].numel() > 0) qkv_bias = w[2];
  auto qkv = linear_any(xn, w[1], w[7], w[11], qkv_bias);
  if (lora) (*lora)[0].add(qkv, xn, lora_runs, lora_matmul_rows);
  rotary_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping);
  // q's heads in place (one token: already contiguous), one view instead of narrow + contiguous + view
  auto q = qkv.as_strided({T, num_heads, D}, {qkv.stride(0), D, 1});
  if (T > 1) q = q.contiguous();
  auto attn = paged_attention(q, k_cache, v_cache, block_tables, q_rows, kv_lens, 1.0 / std::sqrt(double(D)));
  auto attn_rows = attn.view({T, num_heads * D});
  auto h = linear_any(attn_rows, w[3], w[8], w[12], c10::nullopt);
  if (lora) (*lora)[1].add(h, attn_rows, lora_runs, lora_matmul_rows);
  auto normed = add_rms_norm(h, x, w[4], eps);
  at::Tensor act;
  if (lora && !(*lora)[2].as.empty()) {  // the adapter changes gate and up before SiLU (gate_up packed plain)
    auto gate_up = linear_any(normed, w[5], w[9], w[13], c10::nullopt);
    (*lora)[2].add(gate_up, normed, lora_runs, lora_matmul_rows);
    act = silu_mul(gate_up);
  } else {
    act = gate_up_silu(normed, w[5], w[9], w[13]);
  }
  auto out = linear_any(act, w[6], w[10], w[14], c10::nullopt);
  if (lora) (*lora)[3].add(out, act, lora_runs, lora_matmul_rows);
  return out;
}

}  // namespace

DecoderStack::DecoderStack(std::vector<std::vector<at::Tensor>> layers) : layers_(std::move(layers)) {
  for (const auto& w : layers_) TORCH_CHECK(w.size() == 15, "a decoder layer takes 15 weight tensors");
}

void DecoderStack::set_lora(const std::vector<std::vector<std::vector<at::Tensor>>>& as,
                            const std::vector<std::vector<std::vector<at::Tensor>>>& bs,
                            const std::vector<std::vector<std::vector<at::Tensor>>>& ranks,
                            const std::vector<std::vector<std::vector<int64_t>>>& col0s, int64_t matmul_rows) {
  TORCH_CHECK(as.size() == layers_.size() && bs.size() == as.size() && ranks.size() == as.size() &&
                  col0s.size() == as.size(), "LoRA slots for every layer");
  lora_.assign(as.size(), LayerLoRA(4));
  for (size_t i = 0; i < as.size(); ++i) {
    TORCH_CHECK(as[i].size() == 4 && bs[i].size() == 4 && ranks[i].size() == 4 && col0s[i].size() == 4,
                "a layer's LoRA slots: qkv, o, gate_up, down");
    for (size_t j = 0; j < 4; ++j) lora_[i][j] = LoRAProjection{as[i][j], bs[i][j], ranks[i][j], col0s[i][j]};
  }
  lora_matmul_rows_ = matmul_rows;
}

void DecoderStack::run(at::Tensor x, int64_t num_heads, int64_t num_kv_heads, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                       const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                       const at::Tensor& block_tables, const at::Tensor& q_rows, const at::Tensor& kv_lens,
                       const c10::optional<at::Tensor>& lora_runs) const {
  const bool lora = lora_runs.has_value() && lora_runs->size(0) > 0;
  TORCH_CHECK(!lora || has_lora(), "LoRA runs given to a stack without LoRA slots");
  const at::Tensor runs = lora ? *lora_runs : at::Tensor();
  const size_t n = layers_.size();
  TORCH_CHECK(k_caches.size() == n && v_caches.size() == n, "one K and one V cache per layer");
  if (n == 0) return;
  at::Tensor xn = rms_norm(x, layers_[0][0], eps);
  for (size_t i = 0; i < n; ++i) {
    auto mlp = layer_to_mlp(x, xn, layers_[i], num_heads, num_kv_heads, eps, cos, sin, k_caches[i], v_caches[i],
                            slot_mapping, block_tables, q_rows, kv_lens, lora ? &lora_[i] : nullptr, runs,
                            lora_matmul_rows_);
    if (i + 1 < n) xn = add_rms_norm(mlp, x, layers_[i + 1][0], eps);  // x += mlp; the next layer's input norm
    else x.add_(mlp);
  }
}

RowLookup::RowLookup(std::string kind, at::Tensor table, at::Tensor sources, at::Tensor flip, int64_t ggml_type,
                     at::Tensor scale, at::Tensor like)
    : kind_(std::move(kind)), table_(std::move(table)), sources_(std::move(sources)), flip_(std::move(flip)),
      type_(ggml_type), scale_(std::move(scale)), dtype_(like.scalar_type()) {
  TORCH_CHECK(kind_ == "dense" || kind_ == "tiles" || kind_ == "int8" || kind_ == "gguf",
              "row lookup kinds: dense, tiles, int8, gguf; not ", kind_);
}

at::Tensor RowLookup::rows(const at::Tensor& ids) const {
  if (kind_ == "dense") return table_.index_select(0, ids);
  if (kind_ == "tiles") return tile_rows(table_, ids);
  if (kind_ == "int8") {
    auto q = tile_rows(table_, ids).bitwise_xor(0x80).view(at::kChar);
    return q.to(at::kFloat).mul(scale_.index_select(0, ids).unsqueeze(-1)).to(dtype_);
  }
  const int64_t n = ids.numel();
  auto raw = gather_tile_bytes(table_, ids, sources_, flip_).reshape({n, -1});
  auto out = at::empty({n, table_.size(1) * 32}, at::TensorOptions().dtype(dtype_));
  gguf_decode_rows(raw, type_, out);
  return out;
}

DecodeModel::DecodeModel(const DecoderStack& stack, const RowLookup& embed, at::Tensor norm, double eps,
                         at::Tensor head_w, at::Tensor head_packed, at::Tensor head_scale, at::Tensor head_bias,
                         at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t num_kv_heads)
    : stack_(stack), embed_(embed), norm_(std::move(norm)), eps_(eps), head_w_(std::move(head_w)),
      head_packed_(std::move(head_packed)), head_scale_(std::move(head_scale)), head_bias_(std::move(head_bias)),
      cos_(std::move(cos)), sin_(std::move(sin)), num_heads_(num_heads), num_kv_heads_(num_kv_heads) {
  TORCH_CHECK(cos_.dim() == 2 && sin_.sizes() == cos_.sizes(), "rotary tables: [positions, head_dim]");
}

at::Tensor DecodeModel::logits(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& block_tables,
                               const std::vector<at::Tensor>& k_caches,
                               const std::vector<at::Tensor>& v_caches) const {
  const int64_t B = ids.numel();
  TORCH_CHECK(!k_caches.empty() && positions.numel() == B && block_tables.dim() == 2 && block_tables.size(0) == B,
              "one position and one block table row per id");
  TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  block_tables.scalar_type() == at::kLong, "int64 ids, positions and block tables");
  const auto tables = block_tables.contiguous();
  const auto pos = positions.contiguous();
  const int64_t bs = k_caches[0].size(1), M = tables.size(1), P = cos_.size(0);
  auto slots = at::empty({B}, ids.options()), kv_lens = at::empty({B}, ids.options());
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] < P && p[b] / bs < M, "position ", p[b], " past the tables");
    slots.data_ptr<int64_t>()[b] = bt[b * M + p[b] / bs] * bs + p[b] % bs;
    kv_lens.data_ptr<int64_t>()[b] = p[b] + 1;
  }
  auto x = embed_.rows(ids).contiguous();
  stack_.run(x, num_heads_, num_kv_heads_, eps_, cos_.index_select(0, pos), sin_.index_select(0, pos), k_caches,
             v_caches, slots, tables, at::arange(B, ids.options()), kv_lens);
  c10::optional<at::Tensor> bias;
  if (head_bias_.numel() > 0) bias = head_bias_;
  return linear_any(rms_norm(x, norm_, eps_), head_w_, head_packed_, head_scale_, bias).to(at::kFloat).contiguous();
}

at::Tensor DecodeModel::run(at::Tensor ids, at::Tensor positions, const at::Tensor& block_tables,
                            const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                            int64_t steps, const at::Tensor& stop_ids) const {
  const int64_t B = ids.numel();
  TORCH_CHECK(stop_ids.dim() == 2 && stop_ids.size(0) == B && stop_ids.scalar_type() == at::kLong,
              "one int64 row of stop ids per id");
  const auto stops = stop_ids.contiguous();
  const int64_t S = stops.size(1);
  positions = positions.contiguous().clone();
  auto out = at::empty({steps, B}, ids.options());
  std::vector<char> ended(B, 0);
  int64_t done = 0;
  while (done < steps) {
    ids = first_argmax(logits(ids, positions, block_tables, k_caches, v_caches));
    out[done].copy_(ids);
    ++done;
    const int64_t* tok = ids.data_ptr<int64_t>();
    const int64_t* st = stops.data_ptr<int64_t>();
    int64_t* pos = positions.data_ptr<int64_t>();
    bool all = true;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < S && !ended[b]; ++k) ended[b] = st[b * S + k] == tok[b];
      all = all && ended[b];
      ++pos[b];
    }
    if (all) break;
  }
  return out.narrow(0, 0, done);
}
