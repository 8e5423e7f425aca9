// bf16 and f16 conversions: round to nearest even, specials, and every f16 value round-trips.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "core/half.h"

using namespace tandem;

TEST_CASE("bf16 rounds f32 to nearest even", "[unit]") {
  CHECK(f32_to_bf16_bits(1.0f) == 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa.
  CHECK(f32_to_bf16_bits(bits_float(0x3f808000u)) == 0x3f80);
  CHECK(f32_to_bf16_bits(bits_float(0x3f818000u)) == 0x3f82);
  CHECK(f32_to_bf16_bits(bits_float(0x3f808001u)) == 0x3f81);
  CHECK(f32_to_bf16_bits(-2.0f) == 0xc000);
  CHECK(f32_to_bf16_bits(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(std::nanf("")))));
  // The largest finite f32 rounds up to infinity in bf16.
  CHECK(f32_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);
}

TEST_CASE("every finite f16 value round-trips through f32 exactly", "[unit]") {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = f16_bits_to_f32(bits);
    if (std::isnan(f)) {
      CHECK(std::isnan(f16_bits_to_f32(f32_to_f16_bits(f))));
      continue;
    }
    INFO("f16 bits " << h);
    REQUIRE(f32_to_f16_bits(f) == bits);
  }
}

TEST_CASE("f16 rounds f32 to nearest even with subnormals and overflow", "[unit]") {
  CHECK(f32_to_f16_bits(1.0f) == 0x3c00);
  CHECK(f32_to_f16_bits(65504.0f) == 0x7bff);
  CHECK(f32_to_f16_bits(65520.0f) == 0x7c00);  // halfway to the next binade: rounds to inf
  CHECK(f32_to_f16_bits(65519.0f) == 0x7bff);
  CHECK(f32_to_f16_bits(std::ldexp(1.0f, -24)) == 0x0001);  // smallest subnormal
  CHECK(f32_to_f16_bits(std::ldexp(1.0f, -25)) == 0x0000);  // halfway to it: to even (zero)
  CHECK(f32_to_f16_bits(std::ldexp(1.5f, -25)) == 0x0001);
  CHECK(f32_to_f16_bits(std::ldexp(3.0f, -25)) == 0x0002);  // 1.5 units: ties to even (2)
  CHECK(f32_to_f16_bits(-0.0f) == 0x8000);
  // Between two f16 values, a tie rounds to the even one: 1 + 2^-11 -> 1.0; 1 + 3*2^-11 -> 1+2^-9.
  CHECK(f32_to_f16_bits(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  CHECK(f32_to_f16_bits(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
}

TEST_CASE("f16 conversion matches exact rounding on a sweep of f32 values", "[unit]") {
  // Compare with rounding computed in double: nearest f16 value, ties to even.
  for (uint32_t u = 0x33000000u; u < 0x477ff000u; u += 0x1357u) {  // below 65520
    const float f = bits_float(u);
    const uint16_t got = f32_to_f16_bits(f);
    const double lo = f16_bits_to_f32(got);
    const double hi = f16_bits_to_f32(static_cast<uint16_t>(got + 1));
    const double below = got > 0 ? f16_bits_to_f32(static_cast<uint16_t>(got - 1)) : -1.0;
    INFO("f32 bits " << u);
    // got is the nearest: neither neighbour is strictly closer.
    if (std::isfinite(hi)) REQUIRE(std::fabs(f - lo) <= std::fabs(hi - f));
    REQUIRE(std::fabs(f - lo) <= std::fabs(f - below));
  }
}
