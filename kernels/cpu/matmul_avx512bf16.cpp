// The bf16 precision of the CPU matmul on AVX512-BF16 without AMX (AMD Zen 4): the operands in
// the packed layouts of the AMX path, register tiles of rows x 16-column groups, `vdpbf16ps`.
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/matmul.h"

#define TANDEM_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace tandem::ops::cpu::detail {
namespace {

// A register tile: kDpRows first-operand rows against kDpGroups groups of 16 columns, one zmm
// accumulator per (row, group) (24 of the 32 registers; 4 hold the groups' pairs, 1 the row's
// broadcast pair).
constexpr int kDpRows = 6;
constexpr int kDpGroups = 4;
// K values per pass over a 64-column block's rows: the block's pairs of one pass (64 x 192
// bf16, 24 KiB) stay in L1 (Zen 4: 32 KiB) while every row tile reads them. The accumulators
// go back to y between passes and are loaded again unchanged, so the pass length changes no
// bit.
constexpr int64_t kDpKBlock = 192;

bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a >> 5) & 1u;
}

TANDEM_AVX512BF16 inline __mmask16 mask_of(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// y rows r < MR, columns of groups g < NB (the last group's columns masked by `last`): the
// accumulators start at y (`load`) or +0, then take the pairs k0, k0 + 2, ... < k1 in order:
// acc[c] = dpbf16(acc[c], (a[k], a[k + 1]), (b[k][c], b[k + 1][c])). a: packed rows of kp bf16;
// b: the first group of kp / 2 pair-rows of 32 bf16, the next kp 16 values further.
template <int MR, int NB>
TANDEM_AVX512BF16 inline void dp_tile(const uint16_t* a, int64_t kp, const uint16_t* b, int64_t k0,
                                      int64_t k1, float* y, int64_t ldy, bool load,
                                      __mmask16 last) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < NB; ++g)
      acc[r][g] =
          load ? _mm512_maskz_loadu_ps(g + 1 == NB ? last : __mmask16(0xffff), y + r * ldy + 16 * g)
               : _mm512_setzero_ps();
  const int64_t group = kp * 16;
  for (int64_t k = k0; k < k1; k += 2) {
    __m512bh bv[NB];
#pragma GCC unroll 4
    for (int g = 0; g < NB; ++g)
      bv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + g * group + k * 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * kp + k, sizeof(pair));
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int g = 0; g < NB; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], av, bv[g]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < NB; ++g)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * g, g + 1 == NB ? last : __mmask16(0xffff),
                            acc[r][g]);
}

template <int MR>
TANDEM_AVX512BF16 inline void dp_tile_groups(int64_t groups, const uint16_t* a, int64_t kp,
                                             const uint16_t* b, int64_t k0, int64_t k1, float* y,
                                             int64_t ldy, bool load, __mmask16 last) {
  static_assert(kDpGroups == 4);
  switch (groups) {
    case 1:
      return dp_tile<MR, 1>(a, kp, b, k0, k1, y, ldy, load, last);
    case 2:
      return dp_tile<MR, 2>(a, kp, b, k0, k1, y, ldy, load, last);
    case 3:
      return dp_tile<MR, 3>(a, kp, b, k0, k1, y, ldy, load, last);
    default:
      return dp_tile<MR, 4>(a, kp, b, k0, k1, y, ldy, load, last);
  }
}

template <int MR = kDpRows>
TANDEM_AVX512BF16 inline void dp_tile_rows(int64_t rows, int64_t groups, const uint16_t* a,
                                           int64_t kp, const uint16_t* b, int64_t k0, int64_t k1,
                                           float* y, int64_t ldy, bool load, __mmask16 last) {
  if constexpr (MR > 1) {
    if (rows < MR) return dp_tile_rows<MR - 1>(rows, groups, a, kp, b, k0, k1, y, ldy, load, last);
  }
  dp_tile_groups<MR>(groups, a, kp, b, k0, k1, y, ldy, load, last);
}

}  // namespace

bool avx512_bf16_usable() {
  static const bool usable = __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512dq") && cpu_has_avx512_bf16();
  return usable;
}

TANDEM_AVX512BF16 void dp_blocks(const uint16_t* a, int64_t rows, const uint16_t* b, int64_t cols,
                                 int64_t kp, float* y, int64_t ldy, bool add) {
  constexpr int64_t kBlockCols = 16 * kDpGroups;
  for (int64_t c0 = 0; c0 < cols; c0 += kBlockCols) {
    const int64_t nc = std::min(kBlockCols, cols - c0);
    const int64_t groups = (nc + 15) / 16;
    const __mmask16 last = mask_of(nc - 16 * (groups - 1));
    for (int64_t k0 = 0; k0 < kp; k0 += kDpKBlock) {
      const int64_t k1 = std::min(kp, k0 + kDpKBlock);
      const bool load = add || k0 > 0;
      for (int64_t i = 0; i < rows; i += kDpRows)
        dp_tile_rows(std::min<int64_t>(kDpRows, rows - i), groups, a + i * kp, kp, b + c0 * kp, k0,
                     k1, y + i * ldy + c0, ldy, load, last);
    }
  }
}

}  // namespace tandem::ops::cpu::detail
