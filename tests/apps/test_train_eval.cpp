// tandem train's held-out eval: pass@1 printed, recorded and charted with its 95% interval.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testutil.h"
#include "trainer/pass_interval.h"

namespace fs = std::filesystem;

TEST_CASE("tandem train prints records and charts held-out pass at 1 with its 95 percent interval",
          "[e2e]") {
  const fs::path repo = TANDEM_SOURCE_DIR;
  REQUIRE(fs::exists(repo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const tandem::test::TempDir tmp("train-eval");
  // One step of configs/default.toml; greedy eval of 5 prompts before and after it.
  const auto r = tandem::test::run_tandem(
      "train " + (repo / "configs" / "default.toml").string() +
      " model.path=" + (repo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string() +
      " rollout.prompts_per_step=2 rollout.n=2 rollout.max_new_tokens=8 trainer.steps=1 "
      "trainer.schedule.warmup_steps=0"
      " eval.every=1 eval.max_prompts=5 eval.pass_k=1 eval.temperature=0 checkpoint.every=0"
      " logging.dir=" +
      tmp.file("run") + " checkpoint.dir=" + tmp.file("run/ckpt"));
  INFO(r.out);
  REQUIRE(r.status == 0);

  std::vector<nlohmann::json> evals;
  std::ifstream in(tmp.file("run/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto m = nlohmann::json::parse(line);
    if (m.contains("eval/pass@1")) evals.push_back(m);
  }
  REQUIRE(evals.size() == 2);  // before the step and after it
  for (const auto& m : evals) {
    INFO(m.dump());
    CHECK(m["eval/prompts"].get<int>() == 5);
    CHECK(m["eval/k"].get<int>() == 1);
    CHECK(!m.contains("eval/pass@k"));  // pass@1 itself with one sample per prompt
    const double p = m["eval/pass@1"].get<double>();
    double low = 0, high = 0;
    tandem::trainer::wilson_interval(p * 5, 5, low, high);
    CHECK(m["eval/pass@1_low"].get<double>() == Approx(low));
    CHECK(m["eval/pass@1_high"].get<double>() == Approx(high));
    CHECK(high - low > 0.3);  // 5 prompts tell little, and the interval says so
    CHECK(m["eval/time_s"].get<double>() > 0);

    // The eval line on stderr carries the same numbers.
    char expected[160];
    std::snprintf(expected, sizeof(expected),
                  "tandem: eval at step %d: pass@1 %.3f (95%% interval %.3f-%.3f; 5 prompts x 1)",
                  m["step"].get<int>(), p, low, high);
    CHECK(r.out.find(expected) != std::string::npos);
  }
  CHECK(std::regex_search(r.out, std::regex(R"(held-out pass@1 [0-9.]+ \[[0-9.]+, [0-9.]+\] -> )"
                                            R"([0-9.]+ \[[0-9.]+, [0-9.]+\] \(95% intervals, )"
                                            R"(5 prompts\))")));

  std::stringstream html;
  html << std::ifstream(tmp.file("run/report.html")).rdbuf();
  CHECK(html.str().find("data-key=\"eval/pass@1\" data-points=\"2\"") != std::string::npos);
  size_t bars = 0;
  for (size_t at = 0; (at = html.str().find("class=\"interval\" data-key=\"eval/pass@1\"", at)) !=
                      std::string::npos;
       ++at)
    ++bars;
  CHECK(bars == 2);
}
