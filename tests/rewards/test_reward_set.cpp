// RewardSet: weights and breakdown, and functions that throw, return NaN, hang or keep failing.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include "core/error.h"
#include "rewards/builtins.h"
#include "rewards/reward_set.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;

namespace {

// A reward function whose behaviour the test scripts per call.
class Scripted : public RewardFunction {
 public:
  using Body = std::function<std::vector<RewardResult>(std::span<const RewardSample>)>;
  Scripted(std::string name, Body body) : name_(std::move(name)), body_(std::move(body)) {}
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override {
    return body_(samples);
  }
  const std::string& name() const override { return name_; }

 private:
  std::string name_;
  Body body_;
};

std::vector<RewardSample> batch(size_t n) {
  std::vector<RewardSample> samples(n);
  for (size_t i = 0; i < n; ++i) {
    samples[i].completion = "#### " + std::to_string(i + 1);
    samples[i].answer = "#### 2";
    samples[i].completion_tokens = static_cast<int64_t>(10 * (i + 1));
  }
  return samples;
}

std::vector<RewardResult> constant(size_t n, double v) {
  return std::vector<RewardResult>(n, RewardResult::success(v));
}

}  // namespace

TEST_CASE("reward set adds weighted functions and breaks them down per function", "[unit]") {
  RewardSet set({{std::make_shared<MathAnswerReward>("math", MathAnswerReward::Options{}), 2.0},
                 {std::make_shared<LengthPenaltyReward>(
                      "len", LengthPenaltyReward::Options{.target_tokens = 20, .per_token = 0.1}),
                  0.5}});
  const auto samples = batch(3);  // answers 1, 2, 3 (2 is right); 10, 20, 30 tokens
  const RewardBreakdown b = set.score(samples);
  REQUIRE(b.names == std::vector<std::string>{"math", "len"});
  CHECK(b.values[0] == std::vector<double>{0, 1, 0});
  CHECK(b.values[1][0] == 0.0);
  CHECK(b.values[1][2] == Approx(-1.0));
  CHECK(b.total[0] == 0.0);
  CHECK(b.total[1] == Approx(2.0));
  CHECK(b.total[2] == Approx(-0.5));
  const auto m = b.metrics();
  CHECK(m["reward/math/mean"].get<double>() == Approx(1.0 / 3));
  CHECK(m["reward/mean"].get<double>() == Approx(1.5 / 3));
  CHECK(m["reward/len/failed"].get<int64_t>() == 0);
  CHECK(set.stats_json()["math"]["calls"] == 1);
  CHECK_THROWS_WITH(
      RewardSet({{std::make_shared<ExactMatchReward>("a", ExactMatchReward::Options{})},
                 {std::make_shared<ExactMatchReward>("a", ExactMatchReward::Options{})}}),
      Contains("two reward functions are named 'a'"));
}

TEST_CASE("throwing NaN and slow reward functions give the fallback and the run continues",
          "[unit]") {
  std::atomic<int> calls{0};
  auto flaky = std::make_shared<Scripted>("flaky", [&](std::span<const RewardSample> s) {
    const int call = calls++;
    if (call == 0) throw std::runtime_error("boom");
    std::vector<RewardResult> r = constant(s.size(), 1.0);
    if (call == 1) r[1].value = std::nan("");
    if (call == 2) r[0].value = INFINITY;
    if (call == 3) r[2] = RewardResult::failure("cannot judge");
    return r;
  });
  std::atomic<bool> release{false};
  std::atomic<bool> slow_finished{false};
  std::atomic<int> slow_calls{0};
  auto slow = std::make_shared<Scripted>("slow", [&](std::span<const RewardSample> s) {
    if (slow_calls++ == 0) {  // hangs until released
      for (int i = 0; i < 500 && !release; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      slow_finished = true;
    }
    return constant(s.size(), 0.5);
  });
  RewardSet set({{flaky, 1.0, -1.0}, {slow, 1.0}},
                {.fallback = 0.25, .timeout_s = 0.2, .max_consecutive_failures = 3});
  const auto samples = batch(3);

  const auto start = std::chrono::steady_clock::now();
  RewardBreakdown b = set.score(samples);  // flaky throws, slow hangs
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(3));
  CHECK(b.values[0] == std::vector<double>{-1, -1, -1});  // the per-function fallback
  CHECK(b.values[1] == std::vector<double>{0.25, 0.25, 0.25});
  CHECK_THAT(b.call_errors[0], Contains("boom"));
  CHECK_THAT(b.call_errors[1], Contains("did not return within"));

  b = set.score(samples);  // flaky: a NaN; slow: still running, refused at once
  CHECK(b.values[0] == std::vector<double>{1, -1, 1});
  CHECK(b.failed[0] == std::vector<uint8_t>{0, 1, 0});
  CHECK_THAT(b.call_errors[1], Contains("still running"));

  release = true;
  for (int i = 0; i < 300 && !slow_finished; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(slow_finished);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its thread publishes the result

  b = set.score(samples);  // flaky: an infinity; slow is back
  CHECK(b.values[0] == std::vector<double>{-1, 1, 1});
  CHECK(b.values[1] == std::vector<double>{0.5, 0.5, 0.5});
  b = set.score(samples);  // flaky: ok == false on one sample
  CHECK(b.values[0] == std::vector<double>{1, 1, -1});
  CHECK(b.total[2] == Approx(-0.5));

  const auto& flaky_stats = set.stats()[0];
  CHECK(flaky_stats.calls == 4);
  CHECK(flaky_stats.thrown == 1);
  CHECK(flaky_stats.non_finite == 2);
  CHECK(flaky_stats.errors == 1);
  CHECK(flaky_stats.failed_samples == 3 + 1 + 1 + 1);
  CHECK(flaky_stats.failed_calls == 1);
  const auto& slow_stats = set.stats()[1];
  CHECK(slow_stats.timed_out == 2);
  CHECK(slow_stats.failed_samples == 6);
  CHECK(slow_stats.consecutive_failed_calls == 0);
  CHECK(set.stats_json()["slow"]["timed_out"] == 2);
}

TEST_CASE("consecutive failed calls stop the run with the function named", "[unit]") {
  int calls = 0;
  auto broken = std::make_shared<Scripted>("broken_judge", [&](std::span<const RewardSample> s) {
    ++calls;
    if (calls == 2) return constant(s.size(), 1.0);  // one success resets the count
    if (calls % 2 == 1) throw std::runtime_error("judge offline");
    return std::vector<RewardResult>(s.size(), RewardResult::success(NAN));
  });
  RewardSet set({{broken, 1.0}}, {.timeout_s = 0, .max_consecutive_failures = 3});
  const auto samples = batch(2);
  set.score(samples);  // fails (1)
  set.score(samples);  // succeeds: 0
  set.score(samples);  // fails (1)
  set.score(samples);  // all NaN: fails (2)
  CHECK_THROWS_WITH(set.score(samples), Contains("reward function 'broken_judge' failed 3 calls "
                                                 "in a row") &&
                                            Contains("judge offline"));

  RewardSet wrong_size({{std::make_shared<Scripted>(
                             "short", [](std::span<const RewardSample>) { return constant(1, 1); }),
                         1.0}},
                       {.timeout_s = 5, .max_consecutive_failures = 1});
  CHECK_THROWS_WITH(wrong_size.score(samples), Contains("returned 1 results for 2 samples"));
}
