// Reward plugins in a child process: a segfault costs one batch (fallback scores, counted), the
// next batch is scored by a new process, and load errors read as they do in-process.
#include <signal.h>
#include <catch2/catch.hpp>

#include <string>

#include "rewards/factory.h"
#include "rewards/plugin.h"
#include "rewards/reward_set.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;

namespace {

const std::string kLib = TANDEM_LIB_DIR;

std::vector<RewardSample> completions(std::initializer_list<const char*> texts) {
  std::vector<RewardSample> s;
  for (const char* t : texts) s.push_back({.completion = t});
  return s;
}

}  // namespace

TEST_CASE("an isolated plugin that segfaults fails one batch and the next is scored again",
          "[unit]") {
  auto plugin = std::make_shared<PluginReward>("crashy", kLib + "/libfailing_reward.so", "segv");
  REQUIRE(plugin->isolated());
  RewardSet set({{plugin, 1.0, -1.0}}, {.timeout_s = 30, .max_consecutive_failures = 3});

  const RewardBreakdown ok = set.score(completions({"a", "b"}));
  CHECK(ok.total == std::vector<double>{0.5, 0.5});

  for (int round = 1; round <= 2; ++round) {
    const RewardBreakdown crashed = set.score(completions({"a", "segv", "c"}));
    CHECK(crashed.total == std::vector<double>(3, -1.0));  // the whole batch falls back
    CHECK(plugin->crashes() == round);
    CHECK(set.stats()[0].errors >= 3 * round);
    CHECK_THAT(set.stats()[0].last_error, Contains("its process was killed by signal 11") &&
                                              Contains("a new process scores the next batch"));
    CHECK(crashed.metrics()["reward/crashy/fallback_fraction"].get<double>() == 1.0);

    // A new process scores the next batch.
    const RewardBreakdown again = set.score(completions({"x", "y", "z", "w"}));
    CHECK(again.total == std::vector<double>(4, 0.5));
  }
  CHECK(plugin->crashes() == 2);
}

TEST_CASE("an isolated plugin reports load errors and return codes like an in-process one",
          "[unit]") {
  for (bool isolate : {true, false}) {
    INFO("isolate " << isolate);
    const PluginReward::Options o{.isolate = isolate};
    CHECK_THROWS_WITH(PluginReward("p", kLib + "/libfailing_reward.so", "init", o),
                      Contains("init with config 'init' returned 7: failing on purpose in init"));
    CHECK_THROWS_WITH(PluginReward("p", kLib + "/libwrong_abi_reward.so", "", o),
                      Contains("has reward ABI version 2, expected 1"));
    CHECK_THROWS_WITH(PluginReward("p", kLib + "/no_such_plugin.so", "", o),
                      Contains("cannot load plugin"));
    PluginReward failing("p", kLib + "/libfailing_reward.so", "score", o);
    const auto r = failing.score(completions({"a", "b"}));
    REQUIRE(r.size() == 2);
    CHECK_FALSE(r[1].ok);
    CHECK_THAT(r[1].error, Contains("score returned 5: failing on purpose in score"));
    PluginReward nan("p", kLib + "/libfailing_reward.so", "nan", o);
    CHECK(std::isnan(nan.score(completions({"a"}))[0].value));
  }
  // The config key, with isolation on by default.
  auto made = make_reward("plugin", "k", {{"path", kLib + "/libfailing_reward.so"}});
  CHECK(dynamic_cast<PluginReward&>(*made).isolated());
  auto inproc =
      make_reward("plugin", "k", {{"path", kLib + "/libfailing_reward.so"}, {"isolate", false}});
  CHECK_FALSE(dynamic_cast<PluginReward&>(*inproc).isolated());
}

TEST_CASE("an isolated plugin carries every sample field to the plugin and back", "[unit]") {
  // The "fields" mode scores a weighted sum of every field's length and value.
  std::vector<RewardSample> samples;
  for (int i = 0; i < 50; ++i) {
    RewardSample s;
    s.prompt = std::string(static_cast<size_t>(i * 7), 'p');
    s.completion = std::string(static_cast<size_t>(i % 11), 'x');
    s.answer = i % 2 == 0 ? "42" : "";
    s.extra = {{"i", i}};
    s.completion_tokens = i;
    s.truncated = i % 5 == 0;
    samples.push_back(std::move(s));
  }
  PluginReward iso("f", kLib + "/libfailing_reward.so", "fields", {.isolate = true});
  PluginReward local("f", kLib + "/libfailing_reward.so", "fields", {.isolate = false});
  const auto a = iso.score(samples);
  const auto b = local.score(samples);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].ok == b[i].ok);
    CHECK(a[i].value == b[i].value);
  }
  CHECK(b[3].value == 21 + 2 * 3 + 0 + 5 * 7 + 7 * 3);  // {"i":3} is 7 bytes
  CHECK(iso.crashes() == 0);
}
