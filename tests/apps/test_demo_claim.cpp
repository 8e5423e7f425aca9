// The README's demo claim holds: on a CPU family the README lists (scripts/demo-table), the demo
// job with seed 1, run as the README says, ends with the README's `held-out pass@1 ...` line; on
// another family one short step of the same command must run and print such a line (not where the
// f32 matmuls take the portable kernel, far too slow for it).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

struct Claim {
  std::string family;  // `tandem --version`'s "cpu:" line
  std::string line;    // seed 1's final "held-out pass@1 ..." line
};

// The text between <!-- demo-table:begin --> and <!-- demo-table:end -->; "" when there is none.
std::string demo_block(const std::string& readme) {
  const std::string begin = "<!-- demo-table:begin -->", end = "<!-- demo-table:end -->";
  const size_t b = readme.find(begin), e = readme.find(end);
  if (b == std::string::npos || e == std::string::npos || e < b) return "";
  return readme.substr(b + begin.size(), e - b - begin.size());
}

// The block's per-family rows: | <family> | `held-out pass@1 ...` | <when> |
std::vector<Claim> claims_of(const std::string& block) {
  static const std::regex row(R"(^\| ([^|`]+?) \| `(held-out pass@1 [^`]+)` \| [^|]+ \|$)");
  std::vector<Claim> claims;
  std::istringstream lines(block);
  std::smatch m;
  for (std::string line; std::getline(lines, line);)
    if (std::regex_match(line, m, row)) claims.push_back({m[1].str(), m[2].str()});
  return claims;
}

const std::regex kFinalLine(
    R"(held-out pass@1 [0-9.]+ \[[0-9.]+, [0-9.]+\] -> [0-9.]+ \[[0-9.]+, [0-9.]+\] )"
    R"(\(95% intervals, [0-9]+ prompts\))");

}  // namespace

TEST_CASE("the demo claim parser reads the per-family rows of the demo block only", "[unit]") {
  const std::string readme =
      "| outside | `held-out pass@1 0.1 [0.0, 0.2] -> 0.2 [0.1, 0.3] (95% intervals, 1 prompts)` "
      "| x |\n<!-- demo-table:begin -->\ntext\n| seed | pass@1 |\n"
      "| Intel X (family 6 model 207); matmul f32 avx512, bf16 amx | `held-out pass@1 0.242 "
      "[0.176, 0.323] -> 0.797 [0.719, 0.857] (95% intervals, 128 prompts)` | 2026-12-05 08:40 "
      "UTC, commit abc1234 |\n"
      "<!-- demo-table:end -->\n";
  const auto claims = claims_of(demo_block(readme));
  REQUIRE(claims.size() == 1);
  CHECK(claims[0].family == "Intel X (family 6 model 207); matmul f32 avx512, bf16 amx");
  CHECK(claims[0].line.ends_with("0.797 [0.719, 0.857] (95% intervals, 128 prompts)"));
  CHECK(std::regex_match(claims[0].line, kFinalLine));
  CHECK(demo_block("no markers").empty());
}

TEST_CASE("the demo with seed 1 ends with the held-out pass at 1 the README claims for this CPU",
          "[slow]") {
  const fs::path repo = TANDEM_SOURCE_DIR;
  REQUIRE(fs::exists(repo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const std::string readme = tandem::test::read_text(repo / "README.md");
  REQUIRE(readme.find("<!-- demo-table:begin -->") != std::string::npos);
  const std::string block = demo_block(readme);
  INFO("README.md's demo block (scripts/demo-table --update-readme writes it):\n" << block);
  const auto claims = claims_of(block);
  for (const Claim& c : claims) {
    INFO(c.line);
    CHECK(std::regex_match(c.line, kFinalLine));
  }
  // A block with results states the command; it is the one run here.
  if (!claims.empty())
    REQUIRE(
        block.find("`build/bin/tandem train configs/default.toml data.seed=S rollout.seed=S`") !=
        std::string::npos);

  const auto version = tandem::test::run_tandem("--version", /*merge_stderr=*/false);
  REQUIRE(version.status == 0);
  const size_t at = version.out.find("\ncpu: ");
  REQUIRE(at != std::string::npos);
  const size_t from = at + 6;
  const std::string family = version.out.substr(from, version.out.find('\n', from) - from);
  const Claim* claim = nullptr;
  for (const Claim& c : claims)
    if (c.family == family) claim = &c;
  // On a family the README lists, the demo exactly as the README states; elsewhere one short step
  // of the same command, to check that it runs and prints the line, unless the matmuls would take
  // the portable kernel (no AVX-512), far too slow for even one step of SmolLM2.
  std::string shorter;
  if (claim == nullptr) {
    WARN("README.md states no demo result for this CPU family ("
         << family << "): scripts/demo-table --update-readme on this machine adds its row");
    if (family.find("matmul f32 portable") != std::string::npos) {
      WARN("not running the demo: the f32 matmuls take the portable kernel on this CPU");
      return;
    }
    // (One step leaves no room for the default schedule's warmup.)
    shorter =
        " trainer.steps=1 trainer.schedule.warmup_steps=0 eval.max_prompts=8 checkpoint.every=0";
  }
  const tandem::test::TempDir tmp("demo-claim");
  const int limit_s = 1150;  // under scripts/test's ctest --timeout 1200
  const auto r = tandem::test::run_shell(
      "cd '" + repo.string() + "' && timeout -k 5 " + std::to_string(limit_s) + " " +
      std::string(TANDEM_BIN_DIR) +
      "/tandem train configs/default.toml data.seed=1 rollout.seed=1 logging.dir=" +
      tmp.file("run") + " checkpoint.dir=" + tmp.file("run/checkpoints") + shorter + " 2>&1");
  if (r.status == 124 || r.status == 137)
    FAIL("the demo did not finish within " << limit_s << " s (a loaded machine?)");
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::smatch printed;
  REQUIRE(std::regex_search(r.out, printed, kFinalLine));
  if (claim != nullptr) {
    INFO("README.md claims for " << family << ": " << claim->line
                                 << "\nwhen a change alters the demo's result, rerun "
                                    "scripts/demo-table --update-readme and commit the README");
    CHECK(printed.str() == claim->line);
  }
}
