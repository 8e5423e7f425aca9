// bf16 and f16 storage types with round-to-nearest-even conversions, identical on CPU and CUDA.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__ __forceinline__
#else
#define TANDEM_HD inline
#endif

namespace tandem {

TANDEM_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TANDEM_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
TANDEM_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

TANDEM_HD float bf16_bits_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// f32 -> IEEE binary16, round to nearest even, with subnormals, overflow to inf, NaN kept.
TANDEM_HD uint16_t f32_to_f16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (abs < 0x38800000u) {                                               // f16 subnormal or 0
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);           // < 2^-25: to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24 : value = mant * 2^(exp-150), unit 2^-24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15 (in place, 13 low bits extra)
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

TANDEM_HD float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal: normalise.
  uint32_t e = 113u;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

// Storage types: plain 16-bit payloads, converted explicitly.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  TANDEM_HD explicit bf16(float f) : bits(f32_to_bf16_bits(f)) {}
  TANDEM_HD explicit operator float() const { return bf16_bits_to_f32(bits); }
  TANDEM_HD static bf16 from_bits(uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
};

struct f16 {
  uint16_t bits = 0;
  f16() = default;
  TANDEM_HD explicit f16(float f) : bits(f32_to_f16_bits(f)) {}
  TANDEM_HD explicit operator float() const { return f16_bits_to_f32(bits); }
  TANDEM_HD static f16 from_bits(uint16_t b) {
    f16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

}  // namespace tandem
