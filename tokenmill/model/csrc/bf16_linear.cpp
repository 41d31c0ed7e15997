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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512BF16__)
#define TOKENMILL_DPBF16 1
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TOKENMILL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"
#endif

namespace {

constexpr int64_t kTileRows = 16;   // rows of A and C tiles; K pairs of a B tile
constexpr int64_t kTileK = 32;      // bfloat16 elements of K per tile dot product
constexpr int64_t kTileN = 16;      // output features per C tile

#ifdef TOKENMILL_AMX
// Linux hands out the AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Tiles 0-1: A (two 16-row blocks of x), 2-3: B (two 16-feature blocks of w), 4-7: C = A_i x B_j.
void configure_tiles() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// C tiles of output rows [m0, m0 + 16 * row_blocks) and features [16 nb, 16 nb + 16 * col_blocks), stored as
// float32 into c [32, 32] (row stride 32 floats).
template <int RowBlocks, int ColBlocks>
void tile_block(const uint16_t* a0, int64_t a0_stride, const uint16_t* a1, int64_t a1_stride, const uint16_t* wp,
                int64_t KB, int64_t nb, float* c) {
  _tile_zero(4);
  if constexpr (ColBlocks > 1) _tile_zero(5);
  if constexpr (RowBlocks > 1) _tile_zero(6);
  if constexpr (RowBlocks > 1 && ColBlocks > 1) _tile_zero(7);
  const int64_t tile_elems = kTileRows * kTileK;
  const uint16_t* b0 = wp + nb * KB * tile_elems;
  const uint16_t* b1 = b0 + KB * tile_elems;
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(0, a0 + kb * kTileK, a0_stride);
    if constexpr (RowBlocks > 1) _tile_loadd(1, a1 + kb * kTileK, a1_stride);
    _tile_loadd(2, b0 + kb * tile_elems, 64);
    if constexpr (ColBlocks > 1) _tile_loadd(3, b1 + kb * tile_elems, 64);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (ColBlocks > 1) _tile_dpbf16ps(5, 0, 3);
    if constexpr (RowBlocks > 1) _tile_dpbf16ps(6, 1, 2);
    if constexpr (RowBlocks > 1 && ColBlocks > 1) _tile_dpbf16ps(7, 1, 3);
  }
  constexpr int64_t ld = 32 * sizeof(float);
  _tile_stored(4, c, ld);
  if constexpr (ColBlocks > 1) _tile_stored(5, c + 16, ld);
  if constexpr (RowBlocks > 1) _tile_stored(6, c + 16 * 32, ld);
  if constexpr (RowBlocks > 1 && ColBlocks > 1) _tile_stored(7, c + 16 * 32 + 16, ld);
}

#endif

#ifdef TOKENMILL_DPBF16
// 16 float32 results (+ bias, in float32) rounded to bfloat16 (nearest-even, as torch rounds) at y.
inline void store_bf16(__m512 v, const float* bias, uint16_t* y) {
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// Rows [m0, m0 + Rows) x features [16 nb, 16 nb + 16 Cols) with AVX512-BF16: for each K pair, the pair of x
// broadcast against a packed tile row (the same pair for 16 features) -- the VNNI layout serves this kernel
// too. Every output element sums its K pairs in one fixed order, whatever the row count: batch-invariant.
template <int Rows, int Cols>
void dp_block(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t KB, int64_t m0, int64_t nb,
              const float* bias, uint16_t* y, int64_t N) {
  __m512 acc[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t tile_elems = kTileRows * kTileK;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* b = wp + (nb * KB + kb) * tile_elems;
    for (int64_t rr = 0; rr < kTileRows; ++rr) {
      __m512i bv[Cols];
      for (int c = 0; c < Cols; ++c) bv[c] = _mm512_loadu_si512(b + c * KB * tile_elems + rr * 2 * kTileN);
      for (int r = 0; r < Rows; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + (m0 + r) * K + kb * kTileK + 2 * rr, sizeof(pair));
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)bv[c]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      store_bf16(acc[r][c], bias == nullptr ? nullptr : bias + (nb + c) * kTileN, y + (m0 + r) * N + (nb + c) * kTileN);
}

template <int Cols>
void dp_rows(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t KB, int64_t M, int64_t nb, const float* bias,
             uint16_t* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dp_block<4, Cols>(x, K, wp, KB, m, nb, bias, y, N);
  switch (M - m) {
    case 3: dp_block<3, Cols>(x, K, wp, KB, m, nb, bias, y, N); break;
    case 2: dp_block<2, Cols>(x, K, wp, KB, m, nb, bias, y, N); break;
    case 1: dp_block<1, Cols>(x, K, wp, KB, m, nb, bias, y, N); break;
    default: break;
  }
}
#endif

#ifdef TOKENMILL_AMX
// float32 tile results (+ bias, in float32) rounded to bfloat16 (nearest-even, as torch rounds) into y.
void write_rows(const float* c, const float* bias, uint16_t* y, int64_t N, int64_t m0, int64_t rows, int64_t n0,
                int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; j += 16) {
      store_bf16(_mm512_loadu_ps(c + r * 32 + j), bias == nullptr ? nullptr : bias + n0 + j, y + (m0 + r) * N + n0 + j);
    }
  }
}

// The SiLU-and-multiply epilogue of a gate/up column pair (gate features in c's columns 0-15, up's in 16-31, see
// bf16_pack_gate_up): each rounded to bfloat16 as a bfloat16 matmul's output is, then silu(gate) * up exactly as
// silu_mul (cpu_kernels.cpp) computes it from those bfloat16 values, into y [M, I] at columns [n0, n0 + 16).
void write_silu_rows(const float* c, uint16_t* y, int64_t I, int64_t m0, int64_t rows, int64_t n0) {
  const __m512 one = _mm512_set1_ps(1.f), cap = _mm512_set1_ps(88.f);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 g = round_to_bf16_ps512(_mm512_loadu_ps(c + r * 32));
    const __m512 u = round_to_bf16_ps512(_mm512_loadu_ps(c + r * 32 + 16));
    const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), cap));
    const __m512 silu = round_to_bf16_ps512(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    store_bf16x16(y + (m0 + r) * I + n0, round_to_bf16_ps512(_mm512_mul_ps(silu, u)));
  }
}
#endif

}  // namespace

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
torch::Tensor bf16_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack takes a [N, K] bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kTileN == 0 && K % kTileK == 0, "bf16_pack needs N % 16 == 0 and K % 32 == 0");
  // [N/16, 16 n, K/32, 16 r, 2 e] -> [N/16, K/32, 16 r, 16 n, 2 e]
  return w.contiguous().view({N / kTileN, kTileN, K / kTileK, kTileRows, 2}).permute({0, 2, 3, 1, 4})
      .contiguous().view({N / kTileN, K / kTileK, kTileRows, 2 * kTileN});
}

namespace {

struct Bf16Problem {
  torch::Tensor y, bias_f;
  int64_t M, N, K, NB, KB;
  const float* bias = nullptr;
  const uint16_t* wp = nullptr;
  uint16_t* yp = nullptr;
};

// with_output: allocate y [M, N] (amx_linear_silu writes its own, narrower output instead).
Bf16Problem setup(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                  bool with_output = true) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "a weight packed by bf16_pack");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "[M, K] bfloat16 input");
  Bf16Problem p;
  p.NB = packed.size(0), p.KB = packed.size(1), p.N = p.NB * kTileN, p.K = p.KB * kTileK, p.M = x.size(0);
  TORCH_CHECK(x.size(1) == p.K, "input has ", x.size(1), " features, the weight ", p.K);
  if (with_output) p.y = torch::empty({p.M, p.N}, x.options());
  if (bias.has_value()) {
    p.bias_f = bias->to(at::kFloat).contiguous();
    p.bias = p.bias_f.data_ptr<float>();
  }
  p.wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (with_output) p.yp = reinterpret_cast<uint16_t*>(p.y.data_ptr<at::BFloat16>());
  return p;
}

// Work items are 32-feature column blocks (the last may be 16 wide), a few per thread.
template <typename F>
void for_column_pairs(int64_t NB, const F& body) {
  const int64_t pairs = (NB + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, pairs / (4 * at::get_num_threads()));
  at::parallel_for(0, pairs, grain, body);
}

}  // namespace

// w [2I, K] bfloat16 (gate rows, then up rows: a fused gate/up projection), I % 16 == 0 -> [I/16, 2, K/32, 16, 32]:
// for each block of 16 features, its gate tiles then its up tiles in bf16_pack's layout, so one column pair of
// the tile kernel holds a feature block's gate and up and its epilogue can apply SiLU-and-multiply.
torch::Tensor bf16_pack_gate_up(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % (2 * kTileN) == 0, "bf16_pack_gate_up takes [2I, K] with I % 16 == 0");
  const int64_t N = w.size(0), K = w.size(1), blocks = N / (2 * kTileN);
  const auto paired = w.contiguous().view({2, blocks, kTileN, K}).transpose(0, 1).reshape({N, K});
  return bf16_pack(paired).view({blocks, 2, K / kTileK, kTileRows, 2 * kTileN});
}

// x [M, K] bfloat16 (rows may be strided), packed from bf16_pack, bias [N] or none -> [M, N] bfloat16.
#ifdef TOKENMILL_AMX
namespace {

// The AMX tile loop over x [M, K] and a packed weight (p.wp, p.NB x p.KB tiles): for each 32-feature column pair
// and 32-row block, the float32 results c [32 x 32] go to `epilogue(c, m0, rows, nb, two_cols)`.
template <typename Epilogue>
void amx_tiles(const torch::Tensor& x, const Bf16Problem& p, const Epilogue& epilogue) {
  TORCH_CHECK(request_amx(), "the OS did not grant the AMX tile state");
  if (p.M == 0) return;
  // Whole 16-row tiles load straight from x; a last partial tile from a zero-padded copy of its rows.
  const int64_t Mpad = (p.M + kTileRows - 1) / kTileRows * kTileRows, full = p.M / kTileRows * kTileRows;
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  auto tail = torch::zeros({kTileRows, p.K}, x.options());
  if (full < p.M) tail.narrow(0, 0, p.M - full).copy_(xs.narrow(0, full, p.M - full));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  const uint16_t* tp = reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>());
  const int64_t x_stride = xs.stride(0) * sizeof(uint16_t), tail_stride = p.K * sizeof(uint16_t);
  const auto rows_at = [&](int64_t m) { return m < full ? xp + m * xs.stride(0) : tp; };
  const auto stride_at = [&](int64_t m) { return m < full ? x_stride : tail_stride; };
  for_column_pairs(p.NB, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[32 * 32];
    for (int64_t q = begin; q < end; ++q) {
      const int64_t nb = 2 * q;
      const bool two_cols = nb + 1 < p.NB;
      for (int64_t m0 = 0; m0 < Mpad; m0 += 2 * kTileRows) {
        const bool two_rows = m0 + kTileRows < Mpad;
        const int64_t m1 = m0 + kTileRows;
        const uint16_t *a0 = rows_at(m0), *a1 = two_rows ? rows_at(m1) : nullptr;
        const int64_t s0 = stride_at(m0), s1 = two_rows ? stride_at(m1) : 0;
        if (two_rows && two_cols) tile_block<2, 2>(a0, s0, a1, s1, p.wp, p.KB, nb, c);
        else if (two_rows) tile_block<2, 1>(a0, s0, a1, s1, p.wp, p.KB, nb, c);
        else if (two_cols) tile_block<1, 2>(a0, s0, a1, s1, p.wp, p.KB, nb, c);
        else tile_block<1, 1>(a0, s0, a1, s1, p.wp, p.KB, nb, c);
        epilogue(c, m0, std::min<int64_t>(2 * kTileRows, p.M - m0), nb, two_cols);
      }
    }
    _tile_release();
  });
}

}  // namespace
#endif

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  Bf16Problem p = setup(x, packed, bias);
#ifdef TOKENMILL_AMX
  amx_tiles(x, p, [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    write_rows(c, p.bias, p.yp, p.N, m0, rows, nb * kTileN, two_cols ? 2 * kTileN : kTileN);
  });
#else
  TORCH_CHECK(false, "this build has no AMX kernels (the CPU it was built for lacks AMX-BF16)");
#endif
  return p.y;
}

// silu(x @ gate.T) * (x @ up.T) on AMX tiles from bf16_pack_gate_up's layout: [M, K] -> [M, I], bit for bit
// silu_mul(amx_linear(x, bf16_pack(w))) without the [M, 2I] intermediate (its write and read back, and a pass).
torch::Tensor amx_linear_silu(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == 2, "a weight packed by bf16_pack_gate_up");
  const int64_t blocks = packed.size(0);
  Bf16Problem p = setup(x, packed.view({2 * blocks, packed.size(2), packed.size(3), packed.size(4)}), c10::nullopt,
                        /*with_output=*/false);
  const int64_t I = blocks * kTileN;
  auto y = torch::empty({p.M, I}, x.options());
#ifdef TOKENMILL_AMX
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  amx_tiles(x, p, [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool) {
    write_silu_rows(c, yp, I, m0, rows, (nb / 2) * kTileN);
  });
#else
  TORCH_CHECK(false, "this build has no AMX kernels (the CPU it was built for lacks AMX-BF16)");
#endif
  return y;
}

// The same product with AVX512-BF16 dot products (no AMX): same packed weight, same signature.
torch::Tensor dpbf16_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias) {
  Bf16Problem p = setup(x, packed, bias);
#ifdef TOKENMILL_DPBF16
  auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  for_column_pairs(p.NB, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t nb = 2 * q;
      if (nb + 1 < p.NB) dp_rows<2>(xp, p.K, p.wp, p.KB, p.M, nb, p.bias, p.yp, p.N);
      else dp_rows<1>(xp, p.K, p.wp, p.KB, p.M, nb, p.bias, p.yp, p.N);
    }
  });
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernels (the CPU it was built for lacks them)");
#endif
  return p.y;
}

// The packed bfloat16 product on this machine's kernel (bf16_kernel()): one kernel for every row count, so
// a row's result never depends on the batch it is in.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const std::string kernel = bf16_kernel();
  if (kernel == "amx") return amx_linear(x, packed, bias);
  return dpbf16_linear(x, packed, bias);
}
