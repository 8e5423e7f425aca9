// The AVX-512 register tiles of the CPU matmul: kTileRows x rows against kTileCols w rows, one
// zmm accumulator of kLanes lanes per output element, reduced by the fixed halving tree.
#include <immintrin.h>

#include <algorithm>

// GCC 12's shuffle intrinsics pass _mm512_undefined_ps() as the unused merge source, which its
// -Wuninitialized reports once inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "kernels/cpu/matmul.h"

#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace tandem::ops::cpu::detail {
namespace {

static_assert(kLanes == 16, "one zmm register holds the 16 lanes of an output element");

// The halving tree of up to 8 accumulators at once: lane c of the result is the sum of v[c].
// Every add below is one level of the tree for each accumulator (the same pairs as the
// portable kernel adds; a + b == b + a bitwise).
TANDEM_AVX512 inline __m256 reduce8(const __m512 v[8]) {
  // [v0 s8 | v1 s8], s8[l] = v[l] + v[l + 8].
  const __m512 a0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 a1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  const __m512 a2 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v[4], v[5], 0x44), _mm512_shuffle_f32x4(v[4], v[5], 0xEE));
  const __m512 a3 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v[6], v[7], 0x44), _mm512_shuffle_f32x4(v[6], v[7], 0xEE));
  // [v0 s4 | v1 s4 | v2 s4 | v3 s4], s4[l] = s8[l] + s8[l + 4].
  const __m512 b0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x88), _mm512_shuffle_f32x4(a0, a1, 0xDD));
  const __m512 b1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x88), _mm512_shuffle_f32x4(a2, a3, 0xDD));
  // 128-bit block q: [vq s2[0], vq s2[1], v(q+4) s2[0], v(q+4) s2[1]], s2[l] = s4[l] + s4[l + 2].
  const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(b0, b1, 0x44), _mm512_shuffle_ps(b0, b1, 0xEE));
  // Lane 4q holds vq, lane 4q + 2 holds v(q+4): s = s2[0] + s2[1].
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_ps(c, c, 0xB1));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, d));
}

// y[r][c] (r < MR, c < NR) = [y[r][c] +] the chunk partial of x row r against w row c.
template <int MR, int NR>
TANDEM_AVX512 inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                               int64_t ldy, int64_t kc, bool add) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes <= kc; k += kLanes) {
    __m512 a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm512_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      const __m512 b = _mm512_loadu_ps(w + c * ldw + k);
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(a[r], b, acc[r][c]);
    }
  }
  if (k < kc) {
    // Only the first kc - k lanes take the last partial step; the others keep their value.
    const __mmask16 m = static_cast<__mmask16>((1u << (kc - k)) - 1u);
    __m512 a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      const __m512 b = _mm512_maskz_loadu_ps(m, w + c * ldw + k);
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_mask3_fmadd_ps(a[r], b, acc[r][c], m);
    }
  }
  const __mmask8 out = static_cast<__mmask8>((1u << NR) - 1u);
  for (int r = 0; r < MR; ++r) {
    __m512 v[8];
    for (int c = 0; c < 8; ++c) v[c] = acc[r][c < NR ? c : NR - 1];
    __m256 t = reduce8(v);
    float* yr = y + r * ldy;
    if (add) t = _mm256_add_ps(_mm256_maskz_loadu_ps(out, yr), t);
    _mm256_mask_storeu_ps(yr, out, t);
  }
}

template <int MR, int NR = kTileCols>
TANDEM_AVX512 inline void tile_cols(const float* x, int64_t ldx, const float* w, int64_t ldw,
                                    float* y, int64_t ldy, int64_t kc, bool add, int64_t cols) {
  if constexpr (NR > 1) {
    if (cols < NR) return tile_cols<MR, NR - 1>(x, ldx, w, ldw, y, ldy, kc, add, cols);
  }
  tile<MR, NR>(x, ldx, w, ldw, y, ldy, kc, add);
}

template <int MR = kTileRows - 1>
TANDEM_AVX512 inline void tile_rows(const float* x, int64_t ldx, const float* w, int64_t ldw,
                                    float* y, int64_t ldy, int64_t kc, bool add, int64_t rows,
                                    int64_t cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<MR - 1>(x, ldx, w, ldw, y, ldy, kc, add, rows, cols);
  }
  tile_cols<MR>(x, ldx, w, ldw, y, ldy, kc, add, cols);
}

}  // namespace

TANDEM_AVX512 void chunk_avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                                int64_t ldy, int64_t rows, int64_t cols, int64_t kc, bool add,
                                const Prefetch& next) {
  static_assert(kTileCols <= 8, "reduce8 reduces up to 8 accumulators of a row");
  // The next panel's lines are requested into L2 a few per tile, so that it is there when its
  // first tile starts (w streams from memory once per block of x rows).
  const int64_t lines_per_row = (next.row_bytes + 63) / 64;
  const int64_t lines = next.base != nullptr ? next.rows * lines_per_row : 0;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows * ((cols + kTileCols - 1) / kTileCols);
  const int64_t per_tile = (lines + tiles - 1) / tiles;
  int64_t line = 0;
  const auto prefetch_some = [&] {
    for (int64_t e = std::min(lines, line + per_tile); line < e; ++line)
      _mm_prefetch(
          next.base + (line / lines_per_row) * next.stride_bytes + (line % lines_per_row) * 64,
          _MM_HINT_T1);
  };
  for (int64_t j = 0; j < cols; j += kTileCols) {
    const int64_t nc = cols - j < kTileCols ? cols - j : kTileCols;
    const float* wj = w + j * ldw;
    int64_t i = 0;
    for (; i + kTileRows <= rows; i += kTileRows) {
      prefetch_some();
      tile_cols<kTileRows>(x + i * ldx, ldx, wj, ldw, y + i * ldy + j, ldy, kc, add, nc);
    }
    if (i < rows) {
      prefetch_some();
      tile_rows(x + i * ldx, ldx, wj, ldw, y + i * ldy + j, ldy, kc, add, rows - i, nc);
    }
  }
}

}  // namespace tandem::ops::cpu::detail
