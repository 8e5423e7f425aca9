// The bf16 precision of the CPU matmul on AMX: operands rounded to bf16 and packed into the
// tile layouts (which the AVX512-BF16 path reads too), then 32 x 32 output blocks of four
// 16 x 16 f32 accumulator tiles.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

// GCC 12's shuffle intrinsics pass _mm512_undefined_ps() as the unused merge source, which its
// -Wuninitialized reports once inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/transpose_avx512.h"

#define TANDEM_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
// The packing, shared with the AVX512-BF16 path (CPUs without AMX).
#define TANDEM_BF16_PACK __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace tandem::ops::cpu::detail {
namespace {

// Linux hands out the AMX tile data state only to processes that ask for it.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, amx_bf16 = (d >> 22) & 1u;
  const bool avx512 = ((b >> 16) & 1u) && ((b >> 30) & 1u) && ((b >> 31) & 1u) && ((b >> 17) & 1u);
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  const bool avx512_bf16 = (a >> 5) & 1u;
  return tile && amx_bf16 && avx512 && avx512_bf16;
}

// The palette-1 configuration: tiles 0-3 accumulate 16 x 16 f32, 4-5 hold 16 rows of 32 bf16 of
// the first operand, 6-7 the 16 pairs-rows (32 bf16 each) of two column groups of the second.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TANDEM_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 16 f32 as bf16 (round to nearest even, denormal inputs as zero: bf16_bits_daz).
TANDEM_BF16_PACK inline __m256i round16(__m512 v) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
}

TANDEM_BF16_PACK inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
TANDEM_BF16_PACK inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TANDEM_BF16_PACK inline __mmask16 mask_of(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// 32 bf16 lanes [lo0, hi0, lo1, hi1, ...] from rows lo and hi of 16 f32: one pair-row of a
// column group.
TANDEM_BF16_PACK inline __m512i interleave(__m512 lo, __m512 hi) {
  const __m512i v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, v);
}

template <class T>
TANDEM_BF16_PACK void pack_rows_impl(const T* src, int64_t ld, int64_t rows, int64_t k,
                                     uint16_t* dst, int64_t kp) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * ld;
    uint16_t* d = dst + r * kp;
    for (int64_t c = 0; c < kp; c += 16) {
      const __m512 v = c < k ? load16(s + c, mask_of(k - c)) : _mm512_setzero_ps();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), round16(v));
    }
  }
}

template <class T>
TANDEM_BF16_PACK void pack_pairs_impl(const T* src, int64_t ld, int64_t r_count, int64_t cols,
                                      uint16_t* dst, int64_t g0, int64_t g1, int64_t kp) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t c0 = g * 16;
    const __mmask16 m = c0 < cols ? mask_of(cols - c0) : __mmask16(0);
    uint16_t* d = dst + g * kp * 16;
    for (int64_t r = 0; r < kp; r += 2) {
      const __m512 lo = r < r_count ? load16(src + r * ld + c0, m) : _mm512_setzero_ps();
      const __m512 hi = r + 1 < r_count ? load16(src + (r + 1) * ld + c0, m) : _mm512_setzero_ps();
      _mm512_storeu_si512(d + r * 16, interleave(lo, hi));
    }
  }
}

template <class T>
TANDEM_BF16_PACK void pack_transposed_impl(const T* src, int64_t ld, int64_t cols, int64_t k,
                                           uint16_t* dst, int64_t g0, int64_t g1, int64_t kp) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t c0 = g * 16;
    const int64_t nc = std::clamp<int64_t>(cols - c0, 0, 16);
    uint16_t* d = dst + g * kp * 16;
    for (int64_t k0 = 0; k0 < kp; k0 += 16) {
      const __mmask16 m = k0 < k ? mask_of(k - k0) : __mmask16(0);
      __m512 t[16];
      for (int64_t i = 0; i < 16; ++i)
        t[i] = i < nc ? load16(src + (c0 + i) * ld + k0, m) : _mm512_setzero_ps();
      transpose16x16(t);  // t[i]: the 16 columns' values at k0 + i
      for (int64_t i = 0; i < 16; i += 2)
        _mm512_storeu_si512(d + (k0 + i) * 16, interleave(t[i], t[i + 1]));
    }
  }
}

template <class T>
TANDEM_BF16_PACK void pack_rows_transposed_impl(const T* src, int64_t ld, int64_t r_count,
                                                int64_t rows, uint16_t* dst, int64_t g0, int64_t g1,
                                                int64_t kp) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * 16;
    const __mmask16 m = mask_of(rows - n0);
    for (int64_t r0 = 0; r0 < kp; r0 += 16) {
      __m512 t[16];
      for (int64_t i = 0; i < 16; ++i)
        t[i] = r0 + i < r_count ? load16(src + (r0 + i) * ld + n0, m) : _mm512_setzero_ps();
      transpose16x16(t);  // t[j]: row n0 + j of the result, values r0 ... r0 + 15
      for (int64_t j = 0; j < 16 && n0 + j < rows; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (n0 + j) * kp + r0), round16(t[j]));
    }
  }
}

}  // namespace

bool amx_usable() {
  static const bool usable = [] {
    if (!cpu_has_amx_bf16()) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// Calls f with src as a pointer to the type it holds (bf16 bits or f32).
template <class F>
void typed(const void* src, bool bf16, F&& f) {
  if (bf16)
    f(static_cast<const uint16_t*>(src));
  else
    f(static_cast<const float*>(src));
}

void amx_pack_rows(const void* src, bool bf16, int64_t ld, int64_t rows, int64_t k, uint16_t* dst,
                   int64_t kp) {
  typed(src, bf16, [&](auto p) { pack_rows_impl(p, ld, rows, k, dst, kp); });
}

void amx_pack_rows_transposed(const void* src, bool bf16, int64_t ld, int64_t r_count, int64_t rows,
                              uint16_t* dst, int64_t g0, int64_t g1, int64_t kp) {
  typed(src, bf16,
        [&](auto p) { pack_rows_transposed_impl(p, ld, r_count, rows, dst, g0, g1, kp); });
}

void amx_pack_pairs(const void* src, bool bf16, int64_t ld, int64_t r_count, int64_t cols,
                    uint16_t* dst, int64_t g0, int64_t g1, int64_t kp) {
  typed(src, bf16, [&](auto p) { pack_pairs_impl(p, ld, r_count, cols, dst, g0, g1, kp); });
}

void amx_pack_transposed(const void* src, bool bf16, int64_t ld, int64_t cols, int64_t k,
                         uint16_t* dst, int64_t g0, int64_t g1, int64_t kp) {
  typed(src, bf16, [&](auto p) { pack_transposed_impl(p, ld, cols, k, dst, g0, g1, kp); });
}

// The rows of block (ig, jg) that y has, from the first `tiles` of the 16 x 16 tiles in c
// (row-major pairs: tile t holds rows (t / 2) * 16.., columns (t % 2) * 16..), [added to y].
TANDEM_AMX inline void store_tiles(const float (*c)[16 * 16], int tiles, float* y, int64_t ldy,
                                   int64_t ig, int64_t jg, int64_t rows, int64_t cols, bool add) {
  for (int t = 0; t < tiles; ++t) {
    const int64_t r0 = ig * 32 + (t / 2) * 16, c0 = jg * 32 + (t % 2) * 16;
    const int64_t nr = std::min<int64_t>(16, rows - r0), nc = cols - c0;
    if (nr <= 0 || nc <= 0) continue;
    const __mmask16 m = mask_of(nc);
    for (int64_t r = 0; r < nr; ++r) {
      float* out = y + (r0 + r) * ldy + c0;
      __m512 v = _mm512_load_ps(c[t] + r * 16);
      if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
      _mm512_mask_storeu_ps(out, m, v);
    }
  }
}

TANDEM_AMX void amx_blocks(const uint16_t* a, int64_t row_groups, const uint16_t* b,
                           int64_t col_groups, int64_t kp, float* y, int64_t ldy, int64_t rows,
                           int64_t cols, bool add) {
  configure_tiles();
  alignas(64) float c[4][16 * 16];
  const int64_t stride_a = kp * 2;
  for (int64_t jg = 0; jg < col_groups; ++jg) {
    const uint16_t* b0 = b + jg * 2 * kp * 16;
    const uint16_t* b1 = b0 + kp * 16;
    for (int64_t ig = 0; ig < row_groups; ++ig) {
      const uint16_t* a0 = a + ig * 32 * kp;
      const uint16_t* a1 = a0 + 16 * kp;
      _tile_zero(0);
      _tile_zero(1);
      if (rows - ig * 32 <= 16) {
        // No row of the second 16 is stored (decode): its tiles are not computed.
        for (int64_t k = 0; k < kp; k += 32) {
          _tile_loadd(4, a0 + k, stride_a);
          _tile_loadd(6, b0 + k * 16, 64);
          _tile_loadd(7, b1 + k * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        store_tiles(c, 2, y, ldy, ig, jg, rows, cols, add);
        continue;
      }
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < kp; k += 32) {
        _tile_loadd(4, a0 + k, stride_a);
        _tile_loadd(5, a1 + k, stride_a);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_loadd(7, b1 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if (!add && ig * 32 + 32 <= rows && jg * 32 + 32 <= cols) {
        // A whole block, overwritten: straight from the tiles into y.
        float* out = y + ig * 32 * ldy + jg * 32;
        _tile_stored(0, out, ldy * 4);
        _tile_stored(1, out + 16, ldy * 4);
        _tile_stored(2, out + 16 * ldy, ldy * 4);
        _tile_stored(3, out + 16 * ldy + 16, ldy * 4);
        continue;
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      store_tiles(c, 4, y, ldy, ig, jg, rows, cols, add);
    }
  }
  _tile_release();
}

}  // namespace tandem::ops::cpu::detail
