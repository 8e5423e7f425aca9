// The AVX-512 register tiles of the CPU matmul: kTileRows x rows against kTileCols w rows, one
// zmm accumulator of kLanes lanes per output element, reduced by the fixed halving tree.
#include <immintrin.h>

#include <algorithm>

// GCC 12's shuffle intrinsics pass _mm512_undefined_ps() as the unused merge source, which its
// -Wuninitialized reports once inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/transpose_avx512.h"

#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace tandem::ops::cpu::detail {
namespace {

static_assert(kLanes == 16, "one zmm register holds the 16 lanes of an output element");

// Most cache lines of the next w panel requested per tile.
constexpr int64_t kMaxPrefetchPerTile = 32;

// The halving tree of up to 8 accumulators at once: lane c of the result is the sum of v[c].
// Every add below is one level of the tree for each accumulator (the same pairs as the
// portable kernel adds; a + b == b + a bitwise).
TANDEM_AVX512 inline __m256 reduce8(__m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4,
                                    __m512 v5, __m512 v6, __m512 v7) {
  // [v0 s8 | v1 s8], s8[l] = v[l] + v[l + 8].
  const __m512 a0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  const __m512 a1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  const __m512 a2 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v4, v5, 0x44), _mm512_shuffle_f32x4(v4, v5, 0xEE));
  const __m512 a3 =
      _mm512_add_ps(_mm512_shuffle_f32x4(v6, v7, 0x44), _mm512_shuffle_f32x4(v6, v7, 0xEE));
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

// 16 w values as f32: loaded, or bf16 bits widened in the register (exact: the f32 with the
// same upper 16 bits), so that the FMAs see the very values an f32 copy of w would hold.
TANDEM_AVX512 inline __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
TANDEM_AVX512 inline __m512 load_w(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The first lanes of m; the others are 0.0f.
TANDEM_AVX512 inline __m512 maskz_load_w(__mmask16 m, const float* p) {
  return _mm512_maskz_loadu_ps(m, p);
}
TANDEM_AVX512 inline __m512 maskz_load_w(__mmask16 m, const uint16_t* p) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[r][c] (r < MR, c < NR) = [y[r][c] +] the chunk partial of x row r against w row c. W: the
// element type of w, float or uint16_t (bf16 bits).
template <int MR, int NR, bool Tail, class W>
TANDEM_AVX512 inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                               int64_t ldy, int64_t kc, bool add) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full = kc / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    __m512 a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm512_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < NR; ++c) {
      const __m512 b = load_w(w + c * ldw + k);
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(a[r], b, acc[r][c]);
    }
  }
  if constexpr (Tail) {
    // Only the first kc - full lanes take the last partial step; the others keep their value.
    const __mmask16 m = static_cast<__mmask16>((1u << (kc - full)) - 1u);
    __m512 a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + full);
    for (int c = 0; c < NR; ++c) {
      const __m512 b = maskz_load_w(m, w + c * ldw + full);
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_mask3_fmadd_ps(a[r], b, acc[r][c], m);
    }
  }
  const __mmask8 out = static_cast<__mmask8>((1u << NR) - 1u);
  for (int r = 0; r < MR; ++r) {
    // Columns past NR repeat the last one; their sums are not stored.
    constexpr int l = NR - 1;
    __m256 t = reduce8(acc[r][0], acc[r][1 < l ? 1 : l], acc[r][2 < l ? 2 : l],
                       acc[r][3 < l ? 3 : l], acc[r][4 < l ? 4 : l], acc[r][5 < l ? 5 : l],
                       acc[r][6 < l ? 6 : l], acc[r][7 < l ? 7 : l]);
    float* yr = y + r * ldy;
    if (add) t = _mm256_add_ps(_mm256_maskz_loadu_ps(out, yr), t);
    _mm256_mask_storeu_ps(yr, out, t);
  }
}

// The full tile (4 x 6) with named accumulators: the same arithmetic as tile<4, 6, false>, but
// GCC keeps named variables in registers from start to end (it leaves the 24-vector array of
// the generic tile in memory outside the k loop, which costs ~5% at K = 576).
template <class W>
TANDEM_AVX512 inline void tile_4x6(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                                   int64_t ldy, int64_t kc, bool add) {
  static_assert(kTileRows == 4 && kTileCols == 6);
#define TANDEM_ACC_ROW(r)                                              \
  __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps(), \
         c##r##2 = _mm512_setzero_ps(), c##r##3 = _mm512_setzero_ps(), \
         c##r##4 = _mm512_setzero_ps(), c##r##5 = _mm512_setzero_ps();
  TANDEM_ACC_ROW(0)
  TANDEM_ACC_ROW(1)
  TANDEM_ACC_ROW(2)
  TANDEM_ACC_ROW(3)
#undef TANDEM_ACC_ROW
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  for (int64_t k = 0; k < kc; k += kLanes) {
    const __m512 a0 = _mm512_loadu_ps(x0 + k), a1 = _mm512_loadu_ps(x1 + k),
                 a2 = _mm512_loadu_ps(x2 + k), a3 = _mm512_loadu_ps(x3 + k);
#define TANDEM_FMA_COL(c)                     \
  {                                           \
    const __m512 b = load_w(w + (c)*ldw + k); \
    c0##c = _mm512_fmadd_ps(a0, b, c0##c);    \
    c1##c = _mm512_fmadd_ps(a1, b, c1##c);    \
    c2##c = _mm512_fmadd_ps(a2, b, c2##c);    \
    c3##c = _mm512_fmadd_ps(a3, b, c3##c);    \
  }
    TANDEM_FMA_COL(0)
    TANDEM_FMA_COL(1)
    TANDEM_FMA_COL(2)
    TANDEM_FMA_COL(3)
    TANDEM_FMA_COL(4)
    TANDEM_FMA_COL(5)
#undef TANDEM_FMA_COL
  }
  const __mmask8 out = 0x3F;
#define TANDEM_STORE_ROW(r)                                                                     \
  {                                                                                             \
    __m256 t = reduce8(c##r##0, c##r##1, c##r##2, c##r##3, c##r##4, c##r##5, c##r##5, c##r##5); \
    float* yr = y + (r)*ldy;                                                                    \
    if (add) t = _mm256_add_ps(_mm256_maskz_loadu_ps(out, yr), t);                              \
    _mm256_mask_storeu_ps(yr, out, t);                                                          \
  }
  TANDEM_STORE_ROW(0)
  TANDEM_STORE_ROW(1)
  TANDEM_STORE_ROW(2)
  TANDEM_STORE_ROW(3)
#undef TANDEM_STORE_ROW
}

template <int MR, class W, int NR = kTileCols>
TANDEM_AVX512 inline void tile_cols(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                                    int64_t ldy, int64_t kc, bool add, int64_t cols) {
  if constexpr (NR > 1) {
    if (cols < NR) return tile_cols<MR, W, NR - 1>(x, ldx, w, ldw, y, ldy, kc, add, cols);
  }
  if (kc % kLanes != 0) return tile<MR, NR, true>(x, ldx, w, ldw, y, ldy, kc, add);
  if constexpr (MR == 4 && NR == 6) {
    tile_4x6(x, ldx, w, ldw, y, ldy, kc, add);
  } else {
    tile<MR, NR, false>(x, ldx, w, ldw, y, ldy, kc, add);
  }
}

template <class W, int MR = kTileRows - 1>
TANDEM_AVX512 inline void tile_rows(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                                    int64_t ldy, int64_t kc, bool add, int64_t rows, int64_t cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<W, MR - 1>(x, ldx, w, ldw, y, ldy, kc, add, rows, cols);
  }
  tile_cols<MR>(x, ldx, w, ldw, y, ldy, kc, add, cols);
}

template <class W>
TANDEM_AVX512 void chunk(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                         int64_t ldy, int64_t rows, int64_t cols, int64_t kc, bool add,
                         const Prefetch& next) {
  static_assert(kTileCols <= 8, "reduce8 reduces up to 8 accumulators of a row");
  // The next panel's lines are requested into L2 a few per tile, so that it is there when its
  // first tile starts (w streams from memory once per block of x rows).
  const int64_t lines_per_row = (next.row_bytes + 63) / 64;
  const int64_t lines = next.base != nullptr ? next.rows * lines_per_row : 0;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows * ((cols + kTileCols - 1) / kTileCols);
  int64_t per_tile = (lines + tiles - 1) / tiles;
  // With few tiles (small M: decode) the bursts of prefetches cost more than they save (the
  // hardware prefetcher follows w, which is read once); only spread-out prefetches pay.
  if (per_tile > kMaxPrefetchPerTile && !std::is_same_v<W, uint16_t>) per_tile = 0;
  int64_t line = 0;
  const auto prefetch_some = [&] {
    for (int64_t e = std::min(lines, line + per_tile); line < e; ++line)
      _mm_prefetch(
          next.base + (line / lines_per_row) * next.stride_bytes + (line % lines_per_row) * 64,
          _MM_HINT_T1);
  };
  for (int64_t j = 0; j < cols; j += kTileCols) {
    const int64_t nc = cols - j < kTileCols ? cols - j : kTileCols;
    const W* wj = w + j * ldw;
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

}  // namespace

TANDEM_AVX512 void chunk_avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                                int64_t ldy, int64_t rows, int64_t cols, int64_t kc, bool add,
                                const Prefetch& next) {
  chunk(x, ldx, w, ldw, y, ldy, rows, cols, kc, add, next);
}

TANDEM_AVX512 void chunk_avx512(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                                float* y, int64_t ldy, int64_t rows, int64_t cols, int64_t kc,
                                bool add, const Prefetch& next) {
  chunk(x, ldx, w, ldw, y, ldy, rows, cols, kc, add, next);
}

}  // namespace tandem::ops::cpu::detail

namespace tandem::ops::cpu::detail {

TANDEM_AVX512 void transpose16_avx512(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  transpose16x16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, r[i]);
}

}  // namespace tandem::ops::cpu::detail

namespace tandem::ops::cpu::detail {

TANDEM_AVX512 void widen_bf16_avx512(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m256i h = _mm256_maskz_loadu_epi16(m, src + i);
    _mm512_mask_storeu_ps(dst + i, m,
                          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

}  // namespace tandem::ops::cpu::detail
