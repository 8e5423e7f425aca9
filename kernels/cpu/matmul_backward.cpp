// The f32 backward products of the CPU matmul (dx = dy · w, dw = dyᵀ · x): an outer-product
// kernel on packed panels that reads both operands in the layout they come in, instead of
// transposing them for the forward's dot-product kernel.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/parallel.h"
#include "kernels/cpu/matmul.h"

#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace tandem::ops::cpu::detail {
namespace {

constexpr int64_t kMr = kOuterRows, kNr = kOuterCols;
static_assert(kMr == 8 && kNr == 48, "the AVX-512 tile below holds 8 x 3 accumulators");
// A work item: a block of up to kBlockRows rows of c by kBlockPanels column panels. Its c block,
// the chunk of b it reads (kOuterChunk rows of those columns) and the chunk of a stay in a
// core's L2 while its tiles pass over them; each tile keeps its b panel in L1 across the strips.
constexpr int64_t kBlockRows = 256;
constexpr int64_t kBlockPanels = 12;

// c (rows <= kMr, cols <= kNr; leading dimension ldc) = [c +] the chunk's sums
// a (kMr x kc: a(i, r) = a[i * ars + r * acs]) · b (kc x kNr, packed), each a sequence of fused
// multiply-adds from 0 in increasing r. Rows of a past `rows` are not read.
void tile_portable(const float* a, int64_t ars, int64_t acs, const float* b, int64_t kc, float* c,
                   int64_t ldc, bool add, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t r = 0; r < kc; ++r) acc = std::fma(a[i * ars + r * acs], b[r * kNr + j], acc);
      float& out = c[i * ldc + j];
      out = add ? out + acc : acc;
    }
  }
}

// The same with AVX-512: Packed, a is kc x kMr packed (ars = 1, acs = kMr); else a's kMr rows
// are read in place along r (acs = 1; rows past `rows` repeat the last one).
template <bool Packed>
TANDEM_AVX512 void tile_avx512(const float* a, int64_t ars, const float* b, int64_t kc, float* c,
                               int64_t ldc, bool add, int64_t rows, int64_t cols) {
  const float* row[kMr];
  for (int64_t i = 0; i < kMr; ++i) row[i] = a + std::min(i, rows - 1) * ars;
#define TANDEM_ACC_ROW(i)                                              \
  __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = _mm512_setzero_ps(), \
         c##i##2 = _mm512_setzero_ps();
  TANDEM_ACC_ROW(0)
  TANDEM_ACC_ROW(1)
  TANDEM_ACC_ROW(2)
  TANDEM_ACC_ROW(3)
  TANDEM_ACC_ROW(4)
  TANDEM_ACC_ROW(5)
  TANDEM_ACC_ROW(6)
  TANDEM_ACC_ROW(7)
#undef TANDEM_ACC_ROW
  for (int64_t r = 0; r < kc; ++r) {
    const float* ar = a + r * kMr;
    const float* br = b + r * kNr;
    const __m512 b0 = _mm512_load_ps(br), b1 = _mm512_load_ps(br + 16),
                 b2 = _mm512_load_ps(br + 32);
#define TANDEM_FMA_ROW(i)                                         \
  {                                                               \
    const __m512 ai = _mm512_set1_ps(Packed ? ar[i] : row[i][r]); \
    c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0);                   \
    c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);                   \
    c##i##2 = _mm512_fmadd_ps(ai, b2, c##i##2);                   \
  }
    TANDEM_FMA_ROW(0)
    TANDEM_FMA_ROW(1)
    TANDEM_FMA_ROW(2)
    TANDEM_FMA_ROW(3)
    TANDEM_FMA_ROW(4)
    TANDEM_FMA_ROW(5)
    TANDEM_FMA_ROW(6)
    TANDEM_FMA_ROW(7)
#undef TANDEM_FMA_ROW
  }
  const auto mask = [&](int64_t j0) -> __mmask16 {
    const int64_t n = std::clamp<int64_t>(cols - j0, 0, 16);
    return static_cast<__mmask16>((1u << n) - 1u);
  };
  const __mmask16 m0 = mask(0), m1 = mask(16), m2 = mask(32);
#define TANDEM_STORE(i, q)                                         \
  {                                                                \
    float* p = c + (i)*ldc + 16 * (q);                             \
    __m512 t = c##i##q;                                            \
    if (add) t = _mm512_add_ps(_mm512_maskz_loadu_ps(m##q, p), t); \
    _mm512_mask_storeu_ps(p, m##q, t);                             \
  }
#define TANDEM_STORE_ROW(i) \
  if ((i) < rows) {         \
    TANDEM_STORE(i, 0)      \
    TANDEM_STORE(i, 1)      \
    TANDEM_STORE(i, 2)      \
  }
  TANDEM_STORE_ROW(0)
  TANDEM_STORE_ROW(1)
  TANDEM_STORE_ROW(2)
  TANDEM_STORE_ROW(3)
  TANDEM_STORE_ROW(4)
  TANDEM_STORE_ROW(5)
  TANDEM_STORE_ROW(6)
  TANDEM_STORE_ROW(7)
#undef TANDEM_STORE_ROW
#undef TANDEM_STORE
}

// Columns [j_base, j_base + cols) of b's rows [r0, r0 + kc) (f32 or bf16) into panels of kNr
// columns: panel p holds kc rows of kNr floats, columns past the end zero.
void pack_b(const OuterOperand& b, int64_t r0, int64_t kc, int64_t j_base, int64_t cols,
            float* dst) {
  const int64_t panels = (cols + kNr - 1) / kNr;
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t j0 = j_base + p * kNr, n = std::min(kNr, j_base + cols - j0);
    float* d = dst + p * kc * kNr;
    for (int64_t r = 0; r < kc; ++r, d += kNr) {
      const int64_t at = (r0 + r) * b.row_stride + j0;
      if (b.bf16) {
        const uint16_t* s = static_cast<const uint16_t*>(b.data) + at;
        for (int64_t j = 0; j < n; ++j) d[j] = bf16_bits_to_f32(s[j]);
      } else {
        std::memcpy(d, static_cast<const float*>(b.data) + at, static_cast<size_t>(n) * 4);
      }
      std::fill(d + n, d + kNr, 0.0f);
    }
  }
}

// a's rows [i0, i0 + rows) and columns [r0, r0 + kc) into strips of kMr rows, where a's
// columns are contiguous (row_stride 1: dw's dyᵀ): strip s holds, for each r, its kMr values
// (rows past the end zero).
void pack_a(const OuterOperand& a, int64_t i0, int64_t rows, int64_t r0, int64_t kc, float* dst) {
  const float* src = static_cast<const float*>(a.data);
  const int64_t strips = (rows + kMr - 1) / kMr;
  for (int64_t s = 0; s < strips; ++s) {
    const int64_t n = std::min(kMr, rows - s * kMr);
    float* d = dst + s * kc * kMr;
    const float* base = src + (i0 + s * kMr) + r0 * a.col_stride;
    for (int64_t r = 0; r < kc; ++r) {
      std::memcpy(d + r * kMr, base + r * a.col_stride, static_cast<size_t>(n) * 4);
      std::fill(d + r * kMr + n, d + (r + 1) * kMr, 0.0f);
    }
  }
}

}  // namespace

void outer_product(const OuterOperand& a, const OuterOperand& b, float* c, int64_t rows,
                   int64_t cols, int64_t R, bool accumulate, F32Isa isa) {
  if (rows == 0 || cols == 0) return;
  if (R == 0) {  // an empty sum
    if (!accumulate) std::fill(c, c + rows * cols, 0.0f);
    return;
  }
  TANDEM_CHECK(a.col_stride == 1 || a.row_stride == 1,
               "outer_product: a must have contiguous rows or columns");
  const bool a_in_place = a.col_stride == 1;
  const int64_t panels = (cols + kNr - 1) / kNr;
  const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int64_t col_blocks = (panels + kBlockPanels - 1) / kBlockPanels;
  // Blocks go to threads as they finish: every element's sum is the same whoever computes it.
  const int64_t block_work = std::min(rows, kBlockRows) * std::min(cols, kBlockPanels * kNr) * R;
  const int64_t min_blocks =
      std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, block_work));
  parallel_for_dynamic(
      row_blocks * col_blocks,
      [&](int64_t item) {
        thread_local std::vector<float> a_buf, b_buf;
        const int64_t i0 = item / col_blocks * kBlockRows, n = std::min(kBlockRows, rows - i0);
        const int64_t p0 = item % col_blocks * kBlockPanels;
        const int64_t np = std::min(kBlockPanels, panels - p0);
        const int64_t j_base = p0 * kNr, ncols = std::min(cols - j_base, np * kNr);
        const int64_t strips = (n + kMr - 1) / kMr;
        // Accumulating over several chunks, the block's sums go to a buffer first and are added
        // to c once: c + (the product's sum), the same bits as the product computed alone and
        // added afterwards (what a data-parallel all-reduce of the parts does).
        thread_local std::vector<float> c_buf;
        const bool buffered = accumulate && R > kOuterChunk;
        float* const out = buffered ? grow(c_buf, n * ncols) : c + i0 * cols + j_base;
        const int64_t ldo = buffered ? ncols : cols;
        for (int64_t r0 = 0; r0 < R; r0 += kOuterChunk) {
          const int64_t kc = std::min(kOuterChunk, R - r0);
          const bool add = (accumulate && !buffered) || r0 > 0;
          float* bp = grow(b_buf, np * kc * kNr);
          pack_b(b, r0, kc, j_base, ncols, bp);
          // a in place when its rows run along r (dx's dy: kMr streams), else packed (dyᵀ's
          // rows are a whole dy row apart, which would fall into one set of L1).
          const float* ap = static_cast<const float*>(a.data) + i0 * a.row_stride + r0;
          int64_t ars = a.row_stride, acs = 1, strip_stride = kMr * a.row_stride;
          if (!a_in_place) {
            float* packed = grow(a_buf, strips * kc * kMr);
            pack_a(a, i0, n, r0, kc, packed);
            ap = packed;
            ars = 1;
            acs = kMr;
            strip_stride = kc * kMr;
          }
          for (int64_t p = 0; p < np; ++p) {
            const int64_t j0 = j_base + p * kNr, nc = std::min(kNr, cols - j0);
            const float* bpp = bp + p * kc * kNr;
            for (int64_t s = 0; s < strips; ++s) {
              const int64_t i = i0 + s * kMr, nr = std::min(kMr, rows - i);
              const float* as = ap + s * strip_stride;
              float* cb = out + (i - i0) * ldo + (j0 - j_base);
              if (isa == F32Isa::portable) {
                tile_portable(as, ars, acs, bpp, kc, cb, ldo, add, nr, nc);
              } else if (isa == F32Isa::avx2) {
                outer_tile_avx2(as, ars, acs, bpp, kc, cb, ldo, add, nr, nc);
              } else if (a_in_place) {
                tile_avx512<false>(as, ars, bpp, kc, cb, ldo, add, nr, nc);
              } else {
                tile_avx512<true>(as, ars, bpp, kc, cb, ldo, add, nr, nc);
              }
            }
          }
        }
        if (buffered) {
          for (int64_t i = 0; i < n; ++i) {
            float* row = c + (i0 + i) * cols + j_base;
            const float* sum = out + i * ncols;
            for (int64_t j = 0; j < ncols; ++j) row[j] += sum[j];
          }
        }
      },
      min_blocks);
}

}  // namespace tandem::ops::cpu::detail
