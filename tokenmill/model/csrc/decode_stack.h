// The decode model in C++: every decoder layer in one call a step (DecoderStack), the embedding lookup
// (RowLookup) and the whole model for greedy decode steps (DecodeModel). Declared here for bindings.cpp; their
// bodies, composed of the kernels of kernels.h, are in decode_stack.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

// One projection's LoRA slots as model/lora.py's LoRASlots holds them (per part: A, B, ranks, first column); no
// parts: no adapter there. Their tensors are the slots' own, so refilled slots are seen without a new stack.
struct LoRAProjection {
  std::vector<at::Tensor> as, bs, ranks;
  std::vector<int64_t> col0s;
  void add(at::Tensor& y, const at::Tensor& x, const at::Tensor& runs, int64_t matmul_rows) const;
};
using LayerLoRA = std::vector<LoRAProjection>;  // qkv_proj, o_proj, gate_up_proj, down_proj

// Every decoder layer of a model (each layer's weights as layer_to_mlp takes them), held once and run in one call
// a step, composed of the kernels above: Python crosses into C++ once a step instead of once a layer (or once an
// op), and each layer's residual add joins the next layer's input norm in one pass (add_rms_norm rounds the sum as
// the add does, then normalises it: the same bits as the add, then the norm). In a one-stream decode step on Zen 4
// the small ops between matmuls took ~3 us each (their code and data cold after the weights streamed through the
// caches).
class DecoderStack {
 public:
  explicit DecoderStack(std::vector<std::vector<at::Tensor>> layers);
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // LoRA slots per layer and projection (qkv, o, gate_up, down), per part: A, B, ranks (model/lora.py LoRASlots)
  // and first columns; a projection without parts has no adapters.
  void set_lora(const std::vector<std::vector<std::vector<at::Tensor>>>& as,
                const std::vector<std::vector<std::vector<at::Tensor>>>& bs,
                const std::vector<std::vector<std::vector<at::Tensor>>>& ranks,
                const std::vector<std::vector<std::vector<int64_t>>>& col0s, int64_t matmul_rows);
  bool has_lora() const { return !lora_.empty(); }
  // x [T, hidden] updated in place through every layer; k_caches / v_caches one per layer; lora_runs [n, 3] (first
  // row, end row, slot) of rows through LoRA slots (set_lora), or empty.
  void run(at::Tensor x, int64_t num_heads, int64_t num_kv_heads, double eps, const at::Tensor& cos,
           const at::Tensor& sin, const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
           const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& q_rows,
           const at::Tensor& kv_lens, const c10::optional<at::Tensor>& lora_runs = c10::nullopt) const;

 private:
  std::vector<std::vector<at::Tensor>> layers_;
  std::vector<LayerLoRA> lora_;
  int64_t lora_matmul_rows_ = 0;
};

// Token ids -> embedding rows, as the model's VocabEmbedding looks them up on this backend (backends/cpu.py says
// which kind): "dense" a plain table, "tiles" rows of a bfloat16 tile-packed tied head (tile_rows), "int8" rows of
// an int8 tile-packed tied head times its per-row scales, "gguf" GGML block rows of a tied head packed by gguf_pack
// (gather_tile_bytes with model/backends/gguf_tiles.py's byte sources, then gguf_decode_rows), each the same ops in the same
// order as the Python lookup, so the rows are the same bits.
class RowLookup {
 public:
  RowLookup(std::string kind, at::Tensor table, at::Tensor sources, at::Tensor flip, int64_t ggml_type,
            at::Tensor scale, at::Tensor like);
  at::Tensor rows(const at::Tensor& ids) const;

 private:
  std::string kind_;
  at::Tensor table_, sources_, flip_;
  int64_t type_;
  at::Tensor scale_;
  at::ScalarType dtype_;
};

// The whole model for decode steps: a step in one call (`logits`: embedding rows, the rotary rows of each position,
// every layer (DecoderStack), the final norm, the LM head through linear_any, the kernel the Python head picks for
// the same packed copy), and greedy decode for up to `steps` tokens in one call (`run`: each step's first argmax fed
// back as the next input). The same calls the Python step makes, so the same logits and tokens; what goes is a
// step's Python (~0.3 ms of a 4 ms one-stream step on Zen 4, its code and data cold after the weights streamed
// through the caches).
class DecodeModel {
 public:
  DecodeModel(const DecoderStack& stack, const RowLookup& embed, at::Tensor norm, double eps, at::Tensor head_w,
                at::Tensor head_packed, at::Tensor head_scale, at::Tensor head_bias, at::Tensor cos, at::Tensor sin,
                int64_t num_heads, int64_t num_kv_heads);
  // One decode step: ids [B] at positions [B] through the model, their K/V written to the slots block_tables [B,
  // blocks] give them; -> float32 logits [B, V], as compute_logits gives them.
  at::Tensor logits(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& block_tables,
                    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches) const;

  // Up to `steps` greedy steps: each step's first argmax fed back as the next input, a row ending when its token is
  // one of its stop_ids [B, S] (-1 pads), the run when every row has. Returns the tokens [steps run, B].
  at::Tensor run(at::Tensor ids, at::Tensor positions, const at::Tensor& block_tables,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, int64_t steps,
                 const at::Tensor& stop_ids) const;

 private:
  const DecoderStack& stack_;
  const RowLookup& embed_;
  at::Tensor norm_;
  double eps_;
  at::Tensor head_w_, head_packed_, head_scale_, head_bias_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_;
};
