// bfloat16 linear layers, y = x @ w.T (+ b), over one weight layout packed once at load: on Intel AMX tiles
// where the CPU has them, else with AVX512-BF16 dot products (Zen4, Cooper Lake).
//
// Why our own and not oneDNN's: oneDNN switches algorithms with the row count (measured: a row's result for
// M <= 32 differs bit for bit from the same row in an M >= 33 batch), so a request's greedy output would depend
// on what else is in the batch. Here every output element is the same sequence of tile dot products over K in
// the same order, whatever M and wherever the row sits, so the result is batch-invariant by construction; it
// also serves decode (one row) and prefill (hundreds) with one weight copy.
//
// Packed layout, [N/16, K/32, 16, 32] bfloat16: for output block nb and K block kb, a 16 x 64-byte tile whose
// row r holds, for each of the 16 output features n, the pair (w[n][32 kb + 2r], w[n][32 kb + 2r + 1]) -- the
// "VNNI" order the tile dot product reads B in. Inputs are read in whole 16-row tiles, the last one from a
// zero-padded copy (its padding rows are computed and discarded: a decode step is bound by reading the weight,
// not by tile arithmetic).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "tile_gemm.h"

// The bfloat16 kernel this build and process run on packed weights: "amx" (built for a CPU with AMX-BF16 and
// the OS granted the tile state), "avx512_bf16", or "" (none: packed bfloat16 weights are not used).
std::string bf16_kernel() {
#ifdef TOKENMILL_AMX
  if (request_amx()) return "amx";
#endif
#ifdef TOKENMILL_DPBF16
  return "avx512_bf16";
#else
  return "";
#endif
}

// w [N, K] bfloat16, N % 16 == 0, K % 32 == 0 -> [N/16, K/32, 16, 32] in the tile order described above.
at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack takes a [N, K] bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kTileN == 0 && K % kTileK == 0, "bf16_pack needs N % 16 == 0 and K % 32 == 0");
  // [N/16, 16 n, K/32, 16 r, 2 e] -> [N/16, K/32, 16 r, 16 n, 2 e]
  return w.contiguous().view({N / kTileN, kTileN, K / kTileK, kTileRows, 2}).permute({0, 2, 3, 1, 4})
      .contiguous().view({N / kTileN, K / kTileK, kTileRows, 2 * kTileN});
}

// Rows `ids` of a weight packed by bf16_pack (or int8_pack: the same tile order, one byte an element) as the
// [n, K] weight held them: a tied embedding's lookups read its LM head's tiles in one call (the torch indexing it
// replaces took ~0.13 ms of a decode step).
at::Tensor tile_rows(const at::Tensor& packed, const at::Tensor& ids) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == 2 * kTileN &&
                  packed.is_contiguous() && (packed.element_size() == 2 || packed.element_size() == 1),
              "tile_rows reads a weight packed by bf16_pack or int8_pack: [N/16, K/32, 16, 32]");
  const auto flat = ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t n = flat.numel(), KB = packed.size(1), N = packed.size(0) * kTileN, K = KB * kTileK;
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " of ", N);
  auto out = at::empty({n, K}, packed.options());
  const auto gather = [&](auto* dst, const auto* src) {
    for (int64_t i = 0; i < n; ++i, dst += K) {
      const auto* block = src + (id[i] / kTileN) * KB * kTileRows * 2 * kTileN + (id[i] % kTileN) * 2;
      for (int64_t kb = 0; kb < KB; ++kb)  // K 32 kb + 2r + e sits at [kb][r][n][e]
        for (int64_t r = 0; r < kTileRows; ++r) {
          const auto* pair = block + (kb * kTileRows + r) * 2 * kTileN;
          dst[kb * kTileK + 2 * r] = pair[0];
          dst[kb * kTileK + 2 * r + 1] = pair[1];
        }
    }
  };
  if (packed.element_size() == 2)
    gather(static_cast<uint16_t*>(out.data_ptr()), static_cast<const uint16_t*>(packed.data_ptr()));
  else
    gather(static_cast<uint8_t*>(out.data_ptr()), static_cast<const uint8_t*>(packed.data_ptr()));
  return out;
}

namespace {

struct Bf16Problem {
  at::Tensor y, bias_f;
  int64_t M, N, K, NB, KB;
  const float* bias = nullptr;
  const uint16_t* wp = nullptr;
  uint16_t* yp = nullptr;
};

// with_output: allocate y [M, N] (bf16_linear_silu writes its own, narrower output instead).
Bf16Problem setup(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  bool with_output = true) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "a weight packed by bf16_pack");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "[M, K] bfloat16 input");
  Bf16Problem p;
  p.NB = packed.size(0), p.KB = packed.size(1), p.N = p.NB * kTileN, p.K = p.KB * kTileK, p.M = x.size(0);
  TORCH_CHECK(x.size(1) == p.K, "input has ", x.size(1), " features, the weight ", p.K);
  if (with_output) p.y = at::empty({p.M, p.N}, x.options());
  if (bias.has_value()) {
    p.bias_f = bias->to(at::kFloat).contiguous();
    p.bias = p.bias_f.data_ptr<float>();
  }
  p.wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (with_output) p.yp = reinterpret_cast<uint16_t*>(p.y.data_ptr<at::BFloat16>());
  return p;
}

#ifdef TOKENMILL_DPBF16
// gemm_tiles' weight source for a bf16_pack'ed weight: its tiles, read in place.
auto packed_tiles(const Bf16Problem& p) {
  return [wp = p.wp, KB = p.KB](int64_t nb, uint16_t*, int64_t) {
    return ContiguousTiles{wp + nb * KB * kTileElems, KB};
  };
}
#endif

}  // namespace

// w [2I, K] bfloat16 (gate rows, then up rows: a fused gate/up projection), I % 16 == 0 -> [I/16, 2, K/32, 16, 32]:
// for each block of 16 features, its gate tiles then its up tiles in bf16_pack's layout, so one column pair of
// the tile kernel holds a feature block's gate and up and its epilogue can apply SiLU-and-multiply.
at::Tensor bf16_pack_gate_up(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % (2 * kTileN) == 0, "bf16_pack_gate_up takes [2I, K] with I % 16 == 0");
  const int64_t N = w.size(0), K = w.size(1), blocks = N / (2 * kTileN);
  const auto paired = w.contiguous().view({2, blocks, kTileN, K}).transpose(0, 1).reshape({N, K});
  return bf16_pack(paired).view({blocks, 2, K / kTileK, kTileRows, 2 * kTileN});
}

// x [M, K] bfloat16 (rows may be strided), packed from bf16_pack, bias [N] or none -> [M, N] bfloat16.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  Bf16Problem p = setup(x, packed, bias);
#ifdef TOKENMILL_AMX
  const auto epilogue = [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    write_rows(c, nullptr, p.bias, p.yp, p.N, m0, rows, nb * kTileN, two_cols ? 2 * kTileN : kTileN);
  };
  amx_tiles(x, p.K, p.NB, 0, packed_tiles(p), epilogue);
#else
  TORCH_CHECK(false, "this build has no AMX kernels (the CPU it was built for lacks AMX-BF16)");
#endif
  return p.y;
}

// silu(x @ gate.T) * (x @ up.T) from bf16_pack_gate_up's layout, on this CPU's kernel: [M, K] -> [M, I], bit for
// bit silu_mul(bf16_linear(x, bf16_pack(w))) without the [M, 2I] intermediate (its write and read back, and a pass).
at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == 2, "a weight packed by bf16_pack_gate_up");
  const int64_t blocks = packed.size(0);
  Bf16Problem p = setup(x, packed.view({2 * blocks, packed.size(2), packed.size(3), packed.size(4)}), c10::nullopt,
                        /*with_output=*/false);
  const int64_t I = blocks * kTileN;
  auto y = at::empty({p.M, I}, x.options());
#ifdef TOKENMILL_DPBF16
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto epilogue = [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool) {
    write_silu_rows(c, nullptr, nullptr, yp, I, m0, rows, (nb / 2) * kTileN);
  };
  gemm_tiles(x, p.K, p.NB, 0, packed_tiles(p), epilogue);
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernels (the CPU it was built for lacks them)");
#endif
  return y;
}

// The same product with AVX512-BF16 dot products (no AMX): same packed weight, same signature.
at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  Bf16Problem p = setup(x, packed, bias);
#ifdef TOKENMILL_DPBF16
  const auto epilogue = [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    write_rows(c, nullptr, p.bias, p.yp, p.N, m0, rows, nb * kTileN, two_cols ? 2 * kTileN : kTileN);
  };
  dp_tiles(x, p.K, p.NB, 0, packed_tiles(p), epilogue);
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernels (the CPU it was built for lacks them)");
#endif
  return p.y;
}

// The packed bfloat16 product on this machine's kernel (bf16_kernel()): one kernel for every row count, so
// a row's result never depends on the batch it is in.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const std::string kernel = bf16_kernel();
  if (kernel == "amx") return amx_linear(x, packed, bias);
  return dpbf16_linear(x, packed, bias);
}
