// report.html: every chart drawn from metrics.jsonl, one point per metric line that has the key.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "tests/testutil.h"
#include "trainer/report.h"

TEST_CASE("report html draws a chart per metric with one point per step", "[unit]") {
  const tandem::test::TempDir tmp("report");
  std::string lines = R"({"step": 0, "eval/pass@1": 0.25, "eval/pass@k": 0.5})"
                      "\nnot json\n";
  for (int s = 1; s <= 5; ++s) {
    lines += "{\"step\": " + std::to_string(s) + ", \"reward/mean\": " + std::to_string(0.1 * s) +
             ", \"kl_ref\": 0.01, \"entropy\": 1.5, \"tokens_per_s\": 100, \"time/train_s\": 2}\n";
  }
  lines += R"({"step": 5, "eval/pass@1": 0.75, "eval/pass@1_low": 0.6, "eval/pass@1_high": 0.85, )"
           R"("eval/pass@k": 1.0})"
           "\n";
  const std::string metrics = tmp.write("metrics.jsonl", lines);
  const std::string html_path = tmp.file("report.html");
  tandem::trainer::write_report(metrics, html_path, "run <1>");
  std::stringstream ss;
  ss << std::ifstream(html_path).rdbuf();
  const std::string html = ss.str();
  CHECK(html.find("<title>run &lt;1&gt;</title>") != std::string::npos);
  CHECK(html.find("8 metric lines") == std::string::npos);  // "not json" is skipped
  CHECK(html.find("7 metric lines") != std::string::npos);
  CHECK(html.find("data-key=\"reward/mean\" data-points=\"5\"") != std::string::npos);
  CHECK(html.find("data-key=\"eval/pass@1\" data-points=\"2\"") != std::string::npos);
  // Only the eval line with an interval gets an error bar.
  CHECK(html.find("class=\"interval\" data-key=\"eval/pass@1\"") != std::string::npos);
  CHECK(html.find("class=\"interval\"") == html.rfind("class=\"interval\""));
  CHECK(html.find("data-key=\"time/train_s\" data-points=\"5\"") != std::string::npos);
  // A chart without data says so instead of drawing nothing; an optional chart whose metrics the
  // run never logged (the rollout/trainer logprob difference) is left out.
  CHECK(html.find("no data yet") != std::string::npos);
  CHECK(html.find("rollout vs trainer") == std::string::npos);
  const std::string with_diff =
      tmp.write("metrics2.jsonl", lines + R"({"step": 6, "rollout_trainer_logp/max_abs": 0.03, )"
                                          R"("rollout_trainer_logp/mean_abs": 0.002})"
                                          "\n");
  tandem::trainer::write_report(with_diff, html_path, "run 2");
  std::stringstream ss2;
  ss2 << std::ifstream(html_path).rdbuf();
  CHECK(ss2.str().find("rollout vs trainer logprob") != std::string::npos);
  CHECK(ss2.str().find("data-key=\"rollout_trainer_logp/max_abs\" data-points=\"1\"") !=
        std::string::npos);
  CHECK(html.find("<script") == std::string::npos);
}

TEST_CASE("a report write that fails leaves no temporary file and names the report", "[unit]") {
  const tandem::test::TempDir tmp("report-fail");
  const std::string metrics = tmp.write("metrics.jsonl", "{\"step\": 1, \"reward/mean\": 0.5}\n");
  // report.html is a directory holding a file: the rename of report.html.tmp onto it fails.
  const std::string html_path = tmp.file("report.html");
  std::filesystem::create_directory(html_path);
  tmp.write("report.html/keep", "x");
  try {
    tandem::trainer::write_report(metrics, html_path, "run");
    FAIL("the write succeeded");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find(html_path + ": write failed") != std::string::npos);
    CHECK(what.find("free space or move logging.dir") != std::string::npos);
  }
  CHECK(!std::filesystem::exists(html_path + ".tmp"));
  CHECK(std::filesystem::exists(tmp.file("report.html/keep")));
}
