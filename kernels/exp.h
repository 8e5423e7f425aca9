// Arithmetic that CPU and CUDA kernels share bit for bit: unfused IEEE single operations and
// softmax_exp, a vectorisable exp. Free of fmt, so .cu files include it too.
#pragma once

#include <cstdint>

#include "core/half.h"

namespace tandem::ops {

// IEEE single operations that nvcc must not fuse into FMAs: the shared arithmetic below gives
// bitwise the same result on the CPU (built without contraction) and on CUDA.
TANDEM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TANDEM_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TANDEM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TANDEM_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// exp(x) for x <= 88, within 2 ulp of the true value (Cody-Waite reduction and the Cephes expf
// polynomial); 0 below about -87.68 (= ln(2^-126.5), where the exponent field runs out) and for
// -inf. No float branch or select, so CPU loops over it vectorise (GCC will not speculate float
// arithmetic past a float select), and the same bits on CPU and CUDA. NaN in, NaN out is not
// promised: callers detect NaN rows themselves.
TANDEM_HD float softmax_exp(float x) {
  constexpr uint32_t kLowBits = 0xC2B00000u;  // -88.0f, which gives n = -127: a zero scale
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo; n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // Below -88 (as bit patterns: negative floats of larger magnitude have larger patterns), -88.
  const uint32_t bits = float_bits(x);
  const float xc = bits_float(bits < kLowBits ? bits : kLowBits);
  const float n = sub_rn(add_rn(mul_rn(xc, kLog2e), kRound), kRound);
  const float r = sub_rn(sub_rn(xc, mul_rn(n, kLn2Hi)), mul_rn(n, kLn2Lo));
  float p = 1.9875691500e-4f;
  p = add_rn(mul_rn(p, r), 1.3981999507e-3f);
  p = add_rn(mul_rn(p, r), 8.3334519073e-3f);
  p = add_rn(mul_rn(p, r), 4.1665795894e-2f);
  p = add_rn(mul_rn(p, r), 1.6666665459e-1f);
  p = add_rn(mul_rn(p, r), 5.0000001201e-1f);
  const float y = add_rn(add_rn(mul_rn(p, mul_rn(r, r)), r), 1.0f);
  // 2^n from its exponent field; n = -127 gives the field 0, the float 0.
  const uint32_t field = static_cast<uint32_t>(static_cast<int32_t>(n) + 127);
  return mul_rn(y, bits_float(field << 23));
}

// exp(-g) for the sigmoid of SwiGLU, by softmax_exp with its argument held at 88 (where it is
// defined): for g below -88 the sigmoid is then 1 / (1 + e^88) instead of a value further below
// 1e-38, and silu(g) = g * sigmoid(g) is within a denormal of 0 either way.
TANDEM_HD float silu_exp_neg(float g) {
  const float a = -g;
  return softmax_exp(a < 88.0f ? a : 88.0f);
}

}  // namespace tandem::ops
