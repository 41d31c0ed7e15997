// A mixture of experts' MLP over a step's tokens in one call (model/moe.py, Backend.moe_experts): the tokens are
// grouped by expert, each expert's gate/up and down weights read once for all of its tokens through the same
// linear kernels as every other layer (bfloat16 tiles, int8, FP8, kept GGUF blocks: linear_any / gate_up_silu),
// and each token's k products summed in float32 in its own top-k order.
//
// Why in C++: a decode step runs k small experts a layer (OLMoE: 8 of 64, 12 MB each in bfloat16). From Python
// each expert cost two kernel calls, each its own parallel region whose start and ragged end left a core idle, plus
// the indexing around them. Here, while no expert has more than kExpertsOverThreads tokens, the experts themselves
// are spread over the threads (each expert's matmuls on one thread, one region for the layer); with more tokens an
// expert's matmuls are big enough to split, and the experts run one after another, each over all threads. Which
// thread computes a product never changes it, so a token's output is the same bits alone or in any batch.
#include <ATen/ATen.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "work_split.h"

namespace {
constexpr int64_t kExpertsOverThreads = 4;
}  // namespace

// x [T, H]; ids [T, k] (int64, global expert numbers: expert `first + i` is the i-th of the lists; others add
// nothing); weights [T, k] float32. Per local expert: its fused gate/up weight, packed copy and scales (empty where
// none), and its down projection's. -> [T, H] in x's dtype.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, int64_t first,
                       const std::vector<at::Tensor>& gate_up_w, const std::vector<at::Tensor>& gate_up_packed,
                       const std::vector<at::Tensor>& gate_up_scale, const std::vector<at::Tensor>& down_w,
                       const std::vector<at::Tensor>& down_packed, const std::vector<at::Tensor>& down_scale) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(),
              "moe_experts takes x [T, H], ids and weights [T, k]");
  const int64_t E = static_cast<int64_t>(gate_up_w.size());
  TORCH_CHECK(gate_up_packed.size() == static_cast<size_t>(E) && gate_up_scale.size() == static_cast<size_t>(E) &&
                  down_w.size() == static_cast<size_t>(E) && down_packed.size() == static_cast<size_t>(E) &&
                  down_scale.size() == static_cast<size_t>(E),
              "one gate/up and one down projection per expert");
  const int64_t T = ids.size(0), k = ids.size(1), H = x.size(1);
  const auto id = ids.to(at::kLong).contiguous();
  const int64_t* idp = id.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> slots(E);  // each expert's (token, j) slots, token-major
  for (int64_t s = 0; s < T * k; ++s) {
    const int64_t e = idp[s] - first;
    if (e >= 0 && e < E) slots[e].push_back(s);
  }
  std::vector<int64_t> hit;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e)
    if (!slots[e].empty()) {
      hit.push_back(e);
      most = std::max<int64_t>(most, slots[e].size());
    }
  auto products = at::zeros({T * k, H}, x.options());
  const auto xc = x.contiguous();
  const int64_t row_bytes = H * x.element_size();
  const auto run = [&](int64_t e) {
    const auto& s = slots[e];
    const int64_t n = static_cast<int64_t>(s.size());
    auto xe = at::empty({n, H}, x.options());
    auto* dst = static_cast<char*>(xe.data_ptr());
    const auto* src = static_cast<const char*>(xc.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes, src + (s[i] / k) * row_bytes, row_bytes);
    const auto h = gate_up_silu(xe, gate_up_w[e], gate_up_packed[e], gate_up_scale[e]);
    const auto y = linear_any(h, down_w[e], down_packed[e], down_scale[e], c10::nullopt).contiguous();
    auto* out = static_cast<char*>(products.data_ptr());
    const auto* yp = static_cast<const char*>(y.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + s[i] * row_bytes, yp + i * row_bytes, row_bytes);
  };
  if (most <= kExpertsOverThreads && hit.size() > 1) {
    parallel_take(static_cast<int64_t>(hit.size()), 1, [&](WorkQueue& queue) {
      int64_t begin, end;
      while (queue.take(begin, end))
        for (int64_t i = begin; i < end; ++i) run(hit[i]);
    });
  } else {
    for (const int64_t e : hit) run(e);
  }
  return (products.view({T, k, H}).to(at::kFloat) * weights.to(at::kFloat).unsqueeze(-1)).sum(1).to(x.scalar_type());
}
