// report.html as a user sees it: headless Chromium opens the report of a short `tandem train` run;
// its DOM holds every chart with its data points and its screenshot shows the lines drawn.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;

tandem::test::CommandResult shell(const std::string& cmd) { return tandem::test::run_shell(cmd); }

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("report html renders its charts with data points in headless Chromium", "[e2e]") {
  const std::string chromium = shell("command -v chromium").out;
  if (chromium.empty())
    FAIL("chromium is not installed: run scripts/setup (it installs the Debian package chromium)");
  REQUIRE(fs::exists(kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const tandem::test::TempDir tmp("report-browser");
  const auto run = tandem::test::run_tandem(tandem::test::short_default_train_args(tmp), true, 300);
  INFO(run.out);
  REQUIRE(run.status == 0);
  const std::string report = fs::absolute(tmp.file("run/report.html")).string();
  REQUIRE(fs::exists(report));

  // Every wait is bounded: timeout ends Chromium (and -k kills it) if it hangs. --no-sandbox:
  // tests may run as root; a profile of its own keeps parallel runs apart.
  const std::string browser =
      "timeout -k 5 90 chromium --headless --no-sandbox --disable-gpu "
      "--hide-scrollbars --no-first-run --user-data-dir=" +
      tmp.file("profile") + " --window-size=1400,1250 ";
  const std::string url = "file://" + report;
  const auto dom = shell(browser + "--dump-dom " + url + " 2>" + tmp.file("dom.log"));
  INFO(read_text(tmp.file("dom.log")));
  REQUIRE(dom.status == 0);
  // The DOM after Chromium parsed and laid out the page: eleven charts, each line with its points.
  CHECK(count(dom.out, "<svg") == 11);
  CHECK(dom.out.find("data-key=\"reward/mean\" data-points=\"2\"") != std::string::npos);
  CHECK(dom.out.find("data-key=\"eval/pass@1\" data-points=\"3\"") != std::string::npos);
  CHECK(dom.out.find("data-key=\"memory/peak_rss_mib\" data-points=\"2\"") != std::string::npos);
  CHECK(count(dom.out, "<polyline class=\"series\"") >= 15);
  CHECK(count(dom.out, "<circle") >= 30);
  CHECK(dom.out.find("no data yet") == std::string::npos);  // every chart has its data

  const std::string png = tmp.file("report.png");
  const auto shot = shell(browser + "--screenshot=" + png + " " + url + " 2>&1");
  INFO(shot.out);
  REQUIRE(shot.status == 0);
  REQUIRE(fs::exists(png));
  // Decoded by a small standard-library reader: not blank, and the lines are drawn in their
  // colours (reward #1f77b4, pass@1 #2ca02c, entropy #9467bd).
  const auto stats = shell("timeout 120 python3 " + (kRepo / "tests/apps/png_stats.py").string() +
                           " " + png + " 1f77b4 2ca02c 9467bd");
  INFO(stats.out);
  REQUIRE(stats.status == 0);
  const nlohmann::json s = nlohmann::json::parse(stats.out);
  CHECK(s["width"] == 1400);
  CHECK(s["height"] == 1250);
  CHECK(s["luma_std"].get<double>() > 5.0);
  CHECK(s["distinct_colors"].get<int>() > 100);
  CHECK(s["non_white_fraction"].get<double>() > 0.01);
  for (const char* color : {"1f77b4", "2ca02c", "9467bd"}) {
    INFO(color);
    CHECK(s["color_pixels"][color].get<int>() > 100);
  }
}
