// Sample shaping: overlong penalty, dynamic-sampling filter, truncation mask, max-variance
// down-sampling.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <vector>

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

TEST_CASE("max-variance down-sampling keeps the lowest and highest rewards of largest variance",
          "[unit]") {
  // Two of four correct among eight: two of each, the earliest of equal rewards; {0, 0, 1, 1}
  // from one low and three high ties in variance and loses to the balanced split.
  const std::vector<float> binary = {1, 0, 0, 0, 1, 0, 0, 0};
  CHECK(max_variance_subset(binary, 4) == std::vector<size_t>{0, 1, 2, 4});
  // m at or above the group's size: every sample, in order.
  CHECK(max_variance_subset(binary, 8) == std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(max_variance_subset(binary, 20).size() == 8);
  // All equal: no signal either way; still the balanced split of the (stable) sorted order.
  CHECK(max_variance_subset(std::vector<float>(6, 0.5f), 3) == std::vector<size_t>{0, 4, 5});
  // Graded rewards: the extremes.
  CHECK(max_variance_subset(std::vector<float>{0.3f, 0.9f, 0.1f, 0.5f, 0.7f}, 2) ==
        std::vector<size_t>{1, 2});

  // Against every subset of small random groups: no subset of m has a larger variance.
  std::mt19937 rng(3);
  auto variance = [](const std::vector<float>& r, const std::vector<size_t>& idx) {
    double s = 0, q = 0;
    for (size_t i : idx) {
      s += r[i];
      q += static_cast<double>(r[i]) * r[i];
    }
    const double mean = s / static_cast<double>(idx.size());
    return q / static_cast<double>(idx.size()) - mean * mean;
  };
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 2 + rng() % 9;
    std::vector<float> r(n);
    for (float& x : r) x = static_cast<float>(rng() % 5) * 0.25f;  // ties, as rewards have
    const size_t m = 1 + rng() % n;
    const std::vector<size_t> got = max_variance_subset(r, m);
    REQUIRE(got.size() == m);
    REQUIRE(std::is_sorted(got.begin(), got.end()));
    double best = -1;
    for (uint32_t mask = 0; mask < (1u << n); ++mask) {
      if (static_cast<size_t>(__builtin_popcount(mask)) != m) continue;
      std::vector<size_t> idx;
      for (size_t i = 0; i < n; ++i)
        if (mask >> i & 1) idx.push_back(i);
      best = std::max(best, variance(r, idx));
    }
    INFO("trial " << trial << " n " << n << " m " << m);
    CHECK(variance(r, got) == Approx(best).margin(1e-9));
  }
}
