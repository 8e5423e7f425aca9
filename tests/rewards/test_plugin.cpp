// Reward plugins through the tandem_reward_v1 C ABI: the example plugin, failing variants and bad
// paths.
#include <catch2/catch.hpp>

#include "core/error.h"
#include "rewards/factory.h"
#include "rewards/plugin.h"
#include "rewards/reward_set.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;

namespace {
const std::string kLibDir = TANDEM_LIB_DIR;
std::string lib(const char* name) { return kLibDir + "/lib" + name + ".so"; }
std::vector<RewardSample> samples() {
  std::vector<RewardSample> s(3);
  s[0].completion = "the answer is 4";
  s[1].completion = "no idea";
  s[2].completion = std::string("answer\0with a NUL", 17);
  s[2].extra = {{"id", 3}};
  return s;
}
}  // namespace

TEST_CASE("the example keyword plugin loads and scores a batch", "[unit]") {
  auto reward =
      make_reward("plugin", "keyword", {{"path", lib("keyword_reward")}, {"config", "answer"}});
  CHECK(reward->name() == "keyword");
  const auto results = reward->score(samples());
  REQUIRE(results.size() == 3);
  CHECK(results[0].value == 1.0);
  CHECK(results[1].value == 0.0);
  CHECK(results[2].value == 1.0);
  for (const auto& r : results) CHECK(r.ok);
  CHECK(reward->score({}).empty());
  CHECK_THROWS_WITH(PluginReward("keyword", lib("keyword_reward"), ""),
                    Contains("init with config '' returned 1") &&
                        Contains("the config string must be the keyword"));
}

TEST_CASE("plugin errors come back as results or clear load errors", "[unit]") {
  PluginReward ok("fine", lib("failing_reward"), "fine");
  CHECK(ok.score(samples())[1].value == 0.5);

  PluginReward score_fails("bad", lib("failing_reward"), "score");
  const auto results = score_fails.score(samples());
  REQUIRE(results.size() == 3);
  for (const auto& r : results) {
    CHECK_FALSE(r.ok);
    CHECK_THAT(r.error, Contains("score returned 5") && Contains("failing on purpose in score"));
  }

  auto nan = std::make_shared<PluginReward>("nan", lib("failing_reward"), "nan");
  RewardSet set({{nan, 1.0}}, {.fallback = 0.0, .timeout_s = 5, .max_consecutive_failures = 2});
  const auto b = set.score(samples());
  CHECK(b.values[0] == std::vector<double>{0, 0, 0});
  CHECK(set.stats()[0].non_finite == 3);
  CHECK_THROWS_WITH(set.score(samples()), Contains("reward function 'nan' failed 2 calls"));

  CHECK_THROWS_WITH(
      PluginReward("bad", lib("failing_reward"), "init"),
      Contains("reward 'bad'") && Contains("returned 7") && Contains("failing on purpose in init"));
  CHECK_THROWS_WITH(PluginReward("old", lib("wrong_abi_reward"), "x"),
                    Contains("ABI version 2, expected 1"));
  CHECK_THROWS_WITH(PluginReward("partial", lib("missing_symbol_reward"), "x"),
                    Contains("does not export 'tandem_reward_v1_free'"));
}

TEST_CASE("a bad plugin path gives an error naming the reward and the path", "[unit]") {
  CHECK_THROWS_WITH(make_reward("plugin", "mine", {{"path", "/nonexistent/libnope.so"}}),
                    Contains("reward 'mine'") && Contains("/nonexistent/libnope.so") &&
                        Contains("cannot load plugin"));
  CHECK_THROWS_WITH(make_reward("plugin", "mine", {{"config", "x"}}),
                    Contains("option 'path' is required"));
  // A file that is not a shared library.
  CHECK_THROWS_WITH(PluginReward("text", std::string(TANDEM_BIN_DIR) + "/../CMakeCache.txt", ""),
                    Contains("cannot load plugin"));
}
