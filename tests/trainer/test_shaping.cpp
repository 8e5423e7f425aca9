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
  const std::vector<float> rewards = {1, 1, 1, 0, 1, 0.5f, 0.5f, 0, 0};
  const std::vector<int32_t> sizes = {3, 2, 1, 1, 2};
  CHECK(groups_with_signal(rewards, sizes) == std::vector<int32_t>{1});
  const std::vector<int32_t> bad = {3, 3};
  CHECK_THROWS_WITH(groups_with_signal(rewards, bad), Catch::Contains("rewards"));
}

TEST_CASE("truncated samples are masked only when asked", "[unit]") {
  const bool t[] = {false, true, false};
  CHECK(loss_mask(t, false) == std::vector<bool>{true, true, true});
  CHECK(loss_mask(t, true) == std::vector<bool>{true, false, true});
}
