// docs/config.md's table of environment variables against the sources: every name the product's
// sources pass to getenv is listed there (or among the launchers' rank variables below it).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;

// The section "## Environment variables" of docs/config.md, up to the next section.
std::string environment_section() {
  const std::string doc = tandem::test::read_text(kRepo / "docs/config.md");
  const size_t begin = doc.find("## Environment variables\n");
  REQUIRE(begin != std::string::npos);
  const size_t end = doc.find("\n## ", begin + 1);
  return doc.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// name -> "file:line" of each getenv("NAME") in the product's sources.
std::map<std::string, std::string> getenv_names() {
  const std::regex call(R"re(getenv\(\s*"([A-Za-z0-9_]+)"\s*\))re");
  std::map<std::string, std::string> names;
  for (const char* dir : {"core", "kernels", "model", "rollout", "rewards", "weight_sync",
                          "trainer", "apps", "bench"}) {
    for (const auto& e : fs::recursive_directory_iterator(kRepo / dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".cu" && ext != ".cuh"))
        continue;
      std::ifstream in(e.path());
      int line_no = 0;
      for (std::string line; std::getline(in, line);) {
        ++line_no;
        for (std::sregex_iterator m(line.begin(), line.end(), call), end; m != end; ++m)
          names.emplace((*m)[1].str(),
                        fs::relative(e.path(), kRepo).string() + ":" + std::to_string(line_no));
      }
    }
  }
  return names;
}

}  // namespace

TEST_CASE("docs config.md lists every environment variable the sources read", "[unit]") {
  const std::string section = environment_section();
  const auto names = getenv_names();
  // The sources read some: the thread pool's, the log level's, the launchers'.
  REQUIRE(names.count("TANDEM_NUM_THREADS") == 1);
  REQUIRE(names.count("RANK") == 1);
  for (const auto& [name, where] : names) {
    INFO(name << " (read at " << where << ") is missing from docs/config.md, "
              << "\"Environment variables\": add a row saying what reads it and why it is not a "
                 "job key");
    CHECK(section.find("`" + name + "`") != std::string::npos);
  }
  // No test hook and no switch beside a job key among them.
  for (const char* gone : {"TANDEM_TEST_STALL_CHECKPOINT", "TANDEM_TEST_CORRUPT_ENGINE_WEIGHTS",
                           "TANDEM_CPU_MATMUL_KERNEL", "TANDEM_CPU_MATMUL_BACKWARD"}) {
    INFO(gone);
    CHECK(names.count(gone) == 0);
  }
}
