// Grouped low-rank update of LoRA adapters (model/lora.py): for each run of rows through one adapter slot,
//   y[rows, col0 : col0 + out] += (x[rows] A_s^T) B_s        A_s [r, in], B_s [r, out] (the slot's first r rows)
// for every part of a fused projection (q, k, v or gate, up) in one call. A decode step has a few rows per adapter:
// each row is done here in float32 (r dot products over `in`, then r AXPYs over `out`), so the Python per run and
// per part that a matmul each would cost is gone and each adapter's weights are read once per row from cache. A run
// of more than `matmul_rows` rows (a prompt's chunk) may go to two matmuls instead, where a BLAS kernel beats the row
// loop; 0 keeps every row on the loop, whose result for a row depends on nothing else in the step (batch-invariant).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/matmul.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGrainJobs = 64;

template <typename T>
void row_update(const T* x, T* y, const T* a, const T* b, int64_t in, int64_t out, int64_t rank, float* xa,
                float* acc) {
  for (int64_t k = 0; k < rank; ++k) {
    const T* ak = a + k * in;
    float s = 0.f;
    for (int64_t i = 0; i < in; ++i) s += static_cast<float>(x[i]) * static_cast<float>(ak[i]);
    xa[k] = s;
  }
  for (int64_t o = 0; o < out; ++o) acc[o] = 0.f;
  for (int64_t k = 0; k < rank; ++k) {
    const T* bk = b + k * out;
    const float c = xa[k];
    for (int64_t o = 0; o < out; ++o) acc[o] += c * static_cast<float>(bk[o]);
  }
  for (int64_t o = 0; o < out; ++o) y[o] = static_cast<T>(static_cast<float>(y[o]) + acc[o]);
}

template <typename T>
void rows_update(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& as,
                 const std::vector<at::Tensor>& bs, const std::vector<int64_t>& col0s,
                 const std::vector<at::Tensor>& ranks, const std::vector<int64_t>& rows,
                 const std::vector<int64_t>& row_slots) {
  const int64_t in = x.size(1), y_stride = y.stride(0), x_stride = x.stride(0);
  const int64_t n = static_cast<int64_t>(rows.size()), parts = static_cast<int64_t>(as.size());
  int64_t widest = 0, max_rank = 0;
  for (int64_t p = 0; p < parts; ++p) {
    widest = std::max(widest, bs[p].size(2));
    max_rank = std::max(max_rank, as[p].size(1));
  }
  // (row, part) pairs over the threads, kGrainJobs at least each: a job is a microsecond or two, so a decode step's
  // few dozen stay on one thread rather than pay for waking the others
  at::parallel_for(0, n * parts, kGrainJobs, [&](int64_t begin, int64_t end) {
    std::vector<float> xa(max_rank), acc(widest);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / parts, p = job % parts, slot = row_slots[i];
      const int64_t rank = ranks[p].data_ptr<int64_t>()[slot];
      if (rank == 0) continue;
      const at::Tensor& a = as[p];
      const at::Tensor& b = bs[p];
      const int64_t out = b.size(2);
      row_update<T>(x.data_ptr<T>() + rows[i] * x_stride, y.data_ptr<T>() + rows[i] * y_stride + col0s[p],
                    a.data_ptr<T>() + slot * a.stride(0), b.data_ptr<T>() + slot * b.stride(0), in, out, rank,
                    xa.data(), acc.data());
    }
  });
}

}  // namespace

// y [T, N] += the adapters' updates; runs [n, 3] int64 (first row, end row, slot); per part p: as[p] [S, R, in],
// bs[p] [S, R, out_p] (x's dtype, contiguous), its columns from col0s[p], and ranks[p] [S] int64 (0: the slot's
// adapter leaves the part alone). Runs longer than matmul_rows (> 0) take two matmuls.
void lora_add(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& as,
              const std::vector<at::Tensor>& bs, const std::vector<int64_t>& col0s,
              const std::vector<at::Tensor>& ranks, const at::Tensor& runs, int64_t matmul_rows) {
  if (runs.size(0) == 0 || as.empty()) return;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x [T, in] and y [T, N]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add: rows of x and y must be contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add: x and y in one dtype");
  TORCH_CHECK(as.size() == bs.size() && as.size() == col0s.size() && as.size() == ranks.size(),
              "lora_add: one A, B, column offset and rank list per part");
  for (size_t p = 0; p < as.size(); ++p) {
    TORCH_CHECK(as[p].is_contiguous() && bs[p].is_contiguous() && as[p].scalar_type() == x.scalar_type() &&
                    bs[p].scalar_type() == x.scalar_type() && as[p].size(2) == x.size(1) &&
                    col0s[p] + bs[p].size(2) <= y.size(1) && ranks[p].scalar_type() == at::kLong &&
                    ranks[p].is_contiguous() && ranks[p].numel() == as[p].size(0),
                "lora_add: part ", p, "'s A [S, R, in] / B [S, R, out] do not fit x and y");
  }
  auto r = runs.accessor<int64_t, 2>();
  std::vector<int64_t> rows, row_slots;
  for (int64_t j = 0; j < runs.size(0); ++j) {
    const int64_t start = r[j][0], end = r[j][1], slot = r[j][2];
    TORCH_CHECK(0 <= start && start <= end && end <= x.size(0) && 0 <= slot && slot < as[0].size(0),
                "lora_add: run ", j, " out of range");
    if (matmul_rows > 0 && end - start > matmul_rows) {
      for (size_t p = 0; p < as.size(); ++p) {
        const int64_t rank = ranks[p].data_ptr<int64_t>()[slot];
        if (rank == 0) continue;
        auto a = as[p][slot].narrow(0, 0, rank), b = bs[p][slot].narrow(0, 0, rank);
        auto rows_y = y.narrow(0, start, end - start).narrow(1, col0s[p], b.size(1));
        rows_y.addmm_(at::matmul(x.narrow(0, start, end - start), a.t()), b);
      }
      continue;
    }
    for (int64_t i = start; i < end; ++i) {
      rows.push_back(i);
      row_slots.push_back(slot);
    }
  }
  if (rows.empty()) return;
  if (x.scalar_type() == at::kFloat) {
    rows_update<float>(y, x, as, bs, col0s, ranks, rows, row_slots);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: float32 or bfloat16");
    rows_update<c10::BFloat16>(y, x, as, bs, col0s, ranks, rows, row_slots);
  }
}
