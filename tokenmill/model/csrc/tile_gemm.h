// The loops shared by the packed matmuls (bf16_linear.cpp, int8_linear.cpp, gguf_linear.cpp): x [M, K] bfloat16
// times a weight given as bfloat16 tiles in the VNNI order the AMX tile dot product reads B in (bf16_linear.cpp
// describes the layout), on AMX tiles where the CPU has them (amx_tiles), else with AVX512-BF16 dot products
// (dp_tiles: Zen4, Cooper Lake), which read the same tile rows. Where the weight comes from is the caller's: a
// packed bfloat16 copy is read in place, a quantized one is widened first. Either way every output element is one
// fixed sequence of dot products over K, whatever M and wherever its row sits: batch-invariant by construction.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simd.h"
#include "work_split.h"

constexpr int64_t kTileRows = 16;   // rows of A and C tiles; K pairs of a B tile
constexpr int64_t kTileK = 32;      // bfloat16 elements of K per tile dot product
constexpr int64_t kTileN = 16;      // output features per C tile
constexpr int64_t kTileElems = kTileRows * kTileK;  // bfloat16 elements of one B tile

// Work items are 32-feature column pairs (the last may be 16 wide), taken as the threads go (work_split.h) in
// guided chunks: each a share of what is left (half of it over 2 threads), down to one pair. A thread streams long
// runs of the weight, its prefetch two pairs ahead landing in its own run; fixed chunks of ~1/8 of the pairs began
// each run cold and prefetched into the other thread's. On Zen 4, 30 Q4_1 layers (66 MB, kernel_ab.py): one row
// 3.19 -> 2.91 ms, 8 rows 5.72 -> 5.25, 64 rows 30.4 -> 29.0 (BENCHMARKS.md, "matmul columns in guided chunks").
// body(queue) runs once per thread and loops over the chunks it takes.
template <typename F>
void for_column_pairs(int64_t NB, const F& body) {
  const int64_t pairs = (NB + 1) / 2;
  parallel_take(pairs, 1, body, at::get_num_threads());
}


// A thread's scratch of n bfloat16 elements, aligned to 64 bytes: whole-line vector stores.
struct AlignedScratch {
  std::vector<uint16_t> store;
  uint16_t* data;
  explicit AlignedScratch(int64_t n)
      : store(n + 32),
        data(reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t{63})) {}
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_DPBF16 1
#include <immintrin.h>

// The tiles of a weight whose column blocks nb, nb + 1 lie one after the other, KB tiles each, at b0 (a packed
// bfloat16 weight in place, or a quantized one widened into a buffer).
struct ContiguousTiles {
  const uint16_t* b0;
  int64_t KB;
  std::pair<const uint16_t*, const uint16_t*> operator()(int64_t kb) const {
    return {b0 + kb * kTileElems, b0 + (KB + kb) * kTileElems};
  }
  ContiguousTiles contiguous() const { return *this; }
};

// A quantized weight packed as NB column blocks of KB tiles, `tile_bytes` each, block after block, which
// `widen_tile(src, dst)` turns into a bfloat16 tile as bf16_pack lays it out. For several row blocks a column pair
// is widened whole into the buffer once for all of them to share; for a single one (decode) it is widened K
// block by K block into a 4-tile ring that stays in L1, beside the tile arithmetic, instead of being written
// and read back whole (96 KB at K = 1536, more than L1 holds).
template <typename WidenTile>
struct WidenedTiles {
  const uint8_t* q0;  // column block nb's tiles; block nb + 1's follow (if two_cols)
  uint16_t* buffer;
  int64_t KB, tile_bytes;
  bool two_cols, streamed;
  WidenTile widen_tile;
  std::pair<const uint16_t*, const uint16_t*> operator()(int64_t kb) const {
    if (!streamed) return {buffer + kb * kTileElems, buffer + (KB + kb) * kTileElems};
    uint16_t* b = buffer + (kb & 1) * 2 * kTileElems;  // alternate halves for alternate K blocks
    widen_tile(q0 + kb * tile_bytes, b);
    if (two_cols) widen_tile(q0 + (KB + kb) * tile_bytes, b + kTileElems);
    return {b, b + kTileElems};
  }
  // The whole pair widened in the buffer (streamed == false), read in place.
  ContiguousTiles contiguous() const { return {buffer, KB}; }
};

// The scratch (bfloat16 elements) gemm_tiles must give widened_weight's tiles per thread.
inline int64_t widened_scratch(int64_t KB) { return std::max<int64_t>(2 * KB, 4) * kTileElems; }

// gemm_tiles' weight source for a quantized weight (see WidenedTiles).
template <typename WidenTile>
auto widened_weight(const uint8_t* qp, int64_t NB, int64_t KB, int64_t tile_bytes, WidenTile widen_tile) {
  return [=](int64_t nb, uint16_t* scratch, int64_t row_blocks) {
    const bool two_cols = nb + 1 < NB, streamed = row_blocks == 1;
    const uint8_t* q0 = qp + nb * KB * tile_bytes;
    if (!streamed) {
      for (int64_t t = 0; t < (two_cols ? 2 : 1) * KB; ++t) widen_tile(q0 + t * tile_bytes, scratch + t * kTileElems);
    }
    return WidenedTiles<WidenTile>{q0, scratch, KB, tile_bytes, two_cols, streamed, widen_tile};
  };
}

// A bias in float32 (the epilogues add it in float32), or none: `p` points into `t`.
struct FloatBias {
  at::Tensor t;
  const float* p = nullptr;
};

inline FloatBias float_bias(const c10::optional<at::Tensor>& bias) {
  FloatBias b;
  if (bias.has_value()) {
    b.t = bias->to(at::kFloat).contiguous();
    b.p = b.t.data_ptr<float>();
  }
  return b;
}

// 16 float32 results of features [n0, n0 + 16), times their per-feature scales (if any) plus bias (if any),
// rounded to bfloat16 (nearest-even, as torch rounds) still as floats. Scale first, then bias: the order a
// dequantize-then-matmul reference with a bias applies them in.
inline __m512 scaled_bias_bf16(__m512 v, const float* scale, const float* bias) {
  return round_to_bf16_ps512(scaled_biased<Lanes16>(v, scale, bias));
}

// float32 tile results of rows [m0, m0 + rows) and features [n0, n0 + cols) into y [M, N] bfloat16: scaled
// (scale [N] or null) and biased (bias [N] or null) as scaled_bias_bf16 says.
inline void write_rows(const float* c, const float* scale, const float* bias, uint16_t* y, int64_t N, int64_t m0,
                       int64_t rows, int64_t n0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; j += 16) {
      store_bf16x16(y + (m0 + r) * N + n0 + j, scaled_bias_bf16(_mm512_loadu_ps(c + r * 32 + j),
                                                                scale == nullptr ? nullptr : scale + n0 + j,
                                                                bias == nullptr ? nullptr : bias + n0 + j));
    }
  }
}

// The SiLU-and-multiply epilogue of a gate/up column pair (gate features in c's columns 0-15, up's in 16-31):
// each scaled (gate_scale/up_scale: 16 floats or null) and rounded to bfloat16 as a bfloat16 matmul's output
// is, then silu(gate) * up exactly as silu_mul (elementwise.cpp) computes it from those bfloat16 values, into
// y [M, I] at columns [n0, n0 + 16).
inline void write_silu_rows(const float* c, const float* gate_scale, const float* up_scale, uint16_t* y, int64_t I,
                            int64_t m0, int64_t rows, int64_t n0) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 g = scaled_bias_bf16(_mm512_loadu_ps(c + r * 32), gate_scale, nullptr);
    const __m512 u = scaled_bias_bf16(_mm512_loadu_ps(c + r * 32 + 16), up_scale, nullptr);
    store_bf16x16(y + (m0 + r) * I + n0, round_to_bf16_ps512(silu_times<Lanes16>(g, u, true)));
  }
}
// Rows [0, Rows) of x (row stride ld) times column blocks (Cols of them) of the weight's tiles, with AVX512-BF16:
// for each K pair, the pair of x broadcast against a tile row (that pair for 16 features). Float32 results into
// c [Rows x 32] (row stride 32; block 1 at column 16). Every element sums its K pairs in one fixed order.
template <int Rows, int Cols, typename Tiles>
inline void dp_block(const uint16_t* x, int64_t ld, const Tiles& tiles, int64_t KB, float* c) {
  __m512 acc[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Cols; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const auto b = tiles(kb);
    const uint16_t* bt[2] = {b.first, b.second};
    for (int64_t rr = 0; rr < kTileRows; ++rr) {
      __m512i bv[Cols];
      for (int j = 0; j < Cols; ++j) bv[j] = _mm512_loadu_si512(bt[j] + rr * 2 * kTileN);
      for (int r = 0; r < Rows; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ld + kb * kTileK + 2 * rr, sizeof(pair));
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int j = 0; j < Cols; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)bv[j]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Cols; ++j) _mm512_storeu_ps(c + r * 32 + j * 16, acc[r][j]);
}

// Rows per dp_block: 16 accumulators, 2 weight rows, a broadcast. Each K pair's 2 weight loads then feed 16 dot
// products, not 8: at 64-512 rows the 30 layers' matmuls ran 1.2-1.6x faster than in blocks of 4 (BENCHMARKS.md),
// with the same sums in the same order (a row's result still does not depend on its batch).
constexpr int64_t kDpRows = 8;

template <int Cols, typename Tiles>
inline void dp_rows(const uint16_t* x, int64_t ld, int64_t rows, const Tiles& tiles, int64_t KB, float* c) {
  switch (rows) {
    case 8: dp_block<8, Cols>(x, ld, tiles, KB, c); break;
    case 7: dp_block<7, Cols>(x, ld, tiles, KB, c); break;
    case 6: dp_block<6, Cols>(x, ld, tiles, KB, c); break;
    case 5: dp_block<5, Cols>(x, ld, tiles, KB, c); break;
    case 4: dp_block<4, Cols>(x, ld, tiles, KB, c); break;
    case 3: dp_block<3, Cols>(x, ld, tiles, KB, c); break;
    case 2: dp_block<2, Cols>(x, ld, tiles, KB, c); break;
    default: dp_block<1, Cols>(x, ld, tiles, KB, c); break;
  }
}

// amx_tiles' loop with AVX512-BF16 dot products, same arguments and epilogue contract (c holds at most kDpRows
// rows here): `weight(nb, scratch, row_blocks)` is asked for the tiles `row_blocks` times (blocks of kDpRows rows).
template <typename Weight, typename Epilogue>
void dp_tiles(const at::Tensor& x, int64_t K, int64_t NB, int64_t scratch_elems, const Weight& weight,
              const Epilogue& epilogue) {
  const int64_t M = x.size(0), KB = K / kTileK;
  if (M == 0) return;
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  const int64_t ld = xs.stride(0), row_blocks = (M + kDpRows - 1) / kDpRows;
  for_column_pairs(NB, [&](WorkQueue& work) {
    alignas(64) float c[kDpRows * 32];
    AlignedScratch buffer(scratch_elems);
    uint16_t* scratch = buffer.data;
    for (int64_t begin, end; work.take(begin, end);) for (int64_t q = begin; q < end; ++q) {
      const int64_t nb = 2 * q;
      const bool two_cols = nb + 1 < NB;
      if (M == 1) {  // one row: a quantized weight widened K block by K block as it is read (see WidenedTiles)
        const auto tiles = weight(nb, scratch, 1);
        if (two_cols) dp_block<1, 2>(xp, ld, tiles, KB, c);
        else dp_block<1, 1>(xp, ld, tiles, KB, c);
        epilogue(c, 0, 1, nb, two_cols);
        continue;
      }
      // Several: the pair's tiles whole (widened once, if quantized), so the dot-product loop calls nothing and
      // its accumulators stay in registers (a call inside it spills them: 2.5x slower at 512 rows).
      const ContiguousTiles tiles = weight(nb, scratch, std::max<int64_t>(row_blocks, 2)).contiguous();
      for (int64_t m0 = 0; m0 < M; m0 += kDpRows) {
        const int64_t rows = std::min(kDpRows, M - m0);
        if (two_cols) dp_rows<2>(xp + m0 * ld, ld, rows, tiles, KB, c);
        else dp_rows<1>(xp + m0 * ld, ld, rows, tiles, KB, c);
        epilogue(c, m0, rows, nb, two_cols);
      }
    }
  });
}

#endif  // TOKENMILL_DPBF16

#if defined(TOKENMILL_DPBF16) && defined(__AVX512VNNI__)
#define TOKENMILL_VNNI 1  // csrc/gguf_vnni.cpp
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(TOKENMILL_DPBF16)
#define TOKENMILL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out the AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Tiles 0-1: A (two 16-row blocks of x), 2-3: B (two 16-feature blocks of w), 4-7: C = A_i x B_j.
inline void configure_gemm_tiles() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// C tiles of rows a0 (and a1) times the weight's K tiles, stored as float32 into c [32, 32] (row stride 32
// floats): `tiles(kb)` gives the bfloat16 B tiles (column block 0, column block 1) of K block kb, and c[r][j]
// for j < 16 comes from block 0, j >= 16 from block 1.
template <int RowBlocks, int ColBlocks, typename Tiles>
void tile_block(const uint16_t* a0, int64_t a0_stride, const uint16_t* a1, int64_t a1_stride, const Tiles& tiles,
                int64_t KB, float* c) {
  _tile_zero(4);
  if constexpr (ColBlocks > 1) _tile_zero(5);
  if constexpr (RowBlocks > 1) _tile_zero(6);
  if constexpr (RowBlocks > 1 && ColBlocks > 1) _tile_zero(7);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const auto [b0, b1] = tiles(kb);
    _tile_loadd(0, a0 + kb * kTileK, a0_stride);
    if constexpr (RowBlocks > 1) _tile_loadd(1, a1 + kb * kTileK, a1_stride);
    _tile_loadd(2, b0, 64);
    if constexpr (ColBlocks > 1) _tile_loadd(3, b1, 64);
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

// The tile loop over x [M, K] (rows may be strided) and NB column blocks of 16 features, K = 32 KB. For each
// 32-feature column pair, `weight(nb, scratch, row_blocks)` gives the Tiles (see tile_block) of blocks nb and
// nb + 1 for `row_blocks` 32-row blocks to read, using `scratch` (scratch_elems bfloat16 per thread) if it must
// build them; then for each 32-row block the float32 results c [32 x 32] go to
// `epilogue(c, m0, rows, nb, two_cols)`.
template <typename Weight, typename Epilogue>
void amx_tiles(const at::Tensor& x, int64_t K, int64_t NB, int64_t scratch_elems, const Weight& weight,
               const Epilogue& epilogue) {
  TORCH_CHECK(request_amx(), "the OS did not grant the AMX tile state");
  const int64_t M = x.size(0), KB = K / kTileK;
  if (M == 0) return;
  // Whole 16-row tiles load straight from x; a last partial tile from a zero-padded copy of its rows.
  const int64_t Mpad = (M + kTileRows - 1) / kTileRows * kTileRows, full = M / kTileRows * kTileRows;
  const int64_t row_blocks = (Mpad + 2 * kTileRows - 1) / (2 * kTileRows);
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  auto tail = at::zeros({kTileRows, K}, x.options());
  if (full < M) tail.narrow(0, 0, M - full).copy_(xs.narrow(0, full, M - full));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  const uint16_t* tp = reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>());
  const int64_t x_stride = xs.stride(0) * sizeof(uint16_t), tail_stride = K * sizeof(uint16_t);
  const auto rows_at = [&](int64_t m) { return m < full ? xp + m * xs.stride(0) : tp; };
  const auto stride_at = [&](int64_t m) { return m < full ? x_stride : tail_stride; };
  for_column_pairs(NB, [&](WorkQueue& work) {
    configure_gemm_tiles();
    alignas(64) float c[32 * 32];  // the epilogue may work in it
    AlignedScratch buffer(scratch_elems);
    uint16_t* scratch = buffer.data;
    for (int64_t begin, end; work.take(begin, end);) for (int64_t q = begin; q < end; ++q) {
      const int64_t nb = 2 * q;
      const bool two_cols = nb + 1 < NB;
      const auto tiles = weight(nb, scratch, row_blocks);
      for (int64_t m0 = 0; m0 < Mpad; m0 += 2 * kTileRows) {
        const bool two_rows = m0 + kTileRows < Mpad;
        const int64_t m1 = m0 + kTileRows;
        const uint16_t *a0 = rows_at(m0), *a1 = two_rows ? rows_at(m1) : nullptr;
        const int64_t s0 = stride_at(m0), s1 = two_rows ? stride_at(m1) : 0;
        if (two_rows && two_cols) tile_block<2, 2>(a0, s0, a1, s1, tiles, KB, c);
        else if (two_rows) tile_block<2, 1>(a0, s0, a1, s1, tiles, KB, c);
        else if (two_cols) tile_block<1, 2>(a0, s0, a1, s1, tiles, KB, c);
        else tile_block<1, 1>(a0, s0, a1, s1, tiles, KB, c);
        epilogue(c, m0, std::min<int64_t>(2 * kTileRows, M - m0), nb, two_cols);
      }
    }
    _tile_release();
  });
}

#endif  // TOKENMILL_AMX

#ifdef TOKENMILL_DPBF16
// The packed product's loop on this CPU's kernel: AMX tiles where the CPU has them and the OS grants them, else
// AVX512-BF16 dot products. A process takes one of them for good (the grant does not change), so a row's result
// still never depends on its batch.
template <typename Weight, typename Epilogue>
void gemm_tiles(const at::Tensor& x, int64_t K, int64_t NB, int64_t scratch_elems, const Weight& weight,
                const Epilogue& epilogue) {
#ifdef TOKENMILL_AMX
  if (request_amx()) return amx_tiles(x, K, NB, scratch_elems, weight, epilogue);
#endif
  dp_tiles(x, K, NB, scratch_elems, weight, epilogue);
}
#endif
