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

TEST_CASE("report html tables each rank's largest memory peak by class over the run", "[unit]") {
  const tandem::test::TempDir tmp("report-memory");
  std::string lines;
  for (int s = 1; s <= 3; ++s) {
    const double kv = s == 2 ? 40 : 10;  // the run's peak is step 2's, not the last step's
    lines += "{\"step\": " + std::to_string(s) + R"(, "memory/weights_peak_mib": 5, )" +
             R"("memory/peak_rss_mib": 300, )";
    for (int r = 0; r < 2; ++r) {
      const std::string p = "\"memory/rank" + std::to_string(r) + "/";
      lines += p + "weights_peak_mib\": " + std::to_string(5 - 2 * r) + ", " + p +
               "kv_cache_peak_mib\": " + std::to_string(kv + r) + ", " + p +
               "arena_peak_mib\": 50, " + p + "peak_rss_mib\": " + std::to_string(300 + r) +
               (r == 1 ? "}\n" : ", ");
    }
  }
  const std::string html_path = tmp.file("report.html");
  tandem::trainer::write_report(tmp.write("metrics.jsonl", lines), html_path, "run");
  std::stringstream ss;
  ss << std::ifstream(html_path).rdbuf();
  const std::string html = ss.str();
  INFO(html);
  CHECK(html.find("peak memory by class and rank (MiB)") != std::string::npos);
  CHECK(html.find("<th>weights</th><th>gradients</th><th>optimizer</th><th>activations</th>"
                  "<th>kv_cache</th><th>arenas together</th><th>process peak RSS</th>") !=
        std::string::npos);
  // Unlogged classes show "-"; the kv_cache column keeps step 2's peak.
  CHECK(html.find("<tr data-rank=\"0\"><td>0</td><td>5.0</td><td>-</td><td>-</td><td>-</td>"
                  "<td>40.0</td><td>50.0</td><td>300.0</td></tr>") != std::string::npos);
  CHECK(html.find("<tr data-rank=\"1\"><td>1</td><td>3.0</td><td>-</td><td>-</td><td>-</td>"
                  "<td>41.0</td><td>50.0</td><td>301.0</td></tr>") != std::string::npos);
  CHECK(html.find("data-rank=\"2\"") == std::string::npos);

  // A run that logged only its RSS has no table.
  tandem::trainer::write_report(
      tmp.write("rss.jsonl", "{\"step\": 1, \"memory/peak_rss_mib\": 300}\n"), html_path, "run");
  std::stringstream ss2;
  ss2 << std::ifstream(html_path).rdbuf();
  CHECK(ss2.str().find("peak memory by class and rank") == std::string::npos);
}
