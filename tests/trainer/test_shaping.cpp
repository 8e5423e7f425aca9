// Sample shaping: overlong penalty, dynamic-sampling filter, truncation mask.
#include <catch2/catch.hpp>

#include "trainer/shaping.h"

using namespace tandem::trainer;

TEST_CASE("soft overlong penalty is 0 then linear then the full factor", "[unit]") {
  CHECK(overlong_penalty(100, 512, 128, 1.0f) == 0.0f);
  CHECK(overlong_penalty(384, 512, 128, 1.0f) == 0.0f);
  CHECK(overlong_penalty(448, 512, 128, 1.0f) == Approx(-0.5f));
  CHECK(overlong_penalty(512, 512, 128, 1.0f) == Approx(-1.0f));
  CHECK(overlong_penalty(600, 512, 128, 2.0f) == -2.0f);
  CHECK(overlong_penalty(512, 512, 0, 1.0f) == 0.0f);
  CHECK(overlong_penalty(513, 512, 0, 1.0f) == -1.0f);
  CHECK_THROWS_WITH(overlong_penalty(1, 512, 600, 1.0f), Catch::Contains("buffer"));
}

TEST_CASE("dynamic sampling keeps only groups whose rewards differ", "[unit]") {
  const std::vector<float> varied = {1, 0.5f, 1}, equal = {0.5f, 0.5f, 0.5f}, one = {1};
  CHECK(has_signal(varied));
  CHECK_FALSE(has_signal(equal));
  CHECK_FALSE(has_signal(one));
  CHECK_FALSE(has_signal({}));
}

TEST_CASE("truncated samples are masked only when asked", "[unit]") {
  CHECK(enters_loss(false, false));
  CHECK(enters_loss(true, false));
  CHECK(enters_loss(false, true));
  CHECK_FALSE(enters_loss(true, true));
}
