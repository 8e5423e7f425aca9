// softmax_exp (kernels/exp.h) on 16 lanes: the same IEEE single operations lane by lane, so the
// same bits as the scalar function. Callers compile it inside functions with the avx512f target.
#pragma once

#include <immintrin.h>

#include "kernels/exp.h"

namespace tandem::ops::cpu::detail {

__attribute__((target("avx512f"), always_inline)) inline __m512 softmax_exp_avx512(__m512 x) {
  using namespace softmax_exp_constants;
  // Below -88 as unsigned bit patterns: -88.
  const __m512i low = _mm512_set1_epi32(static_cast<int>(kLowBits));
  const __m512 xc = _mm512_castsi512_ps(_mm512_min_epu32(_mm512_castps_si512(x), low));
  const __m512 round = _mm512_set1_ps(kRound);
  const __m512 n =
      _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)), round), round);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(kLn2Hi))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(kLn2Lo)));
  __m512 p = _mm512_set1_ps(kP0);
  for (const float c : {kP1, kP2, kP3, kP4, kP5})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512 y =
      _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i field = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(field, 23)));
}

}  // namespace tandem::ops::cpu::detail
