// The AVX2 register tiles of the CPU matmul, for CPUs with AVX2 and FMA but no AVX-512: the
// forward's 16 lanes of an output element held as two ymm halves, and the backward's
// outer-product tile; both perform the portable kernels' IEEE operations, so the bits are theirs
// (and the AVX-512 kernels').
#include <immintrin.h>

#include <algorithm>

#include "kernels/cpu/matmul.h"

#define TANDEM_AVX2 __attribute__((target("avx2,fma")))

namespace tandem::ops::cpu::detail {
namespace {

static_assert(kLanes == 16, "two ymm registers hold the 16 lanes of an output element");

// Rows of x and w per forward register tile: 2 x 3 outputs of two halves each (12 ymm).
constexpr int kRows = 2;
constexpr int kCols = 3;

// The fixed halving tree over lanes 0-7 (lo) and 8-15 (hi): s8 = lo + hi, s4[l] = s8[l] +
// s8[l + 4], s2[l] = s4[l] + s4[l + 2], s2[0] + s2[1].
TANDEM_AVX2 inline float tree_sum(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// Lanes l < n (of 8) set.
TANDEM_AVX2 inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// y[r][c] (r < MR, c < NR) = [y +] the chunk partial of x row r against w row c.
template <int MR, int NR>
TANDEM_AVX2 inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                             int64_t ldy, int64_t kc, bool add) {
  __m256 lo[MR][NR], hi[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  const int64_t full = kc / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    __m256 a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      const __m256 b = _mm256_loadu_ps(w + c * ldw + k);
      for (int r = 0; r < MR; ++r) lo[r][c] = _mm256_fmadd_ps(a[r], b, lo[r][c]);
    }
    for (int r = 0; r < MR; ++r) a[r] = _mm256_loadu_ps(x + r * ldx + k + 8);
    for (int c = 0; c < NR; ++c) {
      const __m256 b = _mm256_loadu_ps(w + c * ldw + k + 8);
      for (int r = 0; r < MR; ++r) hi[r][c] = _mm256_fmadd_ps(a[r], b, hi[r][c]);
    }
  }
  if (full < kc) {
    // The last partial step updates only the first kc - full lanes; the others keep their value.
    const __m256i mlo = first_lanes(kc - full), mhi = first_lanes(kc - full - 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 alo = _mm256_maskload_ps(x + r * ldx + full, mlo);
      const __m256 ahi = _mm256_maskload_ps(x + r * ldx + full + 8, mhi);
      for (int c = 0; c < NR; ++c) {
        const __m256 blo = _mm256_maskload_ps(w + c * ldw + full, mlo);
        const __m256 bhi = _mm256_maskload_ps(w + c * ldw + full + 8, mhi);
        lo[r][c] = _mm256_blendv_ps(lo[r][c], _mm256_fmadd_ps(alo, blo, lo[r][c]),
                                    _mm256_castsi256_ps(mlo));
        hi[r][c] = _mm256_blendv_ps(hi[r][c], _mm256_fmadd_ps(ahi, bhi, hi[r][c]),
                                    _mm256_castsi256_ps(mhi));
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      const float t = tree_sum(lo[r][c], hi[r][c]);
      float& out = y[r * ldy + c];
      out = add ? out + t : t;
    }
  }
}

template <int MR>
TANDEM_AVX2 inline void tile_cols(const float* x, int64_t ldx, const float* w, int64_t ldw,
                                  float* y, int64_t ldy, int64_t kc, bool add, int64_t cols) {
  switch (cols) {
    case 1:
      return tile<MR, 1>(x, ldx, w, ldw, y, ldy, kc, add);
    case 2:
      return tile<MR, 2>(x, ldx, w, ldw, y, ldy, kc, add);
    default:
      return tile<MR, kCols>(x, ldx, w, ldw, y, ldy, kc, add);
  }
}

}  // namespace

TANDEM_AVX2 void chunk_avx2(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                            int64_t ldy, int64_t rows, int64_t cols, int64_t kc, bool add) {
  for (int64_t j = 0; j < cols; j += kCols) {
    const int64_t nc = std::min<int64_t>(kCols, cols - j);
    const float* wj = w + j * ldw;
    int64_t i = 0;
    for (; i + kRows <= rows; i += kRows)
      tile_cols<kRows>(x + i * ldx, ldx, wj, ldw, y + i * ldy + j, ldy, kc, add, nc);
    if (i < rows) tile_cols<1>(x + i * ldx, ldx, wj, ldw, y + i * ldy + j, ldy, kc, add, nc);
  }
}

namespace {

// The backward's tile in strips of MR rows by 3 ymm (24 columns): one accumulator per output
// element, a chain of FMAs from zero in increasing r, as tile_portable.
constexpr int64_t kStripCols = 24;

template <int MR>
TANDEM_AVX2 inline void outer_strip(const float* a, int64_t ars, int64_t acs, const float* b,
                                    int64_t kc, float* c, int64_t ldc, bool add, int64_t cols) {
  __m256 acc[MR][3];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t r = 0; r < kc; ++r) {
    const float* br = b + r * kOuterCols;
    const __m256 b0 = _mm256_loadu_ps(br), b1 = _mm256_loadu_ps(br + 8),
                 b2 = _mm256_loadu_ps(br + 16);
    for (int i = 0; i < MR; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + i * ars + r * acs);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(ai, b2, acc[i][2]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* ci = c + i * ldc;
    if (cols == kStripCols) {
      for (int v = 0; v < 3; ++v) {
        __m256 t = acc[i][v];
        if (add) t = _mm256_add_ps(_mm256_loadu_ps(ci + 8 * v), t);
        _mm256_storeu_ps(ci + 8 * v, t);
      }
    } else {
      alignas(32) float t[kStripCols];
      for (int v = 0; v < 3; ++v) _mm256_store_ps(t + 8 * v, acc[i][v]);
      for (int64_t j = 0; j < cols; ++j) ci[j] = add ? ci[j] + t[j] : t[j];
    }
  }
}

}  // namespace

// The packed b panel is kOuterCols wide whatever `cols` is, so a strip reads all of its 24
// columns and stores only those below cols.
TANDEM_AVX2 void outer_tile_avx2(const float* a, int64_t ars, int64_t acs, const float* b,
                                 int64_t kc, float* c, int64_t ldc, bool add, int64_t rows,
                                 int64_t cols) {
  static_assert(kOuterCols % kStripCols == 0);
  for (int64_t j = 0; j < cols; j += kStripCols) {
    const int64_t nc = std::min(kStripCols, cols - j);
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4)
      outer_strip<4>(a + i * ars, ars, acs, b + j, kc, c + i * ldc + j, ldc, add, nc);
    switch (rows - i) {
      case 3:
        outer_strip<3>(a + i * ars, ars, acs, b + j, kc, c + i * ldc + j, ldc, add, nc);
        break;
      case 2:
        outer_strip<2>(a + i * ars, ars, acs, b + j, kc, c + i * ldc + j, ldc, add, nc);
        break;
      case 1:
        outer_strip<1>(a + i * ars, ars, acs, b + j, kc, c + i * ldc + j, ldc, add, nc);
        break;
      default:
        break;
    }
  }
}

}  // namespace tandem::ops::cpu::detail
