// Held-out pass@1's 95% interval: Wilson's score interval against published values, over prompts.
#include <catch2/catch.hpp>

#include <vector>

#include "core/error.h"
#include "trainer/pass_interval.h"

using tandem::trainer::pass_at_1;
using tandem::trainer::wilson_interval;

TEST_CASE("pass at 1 carries the Wilson score interval over the evaluated prompts", "[unit]") {
  // Wilson 95% intervals, from Wilson's closed form evaluated apart (Python, double precision).
  struct Case {
    double successes, trials, low, high;
  };
  const Case cases[] = {{0, 10, 0.0, 0.2775328},         {5, 10, 0.2365931, 0.7634069},
                        {8, 10, 0.4901625, 0.9433178},   {10, 10, 0.7224672, 1.0},
                        {38, 128, 0.2245817, 0.3810052}, {110, 128, 0.7886475, 0.9091603}};
  for (const Case& c : cases) {
    double low = -1, high = -1;
    wilson_interval(c.successes, c.trials, low, high);
    INFO(c.successes << " of " << c.trials);
    CHECK(low == Approx(c.low).margin(1e-6));
    CHECK(high == Approx(c.high).margin(1e-6));
  }

  // One greedy sample per prompt: 3 of 8 prompts correct.
  const std::vector<double> greedy = {1, 0, 0, 1, 0, 0, 1, 0};
  const auto g = pass_at_1(greedy);
  double low = 0, high = 0;
  wilson_interval(3, 8, low, high);
  CHECK(g.prompts == 8);
  CHECK(g.pass1 == Approx(0.375));
  CHECK(g.low == Approx(low));
  CHECK(g.high == Approx(high));
  CHECK(g.low < g.pass1);
  CHECK(g.pass1 < g.high);

  // k = 4 samples per prompt: the interval counts prompts (10), not samples (40), so it is no
  // narrower than one sample per prompt would give at the same pass@1.
  const std::vector<double> sampled = {0.25, 0.5, 1, 0, 0.75, 0.5, 0.25, 1, 0.75, 0};
  const auto s = pass_at_1(sampled);
  CHECK(s.prompts == 10);
  CHECK(s.pass1 == Approx(0.5));
  CHECK(s.low == Approx(0.2365931).margin(1e-6));
  CHECK(s.high == Approx(0.7634069).margin(1e-6));
  double samples_low = 0, samples_high = 0;
  wilson_interval(20, 40, samples_low, samples_high);
  CHECK(s.high - s.low > samples_high - samples_low);

  const auto none = pass_at_1({});
  CHECK(none.prompts == 0);
  CHECK(none.low == 0);
  CHECK(none.high == 1);
  const std::vector<double> bad = {0.5, 1.5};
  CHECK_THROWS_AS(pass_at_1(bad), tandem::Error);
}
