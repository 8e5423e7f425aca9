// Reward failures that must not go unnoticed: each entry's own failure limit, a refused token
// stopping the run at the first call, the fallback fraction as a metric and a warning, from the
// RewardSet up to a tandem train job.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/hf.h"
#include "model/weights.h"
#include "rewards/factory.h"
#include "rewards/remote.h"
#include "rewards/reward_set.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/report.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;

// Fails every call (throws) or, with `every_other`, scores 1 on even samples and fails odd ones.
class Failing : public RewardFunction {
 public:
  Failing(std::string name, bool every_other) : name_(std::move(name)), every_other_(every_other) {}
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override {
    if (!every_other_) throw tandem::Error("judge unavailable");
    std::vector<RewardResult> r;
    for (size_t i = 0; i < samples.size(); ++i)
      r.push_back(i % 2 == 0 ? RewardResult::success(1.0) : RewardResult::failure("odd sample"));
    return r;
  }
  const std::string& name() const override { return name_; }

 private:
  std::string name_;
  bool every_other_;
};

// The example C++ server with a token, as a process; its port.
int start_server(tandem::test::Subprocess& server) {
  const std::string line = server.wait_for_line("listening on ", 10000);
  REQUIRE(!line.empty());
  return std::stoi(line.substr(13));
}

// A job of `steps` steps on the tiny model with the given [[rewards]] entries.
tandem::test::CommandResult run_job(const tandem::test::TempDir& tmp, const std::string& rewards,
                                    int steps, const std::string& env = "") {
  if (!fs::exists(tmp.file("model"))) tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = tmp.write("job.toml", R"(
[model]
path = ")" + tmp.file("model") + R"("
[data]
synthetic_size = 32
max_prompt_tokens = 96
[rollout]
prompts_per_step = 2
n = 2
max_new_tokens = 4
num_blocks = 64
[trainer]
steps = )" + std::to_string(steps) + R"(
[checkpoint]
every = 0
[eval]
every = 0
[logging]
samples_every = 0
)" + rewards);
  return tandem::test::run_tandem("train " + job + " logging.dir=" + tmp.file("run") +
                                      " checkpoint.dir=" + tmp.file("run/ckpt"),
                                  true, 300, env);
}

}  // namespace

TEST_CASE("each reward entry stops the run at its own consecutive failure limit", "[unit]") {
  const std::vector<RewardSample> samples(4);
  for (bool strict_first : {true, false}) {
    auto a = std::make_shared<Failing>("a", false);
    auto b = std::make_shared<Failing>("b", false);
    RewardSet set({{a, 1.0, {}, strict_first ? 2 : 5}, {b, 1.0, {}, strict_first ? 5 : 2}},
                  {.timeout_s = 0, .max_consecutive_failures = 100});
    set.score(samples);
    CHECK_THROWS_WITH(set.score(samples),
                      Contains(std::string("reward function '") + (strict_first ? "a" : "b") +
                               "' failed 2 calls in a row"));
  }
  // The set's limit holds for an entry without its own.
  auto c = std::make_shared<Failing>("c", false);
  RewardSet set({{c}}, {.timeout_s = 0, .max_consecutive_failures = 1});
  CHECK_THROWS_WITH(set.score(samples), Contains("'c' failed 1 calls in a row"));
  CHECK_THROWS_WITH(RewardSet({{c, 1.0, {}, -1}}), Contains("max_consecutive_failures"));

  // From a config list, as make_reward_set reads it.
  const auto entries = nlohmann::json::parse(R"([
    {"kind": "math_answer", "name": "m", "max_consecutive_failures": 1},
    {"kind": "math_answer", "name": "n", "max_consecutive_failures": 50}])");
  RewardSet from_json = make_reward_set(entries, {.timeout_s = 0});
  // No reference answer: the math reward fails every sample, so every call fails.
  CHECK_THROWS_WITH(from_json.score(samples), Contains("'m' failed 1 calls in a row"));
}

TEST_CASE("the fallback fraction of each reward is a metric of the batch", "[unit]") {
  auto half = std::make_shared<Failing>("half", true);
  auto none = std::make_shared<Failing>("none", false);
  RewardSet set({{half, 1.0, -1.0}, {none, 0.5, 0.0, 10}}, {.timeout_s = 0});
  const RewardBreakdown b = set.score(std::vector<RewardSample>(6));
  const nlohmann::json m = b.metrics();
  CHECK(m["reward/half/fallback_fraction"].get<double>() == 0.5);
  CHECK(m["reward/none/fallback_fraction"].get<double>() == 1.0);
  CHECK(m["reward/half/failed"].get<int64_t>() == 3);
  CHECK(b.total[0] == 1.0);
  CHECK(b.total[1] == -1.0);
}

TEST_CASE("report html draws the fallback fraction of each reward", "[unit]") {
  const tandem::test::TempDir tmp("report-fallbacks");
  std::string lines;
  for (int s = 1; s <= 4; ++s)
    lines += "{\"step\": " + std::to_string(s) + ", \"reward/mean\": 0.5, " +
             "\"reward/judge/fallback_fraction\": " + std::to_string(s * 0.25) +
             (s >= 3 ? ", \"reward/format/fallback_fraction\": 0" : "") + "}\n";
  const std::string html_path = tmp.file("report.html");
  tandem::trainer::write_report(tmp.write("metrics.jsonl", lines), html_path, "run");
  std::stringstream ss;
  ss << std::ifstream(html_path).rdbuf();
  const std::string html = ss.str();
  CHECK_THAT(html, Contains("reward fallbacks (fraction of samples)"));
  CHECK_THAT(html, Contains("data-key=\"reward/judge/fallback_fraction\" data-points=\"4\""));
  CHECK_THAT(html, Contains("data-key=\"reward/format/fallback_fraction\" data-points=\"2\""));
  CHECK_THAT(html, Contains(">judge</text>") && Contains(">format</text>"));  // the legend
}

TEST_CASE("a refused token stops a reward set at its first call", "[e2e]") {
  tandem::test::Subprocess server({std::string(TANDEM_BIN_DIR) + "/tandem_reward_server", "--port",
                                   "0", "--kind", "math_answer", "--token", "right"});
  const int port = start_server(server);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  for (double timeout_s : {0.0, 30.0}) {  // on the caller's thread, and on a call thread
    INFO("timeout_s " << timeout_s);
    auto entries = nlohmann::json::array(
        {{{"kind", "remote"},
          {"name", "judge"},
          {"max_consecutive_failures", 100},
          {"options", {{"address", address}, {"token", "wrong"}, {"retries", 3}}}}});
    RewardSet set = make_reward_set(entries, {.timeout_s = timeout_s});
    std::vector<RewardSample> samples(3);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(set.score(samples), FatalRewardError);
    CHECK_THROWS_WITH(set.score(samples), Contains("reward 'judge' (remote " + address + ")") &&
                                              Contains("the token is wrong or missing"));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));  // no retries
  }
  CHECK(server.stop() == 0);
}

TEST_CASE("tandem train stops at the first step when a remote reward refuses the token", "[e2e]") {
  tandem::test::Subprocess server({std::string(TANDEM_BIN_DIR) + "/tandem_reward_server", "--port",
                                   "0", "--kind", "math_answer", "--token", "right"});
  const int port = start_server(server);
  const tandem::test::TempDir tmp("train-wrong-token");
  const auto r = run_job(tmp,
                         "[[rewards]]\nname = \"judge\"\nkind = \"remote\"\naddress = "
                         "\"127.0.0.1:" +
                             std::to_string(port) + "\"\ntoken_env = \"TANDEM_TEST_TOKEN\"\n",
                         3, "TANDEM_TEST_TOKEN=wrong");
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK_THAT(r.out, Contains("reward 'judge' (remote 127.0.0.1:" + std::to_string(port) + ")") &&
                        Contains("the token is wrong or missing"));
  CHECK(r.out.find("step 1/3") == std::string::npos);  // no step trained on fallbacks
  CHECK(server.stop() == 0);
}

TEST_CASE("tandem train honours each reward's failure limit and warns about fallbacks", "[e2e]") {
  const std::string plugin = std::string(TANDEM_LIB_DIR) + "/libfailing_reward.so";
  const tandem::test::TempDir tmp("train-failure-limits");
  // The plugin fails every batch: its own limit of 2 must stop the job at step 2, although the
  // last entry allows 100.
  const auto r = run_job(tmp,
                         "[[rewards]]\nname = \"flaky\"\nkind = \"plugin\"\npath = \"" + plugin +
                             "\"\nconfig = \"score\"\nmax_consecutive_failures = 2\n"
                             "[[rewards]]\nname = \"digit\"\nfunction = \"regex_format\"\n"
                             "pattern = '.*'\nmax_consecutive_failures = 100\n",
                         4);
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK_THAT(r.out, Contains("reward function 'flaky' failed 2 calls in a row"));
  CHECK_THAT(r.out, Contains("reward 'flaky': 4 of 4 samples got the fallback 0; first error: "
                             "sample 0: plugin '") &&
                        Contains("failing on purpose in score"));
  const auto metrics = tmp.file("run/metrics.jsonl");
  std::ifstream in(metrics);
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) {
    const auto m = nlohmann::json::parse(line);
    if (!m.contains("loss")) continue;
    ++steps;
    CHECK(m["reward/flaky/fallback_fraction"].get<double>() == 1.0);
    CHECK(m["reward/digit/fallback_fraction"].get<double>() == 0.0);
  }
  CHECK(steps == 1);
}
