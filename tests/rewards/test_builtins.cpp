// The built-in reward functions other than math: exact match, regex format, length penalty, and
// the factory that builds them all from JSON options.
#include <catch2/catch.hpp>

#include "core/error.h"
#include "rewards/builtins.h"
#include "rewards/factory.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;

namespace {
std::vector<double> values(RewardFunction& f, const std::vector<RewardSample>& samples) {
  std::vector<double> out;
  for (const RewardResult& r : f.score(samples)) {
    REQUIRE(r.ok);
    out.push_back(r.value);
  }
  return out;
}
RewardSample completion(std::string text, int64_t tokens = 0, bool truncated = false) {
  RewardSample s;
  s.completion = std::move(text);
  s.completion_tokens = tokens;
  s.truncated = truncated;
  return s;
}
}  // namespace

TEST_CASE("exact match compares trimmed text and optionally ignores case", "[unit]") {
  const std::vector<RewardSample> samples = {{.completion = "  Paris\n", .answer = "Paris"},
                                             {.completion = "paris", .answer = "Paris "},
                                             {.completion = "Paris!", .answer = "Paris"}};
  ExactMatchReward exact("exact", {});
  CHECK(values(exact, samples) == std::vector<double>{1, 0, 0});
  ExactMatchReward caseless("caseless", {.case_insensitive = true, .match = 2, .mismatch = -1});
  CHECK(values(caseless, samples) == std::vector<double>{2, 2, -1});
}

TEST_CASE("regex format reward full-matches or searches and rejects a bad pattern", "[unit]") {
  const std::vector<RewardSample> samples = {
      completion("<think>a\nb</think><answer>4</answer>"), completion("<answer>4</answer>"),
      completion("text <answer>4</answer> after"), completion("\xff\xfe not utf-8")};
  RegexFormatReward full("fmt", {.pattern = "<think>.*</think><answer>.*</answer>"});
  CHECK(values(full, samples) == std::vector<double>{1, 0, 0, 0});
  RegexFormatReward search("fmt", {.pattern = "<answer>\\d+</answer>", .full_match = false});
  CHECK(values(search, samples) == std::vector<double>{1, 1, 1, 0});
  RegexFormatReward no_dotall("fmt", {.pattern = "<think>.*</think>.*", .dotall = false});
  CHECK(values(no_dotall, samples)[0] == 0);
  CHECK_THROWS_WITH(RegexFormatReward("fmt", {.pattern = "(unclosed"}),
                    Contains("reward 'fmt' option 'pattern'") && Contains("offset"));
}

TEST_CASE("length penalty is zero up to the target then linear and capped", "[unit]") {
  LengthPenaltyReward linear("len", {.target_tokens = 100, .per_token = 0.01});
  const std::vector<RewardSample> samples = {completion("", 50), completion("", 100),
                                             completion("", 150), completion("", 1000, true)};
  const auto v = values(linear, samples);
  CHECK(v[0] == 0.0);
  CHECK(v[1] == 0.0);
  CHECK(v[2] == Approx(-0.5));
  CHECK(v[3] == Approx(-9.0));
  LengthPenaltyReward capped(
      "len", {.target_tokens = 100, .per_token = 0.01, .max_penalty = 1.0, .truncated_penalty = 2});
  const auto c = values(capped, samples);
  CHECK(c[2] == Approx(-0.5));
  CHECK(c[3] == Approx(-2.0));
  CHECK(capped.score(std::vector{completion("", 500)})[0].value == Approx(-1.0));
  CHECK_FALSE(linear.score(std::vector{completion("", -1)})[0].ok);
  CHECK_THROWS_AS(LengthPenaltyReward("len", {.target_tokens = -1}), tandem::Error);
}

TEST_CASE("the reward factory builds every built-in and names bad options", "[unit]") {
  using nlohmann::json;
  CHECK(make_reward("math_answer", "m", json::object())->name() == "m");
  CHECK(make_reward("exact_match", "e", {{"case_insensitive", true}})->name() == "e");
  auto fmt = make_reward("regex_format", "f", {{"pattern", "a+"}, {"full_match", true}});
  CHECK(fmt->score(std::vector{completion("aaa")})[0].value == 1.0);
  auto len = make_reward("length_penalty", "l", {{"target_tokens", 10}, {"per_token", 1}});
  CHECK(len->score(std::vector{completion("", 12)})[0].value == -2.0);
  CHECK_THROWS_WITH(make_reward("banana", "b", {}), Contains("unknown kind 'banana'"));
  CHECK_THROWS_WITH(make_reward("math_answer", "m", {{"last_number", true}}),
                    Contains("reward 'm'") && Contains("unknown option 'last_number'"));
  CHECK_THROWS_WITH(make_reward("regex_format", "f", json::object()),
                    Contains("option 'pattern' is required"));
  CHECK_THROWS_WITH(make_reward("length_penalty", "l", {{"target_tokens", "ten"}}),
                    Contains("option 'target_tokens' must be an integer") && Contains("string"));
  CHECK_THROWS_WITH(make_reward("exact_match", "e", json::array()),
                    Contains("options must be an object"));
}

TEST_CASE("a reward set is built from a JSON list and names the bad entry", "[unit]") {
  using nlohmann::json;
  const json entries = json::parse(R"([
    {"kind": "math_answer", "weight": 1.0},
    {"kind": "regex_format", "name": "format", "weight": 0.5, "fallback": -1,
     "options": {"pattern": "#### .*", "full_match": false}}
  ])");
  RewardSet set = make_reward_set(entries);
  REQUIRE(set.stats().size() == 2);
  CHECK(set.stats()[0].name == "math_answer");
  RewardSample s = completion("so #### 7");
  s.answer = "#### 7";
  CHECK(set.score(std::vector{s}).total[0] == Approx(1.5));
  CHECK_THROWS_WITH(make_reward_set(json::array()), Contains("non-empty list"));
  CHECK_THROWS_WITH(make_reward_set(json::parse(R"([{"kind": "exact_match", "wieght": 2}])")),
                    Contains("rewards[0] (exact_match): unknown key 'wieght'"));
  CHECK_THROWS_WITH(make_reward_set(json::parse(R"([{"kind": "exact_match"}, {"name": "x"}])")),
                    Contains("rewards[1]: 'kind' must be a string"));
  CHECK_THROWS_WITH(make_reward_set(json::parse(R"([{"kind": "exact_match", "weight": "2"}])")),
                    Contains("'weight' has the wrong type"));
}
