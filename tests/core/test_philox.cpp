// Philox-4x32-10 against the known-answer vectors of its authors (Random123 kat_vectors).
#include <catch2/catch.hpp>

#include "core/philox.h"

using namespace tandem;

TEST_CASE("philox4x32-10 matches the Random123 known answers", "[unit]") {
  const Philox4x32 zero = philox4x32_10(Philox4x32{{0, 0, 0, 0}}, 0, 0);
  CHECK(zero.v[0] == 0x6627e8d5u);
  CHECK(zero.v[1] == 0xe169c58du);
  CHECK(zero.v[2] == 0xbc57ac4cu);
  CHECK(zero.v[3] == 0x9b00dbd8u);

  const Philox4x32 ones = philox4x32_10(
      Philox4x32{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  CHECK(ones.v[0] == 0x408f276du);
  CHECK(ones.v[1] == 0x41c83b0eu);
  CHECK(ones.v[2] == 0xa20bc7c6u);
  CHECK(ones.v[3] == 0x6d5451fdu);

  const Philox4x32 pi = philox4x32_10(
      Philox4x32{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  CHECK(pi.v[0] == 0xd16cfe09u);
  CHECK(pi.v[1] == 0x94fdccebu);
  CHECK(pi.v[2] == 0x5001e420u);
  CHECK(pi.v[3] == 0x24126ea1u);
}

TEST_CASE("philox uniforms lie in the unit interval and differ across streams", "[unit]") {
  double sum = 0;
  for (uint64_t i = 0; i < 4096; ++i) {
    const Philox4x32 r = philox_random(42, 7, i);
    for (uint32_t w : r.v) {
      const float u = uniform_from_bits(w);
      REQUIRE(u >= 0.0f);
      REQUIRE(u < 1.0f);
      sum += u;
    }
  }
  CHECK(sum / (4096 * 4) == Approx(0.5).margin(0.01));
  CHECK(philox_random(42, 7, 0).v[0] != philox_random(42, 8, 0).v[0]);
  CHECK(philox_random(42, 7, 0).v[0] != philox_random(43, 7, 0).v[0]);
}
