// f32 -> bf16 for weight publishing: the portable loop, the AVX512-BF16 one, and the choice.
#include "weight_sync/cast.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_SYNC_AVX512BF16 1
#endif

namespace tandem::weight_sync {

// f32_to_bf16_bits (core/half.h) written without a branch, so that the compiler vectorizes it
// (one clone per x86 vector width): the same bits for every input, NaN included.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void f32_to_bf16_portable(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, s + i, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    d[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

#if TANDEM_SYNC_AVX512BF16

bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

// vcvtne2ps2bf16 rounds to nearest even and quiets a NaN as f32_to_bf16_bits does, but treats
// subnormal inputs as zero: a block with one is redone by the portable loop.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void f32_to_bf16_avx512_bf16(const float* s,
                                                                                    uint16_t* d,
                                                                                    int64_t n,
                                                                                    bool stream) {
  int64_t i = 0;
  if (stream) {
    // Non-temporal stores need 64-byte aligned destinations.
    const auto misaligned = reinterpret_cast<uintptr_t>(d) % 64;
    i = misaligned % 2 != 0
            ? n
            : std::min<int64_t>(n, static_cast<int64_t>((64 - misaligned) % 64 / 2));
    f32_to_bf16_portable(s, d, i);
  }
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  const __m512i mantissa = _mm512_set1_epi32(0x007fffff);
  for (; i + 32 <= n; i += 32) {
    const __m512i lo = _mm512_loadu_si512(s + i), hi = _mm512_loadu_si512(s + i + 16);
    const __mmask16 sub_lo =
        _mm512_testn_epi32_mask(lo, exponent) & _mm512_test_epi32_mask(lo, mantissa);
    const __mmask16 sub_hi =
        _mm512_testn_epi32_mask(hi, exponent) & _mm512_test_epi32_mask(hi, mantissa);
    __m512i out;
    if ((sub_lo | sub_hi) == 0) [[likely]] {
      out = reinterpret_cast<__m512i>(
          _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hi), _mm512_castsi512_ps(lo)));
    } else {
      alignas(64) uint16_t block[32];
      f32_to_bf16_portable(s + i, block, 32);
      out = _mm512_load_si512(block);
    }
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), out);
    else
      _mm512_storeu_si512(d + i, out);
  }
  if (stream) _mm_sfence();
  f32_to_bf16_portable(s + i, d + i, n - i);
}

#else

bool has_avx512_bf16() { return false; }
void f32_to_bf16_avx512_bf16(const float* s, uint16_t* d, int64_t n, bool) {
  f32_to_bf16_portable(s, d, n);
}

#endif

void f32_to_bf16(const float* s, uint16_t* d, int64_t n, bool stream) {
  if (has_avx512_bf16()) {
    f32_to_bf16_avx512_bf16(s, d, n, stream);
  } else {
    f32_to_bf16_portable(s, d, n);
  }
}

}  // namespace tandem::weight_sync
