// The tandem command: --version, the help without a subcommand, how errors read (--verbose),
// `bench kernels --json`, `bench step --json` and `bench train --json` (on the bundled model,
// scripts/fetch-model) as a user runs them.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testutil.h"

namespace {

using Run = tandem::test::CommandResult;
Run run(const std::string& args, bool merge_stderr = true) {
  return tandem::test::run_tandem(args, merge_stderr);
}

// `tandem bench <args>` with its Python peer left out (minutes of work: the run reports it
// missing and fails): checks that, and returns the output's JSON rows.
std::vector<nlohmann::json> bench_rows_without_peer(const std::string& args) {
  const Run r = run(args + " --peer-python /nonexistent/python", /*merge_stderr=*/false);
  INFO(r.out);
  CHECK(r.status == 1);  // a missing peer fails the run
  std::vector<nlohmann::json> rows;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) rows.push_back(nlohmann::json::parse(line));
  REQUIRE(!rows.empty());
  return rows;
}

}  // namespace

TEST_CASE("tandem --version names the version commit backends GPU state and CPU family", "[e2e]") {
  const Run r = run("--version");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("tandem 0.1.0 (commit ") == 0);
  CHECK(r.out.find("\ncuda: ") != std::string::npos);
  CHECK(r.out.find("\nnccl: ") != std::string::npos);
  CHECK(r.out.find("\ngpu: ") != std::string::npos);
  // The CPU with its family numbers and the matmul paths (scripts/demo-table keys on this line).
  CHECK(std::regex_search(r.out, std::regex(R"(\ncpu: .+\(family [0-9]+ model [0-9]+\); )"
                                            R"(matmul f32 [a-z0-9]+, bf16 [a-z0-9-]+\n)")));
}

TEST_CASE("tandem bench kernels --json prints one valid measurement per line", "[e2e]") {
  // stdout alone: it carries the JSON lines, the log (warnings included) goes to stderr.
  const Run r = run("bench kernels --json --quick --min-seconds 0.01 --filter cast", false);
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::istringstream lines(r.out);
  std::string line;
  int measurements = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"bench", "case", "metric", "unit", "value"}) CHECK(j.contains(key));
    if (j["metric"] == "ceilings") continue;
    ++measurements;
    // Every row names the machine: the CPU model and the ISA paths the matmuls took.
    CHECK(j["cpu"].get<std::string>().find("family") != std::string::npos);
    CHECK(j["isa"].get<std::string>().starts_with("f32 "));
    CHECK(j["value"].get<double>() > 0);
    CHECK(j.contains("fraction_of_limit"));
  }
  CHECK(measurements >= 1);
}

TEST_CASE("tandem bench step --quick --json times each phase of real GRPO steps", "[e2e]") {
  const auto rows = bench_rows_without_peer("bench step --quick --json --filter f32");
  const nlohmann::json& step = rows[0];
  CHECK(step["bench"] == "step");
  CHECK(step["metric"] == "seconds_per_step");
  for (const auto& row : rows) CHECK(row["isa"].get<std::string>().starts_with("f32 "));
  const double seconds = step["value"].get<double>();
  CHECK(seconds > 0);
  // 2 prompts x 2 samples of at most 8 new tokens, one measured step.
  CHECK(step["response_tokens"].get<double>() >= 4);
  CHECK(step["response_tokens"].get<double>() <= 32);
  CHECK(step["step_seconds"].size() == 1);
  CHECK(step["peer_error"].get<std::string>().find("/nonexistent/python") != std::string::npos);
  double phases = 0;
  for (const char* p : {"rollout", "reward", "old_ref_logp", "update", "publish"}) {
    REQUIRE(step["phases"].contains(p));
    CHECK(step["phases"][p].get<double>() >= 0);
    phases += step["phases"][p].get<double>();
  }
  CHECK(step["phases"]["rollout"].get<double>() > 0);
  CHECK(step["phases"]["update"].get<double>() > 0);
  // The phases are the step, except the advantages' shaping and bookkeeping.
  CHECK(phases <= seconds);
  CHECK(phases >= 0.9 * seconds);
  int phase_lines = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const nlohmann::json& j = rows[i];
    CHECK(j["metric"] == "phase_seconds_per_step");
    CHECK(j["value"].get<double>() >= 0);
    ++phase_lines;
  }
  CHECK(phase_lines == 5);
}

TEST_CASE("tandem bench train --quick --json breaks the step into phases", "[e2e]") {
  const auto rows = bench_rows_without_peer("bench train --quick --json --filter f32");
  const nlohmann::json& row = rows[0];
  CHECK(row["metric"] == "train_tokens_per_s");
  for (const auto& r : rows) CHECK(r.contains("cpu"));
  const double step_s = row["step_ms"].get<double>() / 1e3;
  double sum = 0;
  for (const auto& [name, seconds] : row["phases"].items()) sum += seconds.get<double>();
  // The phases, "outside the ops" included, are the whole step.
  CHECK(sum == Approx(step_s).epsilon(1e-6));
  for (const char* p : {"matmul forward", "matmul backward dX", "matmul backward dW",
                        "lm_head forward", "lm_head dX", "lm_head dW", "attention forward",
                        "attention backward", "AdamW", "gradient norm"})
    CHECK(row["phases"][p].get<double>() > 0);
  int phase_rows = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const nlohmann::json& j = rows[i];
    CHECK(j["metric"] == "phase_seconds_per_step");
    CHECK(j["fraction_of_step"].get<double>() >= 0);
    if (j["case"].get<std::string>().ends_with(": lm_head dW")) CHECK(j["gflop"].get<double>() > 0);
    ++phase_rows;
  }
  CHECK(phase_rows == static_cast<int>(row["phases"].size()));
}

TEST_CASE("tandem rejects an unknown benchmark with a non-zero exit", "[e2e]") {
  const Run r = run("bench nothing");
  CHECK(r.status != 0);
  CHECK(r.out.find("nothing") != std::string::npos);
}

TEST_CASE("tandem without a subcommand prints the help and exits non-zero", "[e2e]") {
  const Run r = run("");
  INFO(r.out);
  CHECK(r.status == 1);
  for (const char* sub : {"train", "generate", "score", "convert", "bench", "--version"})
    CHECK(r.out.find(sub) != std::string::npos);
}

TEST_CASE("tandem errors show the sentence and --verbose adds the failed check and place",
          "[e2e]") {
  Run r = run("bench kernels --device tpu");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out == "tandem: error: --device 'tpu': use cpu or cuda[:N]\n");
  // --verbose belongs to tandem and is taken after the subcommand too.
  for (const std::string args :
       {"--verbose bench kernels --device tpu", "bench kernels --device tpu --verbose"}) {
    r = run(args);
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(r.out.find("tandem: error: --device 'tpu': use cpu or cuda[:N] [check failed: "
                     "bench_device == \"cpu\"] (") != std::string::npos);
    CHECK(r.out.find("apps/tandem.cpp:") != std::string::npos);
  }
}
