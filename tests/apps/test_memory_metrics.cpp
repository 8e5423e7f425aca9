// Each rank's memory by class as a job logs it: the memory/<class>_peak_mib metrics of every step,
// per rank on several ranks, the report's table; and placement.rank_memory_limit_gb stopping a job
// at start when the cap is below what it needs.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "tests/apps/dp_job.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace {

using namespace tandem::test::dp_job;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr const char* kClasses[] = {"weights", "gradients", "optimizer", "activations", "kv_cache"};

double metric(const nlohmann::json& line, const std::string& key) {
  INFO(key);
  REQUIRE(line.contains(key));
  return line[key].get<double>();
}

}  // namespace

TEST_CASE("tandem train logs each step's peak memory by class under a cap it fits", "[e2e]") {
  const tandem::test::TempDir tmp("memory-metrics");
  // The policy's f32 weights, gradients and two AdamW moments are each twice the bf16 file.
  const double f32_mib = 2.0 * tandem::test::write_tiny_smollm2_hf(tmp.file("model")) / kMiB;
  const std::string job = write_tiny_job(tmp, tmp.file("model"));
  const auto r = train(tmp, job, 1, "run", "trainer.steps=2 placement.rank_memory_limit_gb=8");
  INFO(r.out);
  REQUIRE(r.status == 0);
  const auto steps = step_lines(tmp.file("run/metrics.jsonl"));
  REQUIRE(steps.size() == 2);
  for (const auto& m : steps) {
    INFO(m.dump());
    CHECK(metric(m, "memory/weights_peak_mib") >= f32_mib);
    CHECK(metric(m, "memory/gradients_peak_mib") >= f32_mib);
    CHECK(metric(m, "memory/optimizer_peak_mib") >= 2 * f32_mib);
    // The KV cache and the activations are taken again every step (placement.release_memory).
    CHECK(metric(m, "memory/activations_peak_mib") > 0);
    CHECK(metric(m, "memory/kv_cache_peak_mib") > 0);
    double sum = 0, largest = 0;
    for (const char* c : kClasses) {
      const double v = metric(m, fmt::format("memory/{}_peak_mib", c));
      sum += v;
      largest = std::max(largest, v);
    }
    const double arenas = metric(m, "memory/arena_peak_mib");
    CHECK(arenas >= largest);
    CHECK(arenas <= sum + 1e-9);
    CHECK(arenas <= 8 * 1024);  // under the cap
    CHECK(metric(m, "memory/peak_rss_mib") > 0);
    CHECK_FALSE(m.contains("memory/rank0/weights_peak_mib"));  // one rank
  }
  const std::string html = tandem::test::read_text(tmp.file("run/report.html"));
  CHECK(html.find("peak memory by class and rank (MiB)") != std::string::npos);
  CHECK(html.find("<tr data-rank=\"0\">") != std::string::npos);
  CHECK(html.find("<tr data-rank=\"1\">") == std::string::npos);
}

TEST_CASE("a rank memory limit below what the job needs stops it at start naming the key",
          "[e2e]") {
  const tandem::test::TempDir tmp("memory-cap");
  const double f32_mib = 2.0 * tandem::test::write_tiny_smollm2_hf(tmp.file("model")) / kMiB;
  const std::string job = write_tiny_job(tmp, tmp.file("model"));
  // Room for the policy's weights, not for its gradients and optimizer state besides.
  const double cap_gb = 1.5 * f32_mib / 1024;
  const auto r =
      train(tmp, job, 1, "run", fmt::format("placement.rank_memory_limit_gb={}", cap_gb));
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK(r.out.find("rank memory limit: reserving ") != std::string::npos);
  CHECK(r.out.find("over placement.rank_memory_limit_gb = ") != std::string::npos);
  CHECK(r.out.find("override 'placement.rank_memory_limit_gb=") != std::string::npos);
  CHECK(r.out.find("(held: weights ") != std::string::npos);
  CHECK(r.out.find("step 1/") == std::string::npos);
  CHECK(step_lines(tmp.file("run/metrics.jsonl")).empty());
}

TEST_CASE("tandem train on 2 ranks logs each rank's peak memory by class and tables it",
          "[multiproc]") {
  const tandem::test::TempDir tmp("memory-ranks");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto r = train(tmp, job, 2, "run", "trainer.steps=1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  const auto steps = step_lines(tmp.file("run/metrics.jsonl"));
  REQUIRE(steps.size() == 1);
  const nlohmann::json& m = steps[0];
  INFO(m.dump());
  for (const int rank : {0, 1}) {
    INFO("rank " << rank);
    const std::string p = fmt::format("memory/rank{}/", rank);
    // Every rank holds the whole policy and its gradients.
    CHECK(metric(m, p + "weights_peak_mib") > 0);
    CHECK(metric(m, p + "gradients_peak_mib") > 0);
    CHECK(metric(m, p + "kv_cache_peak_mib") > 0);
    CHECK(metric(m, p + "arena_peak_mib") >= metric(m, p + "weights_peak_mib"));
    CHECK(metric(m, p + "peak_rss_mib") > 0);
  }
  CHECK(metric(m, "memory/rank1/weights_peak_mib") == metric(m, "memory/rank0/weights_peak_mib"));
  // Rank 0's figures also stand alone, as on one rank.
  CHECK(metric(m, "memory/weights_peak_mib") == metric(m, "memory/rank0/weights_peak_mib"));
  CHECK_FALSE(m.contains("memory/rank2/weights_peak_mib"));
  const std::string html = tandem::test::read_text(tmp.file("run/report.html"));
  CHECK(html.find("<tr data-rank=\"0\">") != std::string::npos);
  CHECK(html.find("<tr data-rank=\"1\">") != std::string::npos);
}
