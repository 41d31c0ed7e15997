// Kept GGUF blocks multiplied as llama.cpp multiplies them, for CPUs with AVX512-VNNI but no AMX (Zen4, Ice Lake,
// Cascade Lake): each row of x is quantized to int8 per block of 32 (a float32 scale dx = max|x| / 127, as
// llama.cpp's Q8 activations), and each block's product is an exact integer dot product of the weight's quants
// with x's (VPDPBUSD: 64 byte products per instruction), scaled in float32:
//   Q4_0  (q - 8) * d       ->  d dx (sum q qx - 8 sum qx)
//   Q4_1  q * d + m         ->  d dx sum q qx + m dx sum qx
//   Q8_0  q * d             ->  d dx (sum (q + 128) qx - 128 sum qx)   (the bytes hold q + 128: VPDPBUSD's
//                                                                         first operand is unsigned)
//   Q4_Z  (q - z) * s       ->  s dx (sum q qx - z sum qx)             (AWQ's groups, formats/awq_format.py)
//   Q5_0  (q - 16) * d      ->  d dx (sum q qx - 16 sum qx)            (q's fifth bit ORed in as the quads load)
//   Q4_KS (d sc) q - dmin m ->  d sc dx sum q qx - dmin m dx sum qx    (a Q4_K sub-block, formats/kquants.py)
//   Q5_KS the same, q's fifth bit ORed in as Q5_0's                      (a Q5_K sub-block)
//   Q6_KS (d s) (q - 32)    ->  d dx (s_lo (sum_lo q qx - 32 sum_lo qx) + s_hi (... over K 16..31))
//                                                                       (a Q6_K block of 32: two scales of 16)
// Widening every weight to bfloat16 (csrc/gguf_linear.cpp, bit for bit the dequantized model) costs ~16 vector ops
// per 32 weights and made a one-row step slower than bfloat16's; this costs ~2, so a decode step is bound by
// the bytes of the blocks (a third of bfloat16's). x is rounded in two int8 parts, its int8 blocks and those of
// what they left (gguf_quads.h quantize_rows), both multiplied on each tile's unpacked quads and added: one 8-bit
// rounding alone flipped near-ties (docs/performance/quantization.md), two track bfloat16 x. Each output element is the same sequence of operations whatever the batch (the integer
// sums are exact; the float32 ones run block after block), so a row's result never depends on its batch.
//
// Packed at load (model/backends/gguf_tiles.py, layout "quads") per 16 features x 32 K, with gguf_pack's fields:
//   Q4: 4 x 64 bytes: vector t, dword lane j, byte i = feature j's quant byte 4t + i (its low nibble is K 4t + i,
//       its high nibble K 16 + 4t + i), so one AND or one shift gives the unsigned bytes of four K quads.
//   Q8_0: 8 x 64 bytes: vector t, lane j, byte i = feature j's q[4t + i] + 128; Q6_KS's the same, q as it is.
//   then the fields as in the tiles: 16 float16 d (s), Q4_1's 16 float16 m, Q4_Z's 16 uint8 z; Q5_0: 16 float16 d,
//   16 uint32 of fifth bits (bit k: K k's); Q4_KS: 16 float32 d sc, 16 float32 -(dmin m) (Q5_KS: then Q5_0's
//   16 uint32 of fifth bits); Q6_KS: 16 float16 d,
//   16 int8 scales of K 0..15, 16 of K 16..31.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <array>
#include <cstdint>
#include <vector>

#include "gguf_quads.h"
#include "tile_gemm.h"

#if defined(TOKENMILL_VNNI) && defined(TOKENMILL_INT8_ROWS)
namespace {

// acc += w's unsigned bytes times the 4 signed bytes at `quad`, in every lane, with the broadcast folded into
// VPDPBUSD's memory operand ({1to16}): GCC otherwise emits a separate VPBROADCASTD for each.
inline void dpbusd_broadcast(__m512i& acc, const __m512i& w, const int8_t* quad) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(quad)));
}

// The int32 dot products of one 16-feature x 32-K tile's quants (8 vectors of unsigned quads) with each of
// Rows rows' 32 int8 activations (row r's at qx + 32 r): lane j of s[r] = sum over K of feature j's quant times
// x's.
// A row's 8 VPDPBUSD would depend on each other (a chain 8 latencies long), and a compiled loop over rows keeps
// only ~3 rows in flight (half the multipliers idle), so the rows' chains go side by side, quad by quad, and a
// block of up to 4 rows splits each row's sum over more chains (2 for 3-4 rows, 4 for 1-2). The sums are exact
// integers: their grouping cannot change a result.
template <int Rows>
inline void tile_dots(const __m512i (&w)[8], const int8_t* qx, __m512i (&s)[Rows]) {
  constexpr int kChains = Rows >= 5 ? 1 : Rows >= 3 ? 2 : 4;  // partial sums per row
  __m512i part[kChains][Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < kChains; ++p) part[p][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      dpbusd_broadcast(part[t % kChains][r], w[t], qx + 32 * r + 4 * t);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    s[r] = part[0][r];
    for (int p = 1; p < kChains; ++p) s[r] = _mm512_add_epi32(s[r], part[p][r]);
  }
}

// tile_dots with each row's sum in two: over K 0..15 (vectors 0-3) and K 16..31 (4-7), for Q6_KS's two scales.
// Each half's 4 VPDPBUSD alternate between two chains.
template <int Rows>
inline void tile_dots_halves(const __m512i (&w)[8], const int8_t* qx, __m512i (&lo)[Rows], __m512i (&hi)[Rows]) {
  __m512i part[4][Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < 4; ++p) part[p][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) dpbusd_broadcast(part[(t / 4) * 2 + t % 2][r], w[t], qx + 32 * r + 4 * t);
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    lo[r] = _mm512_add_epi32(part[0][r], part[1][r]);
    hi[r] = _mm512_add_epi32(part[2][r], part[3][r]);
  }
}

// Q5_0: + 16 on each byte of w[t] whose K has its fifth bit set; `bits` holds each lane's (feature's) 32 fifth
// bits, vector t's bytes being K 4t .. 4t + 3 for t < 4 and K 16 + 4(t - 4) .. for t >= 4. With AVX512-BITALG one
// bit shuffle picks each byte's bit (byte i of lane j: bit (j % 2) * 32 + first K + i of its qword); without it,
// the lane's 4 bits are spread to its 4 bytes by a multiply.
inline void add_fifth_bits(__m512i (&w)[8], const __m512i bits) {
  const __m512i sixteen = _mm512_set1_epi8(16);
#ifdef __AVX512BITALG__
  alignas(64) static const auto control = [] {
    std::array<std::array<uint8_t, 64>, 8> c{};
    for (int t = 0; t < 8; ++t)
      for (int b = 0; b < 64; ++b) c[t][b] = static_cast<uint8_t>((b / 4) % 2 * 32 + (t < 4 ? 4 * t : 16 + 4 * (t - 4)) + b % 4);
    return c;
  }();
  for (int t = 0; t < 8; ++t) {
    const __mmask64 set = _mm512_bitshuffle_epi64_mask(bits, _mm512_loadu_si512(control[t].data()));
    w[t] = _mm512_mask_add_epi8(w[t], set, w[t], sixteen);
  }
#else
  for (int t = 0; t < 8; ++t) {
    const int first = t < 4 ? 4 * t : 16 + 4 * (t - 4);
    const __m512i four = _mm512_and_si512(_mm512_srli_epi32(bits, first), _mm512_set1_epi32(0xF));
    const __m512i spread = _mm512_and_si512(_mm512_mullo_epi32(four, _mm512_set1_epi32(0x00204081)),
                                            _mm512_set1_epi32(0x01010101));  // bit i -> byte i's bit 0
    w[t] = _mm512_or_si512(w[t], _mm512_slli_epi32(spread, 4));
  }
#endif
}

// A tile's quants as 8 vectors of unsigned bytes, vector t holding K quad t (K 4t .. 4t + 3) of each feature.
template <int64_t Type>
inline void load_quads(const uint8_t* tile, __m512i (&w)[8]) {
  if constexpr (Type == kQ8_0 || Type == kQ6_KS) {
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(tile + 64 * t);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(tile + 64 * t);
      w[t] = _mm512_and_si512(v, low);
      w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (has_fifth_bits<Type>()) add_fifth_bits(w, _mm512_loadu_si512(tile + fifth_bits_at<Type>()));
  }
}

// Rows [m0, m0 + Rows) times column blocks nb (and nb + 1 if Cols == 2): float32 results into c [Rows x 32].
// With `prefetch_until` (the weight's end; null for none) each tile's counterpart two column blocks on (the next
// column pair's) is prefetched into L2 as the tile is read: a step streams every weight from DRAM (a model's layers
// overflow the L3) and the hardware prefetcher alone kept too few lines in flight (measured: BENCHMARKS.md, "Kernels":
// the weights' prefetch into L2). L2, not L1: the next pair lies 11-30 KB ahead (K = 576 .. 1536), most
// of a 32 KB L1, so lines fetched into L1 were evicted before use and held its few miss buffers.
template <int64_t Type, int Rows, int Cols>
void vnni_block(const QuantizedRows& xq, int64_t m0, const uint8_t* w0, int64_t KB, int64_t tile_bytes,
                float* c, const uint8_t* prefetch_until) {
  __m512 acc[Rows][Cols];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Cols; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t first = xq.block(m0, 0);  // rows m0 .. m0 + Rows - 1 lie in one panel, block after block
  const int8_t* qx_panel = xq.q.data() + first * 32;
  const float* scale = xq.scale.data() + first;
  const int32_t* sum = xq.sum.data() + first;
  const int32_t* sum_lo = xq.sum_lo.data() + first;
  const float* scaled_sum = xq.scaled_sum.data() + first;
  const int64_t panel = xq.panel;
  for (int64_t kb = 0; kb < KB; ++kb) {
#pragma GCC unroll 2
    for (int j = 0; j < Cols; ++j) {
      const uint8_t* tile = w0 + (j * KB + kb) * tile_bytes;
      const uint8_t* fields = tile + quant_bytes<Type>();
      if (prefetch_until != nullptr && prefetch_until - tile > 2 * KB * tile_bytes)  // no pointer past the end
        prefetch_rows<false>(tile + 2 * KB * tile_bytes, 0, 1, tile_bytes);
      __m512i w[8];
      load_quads<Type>(tile, w);
      const BlockStep<Type, Lanes16, true> step(fields, 0);  // all 16 features; Q8_0's bytes are q + 128
      if constexpr (Type == kQ6_KS) {  // the sums of K 0..15 and 16..31, for its two scales
        __m512i lo[Rows], hi[Rows];
        tile_dots_halves<Rows>(w, qx_panel + kb * panel * 32, lo, hi);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int64_t row = kb * panel + r;
          step.add_halves(acc[r][j], lo[r], hi[r], scale[row], sum[row], sum_lo[row]);
        }
      } else {
        __m512i s[Rows];
        tile_dots<Rows>(w, qx_panel + kb * panel * 32, s);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int64_t row = kb * panel + r;
          step.add(acc[r][j], s[r], scale[row], sum[row], scaled_sum[row]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Cols; ++j) _mm512_storeu_ps(c + r * 32 + j * 16, acc[r][j]);
}

// Rows per vnni_block: 8 from 8 rows, one 16-feature column block at a time (each tile's unpacked quads serve
// twice the rows; 8 rows by both column blocks spilled its 16 accumulators: 512 rows ~1.3x faster, then ~1.2x more
// one column at a time), 4 by both column blocks below. (Until the rows' chains went side by side, 8-row blocks
// gained nothing below 64 rows; since, 0-15% at 8-48 rows.) Every element's sums are the same whatever the block,
// so the choice cannot change a row's result.
constexpr int64_t kVnniRows = 8;
constexpr int64_t kVnniRowsSmallM = 4;
static_assert(kPanelRows == kVnniRows && kPanelRows % kVnniRowsSmallM == 0, "a block of rows within a panel");

template <int64_t Type, int Cols>
void vnni_rows(const QuantizedRows& xq, int64_t m0, int64_t rows, const uint8_t* w0, int64_t KB,
               int64_t tile_bytes, float* c, const uint8_t* prefetch_until) {
  if constexpr (Cols == 1) {  // blocks of more than 4 rows go one column block at a time (vnni_tiles)
    switch (rows) {
      case 8: vnni_block<Type, 8, 1>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); return;
      case 7: vnni_block<Type, 7, 1>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); return;
      case 6: vnni_block<Type, 6, 1>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); return;
      case 5: vnni_block<Type, 5, 1>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); return;
      default: break;
    }
  }
  switch (rows) {
    case 4: vnni_block<Type, 4, Cols>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); break;
    case 3: vnni_block<Type, 3, Cols>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); break;
    case 2: vnni_block<Type, 2, Cols>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); break;
    default: vnni_block<Type, 1, Cols>(xq, m0, w0, KB, tile_bytes, c, prefetch_until); break;
  }
}

// The loop over 32-feature column pairs and 8-row blocks of x [M, K], as dp_tiles: float32 results of rows
// [m0, m0 + rows) and column blocks nb, nb + 1 go to epilogue(c, m0, rows, nb, two_cols). x is rounded in two int8
// parts (quantize_rows): rows 2m and 2m + 1 share each tile's unpacked quads, and their results are added before
// the epilogue sees row m.
template <int64_t Type, typename Epilogue>
void vnni_tiles(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue) {
  static_assert(kVnniRows % 2 == 0 && kVnniRowsSmallM % 2 == 0, "a row's two parts in one block of rows");
  const int64_t M = 2 * x.size(0), NB = packed.size(0), KB = packed.size(1), tile_bytes = packed.size(2);
  if (M == 0) return;
  const QuantizedRows xq = quantize_rows(x);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint8_t* weight_end = wp + NB * KB * tile_bytes;
  const int64_t block = M >= kVnniRows ? kVnniRows : kVnniRowsSmallM;
  for_column_pairs(NB, [&](WorkQueue& work) {
    alignas(64) float c[kVnniRows * 32];
    for (int64_t begin, end; work.take(begin, end);) for (int64_t q = begin; q < end; ++q) {
      const int64_t nb = 2 * q;
      const bool two_cols = nb + 1 < NB;
      const uint8_t* w0 = wp + nb * KB * tile_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t rows = std::min(block, M - m0);
        const uint8_t* until = m0 == 0 ? weight_end : nullptr;  // the next pair's tiles, once
        if (block == kVnniRows) {  // one column block at a time: 8 accumulators beside the 8 unpacked vectors
          vnni_rows<Type, 1>(xq, m0, rows, w0, KB, tile_bytes, c, until);
          if (two_cols) vnni_rows<Type, 1>(xq, m0, rows, w0 + KB * tile_bytes, KB, tile_bytes, c + 16, until);
        } else if (two_cols) {
          vnni_rows<Type, 2>(xq, m0, rows, w0, KB, tile_bytes, c, until);
        } else {
          vnni_rows<Type, 1>(xq, m0, rows, w0, KB, tile_bytes, c, until);
        }
        add_split_rows(c, rows);
        epilogue(c, m0 / 2, rows / 2, nb, two_cols);
      }
    }
  });
}

template <typename Epilogue>
void vnni_any(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "a weight packed by gguf_pack(layout='quads'): [N/16, K/32, tile bytes] uint8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "[M, K] bfloat16 input");
  TORCH_CHECK(x.size(1) == packed.size(1) * 32, "input has ", x.size(1), " features, the weight ",
              packed.size(1) * 32);
  with_quads_type(packed.size(2), [&](auto type) { vnni_tiles<decltype(type)::value>(x, packed, epilogue); });
}

}  // namespace
#endif

// x [M, K] bfloat16, packed [N/16, K/32, tile bytes] in the quads layout, bias [N] or none -> [M, N] bfloat16.
at::Tensor gguf_vnni_linear(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias) {
#if defined(TOKENMILL_VNNI) && defined(TOKENMILL_INT8_ROWS)
  const int64_t N = packed.size(0) * kTileN;
  auto y = at::empty({x.size(0), N}, x.options());
  const FloatBias b = float_bias(bias);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  vnni_any(x, packed, [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    write_rows(c, nullptr, b.p, yp, N, m0, rows, nb * kTileN, two_cols ? 2 * kTileN : kTileN);
  });
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX512-VNNI kernels (the CPU it was built for lacks them)");
  return at::Tensor();
#endif
}

// silu(x @ gate.T) * (x @ up.T) from gate/up block pairs in the quads layout ([I/16, 2, K/32, tile bytes]).
at::Tensor gguf_vnni_linear_silu(const at::Tensor& x, const at::Tensor& pairs) {
#if defined(TOKENMILL_VNNI) && defined(TOKENMILL_INT8_ROWS)
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(1) == 2, "a gate/up weight packed by gguf_pack in pairs");
  const int64_t I = pairs.size(0) * kTileN;
  auto y = at::empty({x.size(0), I}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  vnni_any(x, pairs.view({2 * pairs.size(0), pairs.size(2), pairs.size(3)}),
           [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool) {
             write_silu_rows(c, nullptr, nullptr, yp, I, m0, rows, (nb / 2) * kTileN);
           });
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX512-VNNI kernels (the CPU it was built for lacks them)");
  return at::Tensor();
#endif
}
