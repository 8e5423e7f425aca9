// The tandem command: --version and `bench kernels --json` as a user runs them.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <sstream>
#include <string>

#include "tests/testutil.h"

namespace {

using Run = tandem::test::CommandResult;
Run run(const std::string& args, bool merge_stderr = true) {
  return tandem::test::run_tandem(args, merge_stderr);
}

}  // namespace

TEST_CASE("tandem --version names the version commit backends and GPU state", "[e2e]") {
  const Run r = run("--version");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("tandem 0.1.0 (commit ") == 0);
  CHECK(r.out.find("\ncuda: ") != std::string::npos);
  CHECK(r.out.find("\nnccl: ") != std::string::npos);
  CHECK(r.out.find("\ngpu: ") != std::string::npos);
}

TEST_CASE("tandem bench kernels --json prints one valid measurement per line", "[e2e]") {
  const Run r = run("bench kernels --json --quick --min-seconds 0.01 --filter cast");
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
    CHECK(j["value"].get<double>() > 0);
    CHECK(j.contains("fraction_of_limit"));
  }
  CHECK(measurements >= 1);
}

TEST_CASE("tandem rejects an unknown benchmark with a non-zero exit", "[e2e]") {
  const Run r = run("bench nothing");
  CHECK(r.status != 0);
  CHECK(r.out.find("nothing") != std::string::npos);
}
