// The logprob canary of `tandem train` (weight_sync.canary): after every publish it logs how far
// the rollout engines' logprobs of a fixed probe are from the trainer's (0 at one f32 rank), and an
// engine shard corrupted after a publish with checksums off (the job worker's
// --corrupt-engine-weights) stops the job, naming the step, the version, the replica and the
// difference, before any step trains on that engine's samples; at one rank, on one of two
// data-parallel replicas, in a tensor-parallel replica of 2 ranks, and beside a trainer of 2
// pipeline stages (a tensor-parallel trainer's and a pipeline's canary logs 0).
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/apps/dp_job.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/job_config.h"

namespace {

using tandem::test::dp_job::job_worker_bin;
using tandem::test::dp_job::step_lines;
using tandem::test::dp_job::tandem_bin;

// dp_job's tiny job (4 prompts x 4 samples of 8 tokens a step) for two steps, with the canary on
// and a probe of 8 tokens, on `ranks` processes into tmp/<name>: `tandem train`, or with a
// `corrupt` spec the job worker that corrupts an engine's weights (RANK:VERSION:PARAMETER).
tandem::test::CommandResult train(const tandem::test::TempDir& tmp, int ranks,
                                  const std::string& name, const std::string& overrides,
                                  const std::string& corrupt = "") {
  const std::string job = tandem::test::dp_job::write_job(tmp, tmp.file("model"));
  const std::string command = fmt::format(
      "{} {} logging.dir={} checkpoint.dir={} trainer.steps=2 weight_sync.canary=true "
      "weight_sync.canary_tokens=8 weight_sync.checksums=false {}{}",
      corrupt.empty() ? tandem_bin() + " train" : job_worker_bin(), job, tmp.file(name),
      tmp.file(name + "/ckpt"), overrides,
      corrupt.empty() ? "" : " --corrupt-engine-weights " + corrupt);
  if (ranks == 1) return tandem::test::run_shell("timeout -k 5 120 " + command + " 2>&1");
  return tandem::test::run_tandem(
      fmt::format("launch --nproc {} --grace-s 2 -- {}", ranks, command), true, 120);
}

// A run the canary stopped after the first step's publish, naming `replica` alone, before that
// step's metrics line.
void check_stopped(const tandem::test::CommandResult& r, const std::string& metrics,
                   const std::string& replica) {
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK_THAT(r.out, Catch::Contains("after the publish of step 1 (weight version 1)"));
  CHECK_THAT(r.out, Catch::Contains("on " + replica + " by up to "));
  CHECK_THAT(r.out, !Catch::Contains("replica 0"));
  CHECK(step_lines(metrics).empty());
}

}  // namespace

TEST_CASE("the weight_sync canary logs 0 at one f32 rank and passes a bf16 engine", "[e2e]") {
  const tandem::test::TempDir tmp("canary-pass");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const auto f32 = train(tmp, 1, "f32", "");
  INFO(f32.out);
  REQUIRE(f32.status == 0);
  const auto a = step_lines(tmp.file("f32/metrics.jsonl"));
  REQUIRE(a.size() == 2);
  for (const auto& m : a) {
    INFO(m.dump());
    // The engine reads the trainer's tensors with the same kernels: bitwise equal.
    CHECK(m["weight_sync/canary_max_abs"].get<double>() == 0);
    CHECK(m["time/canary_s"].get<double>() > 0);
  }
  // Resumed from its last checkpoint, the job checks the weights it resumes with, then goes on.
  const auto resumed = train(tmp, 1, "f32", "trainer.steps=3");
  INFO(resumed.out);
  REQUIRE(resumed.status == 0);
  CHECK_THAT(resumed.out, Catch::Contains("resumed from"));
  const auto c = step_lines(tmp.file("f32/metrics.jsonl"));
  REQUIRE(c.size() == 3);
  CHECK(c[2]["weight_sync/canary_max_abs"].get<double>() == 0);

  const auto bf16 = train(tmp, 1, "bf16", "rollout.dtype=bf16");
  INFO(bf16.out);
  REQUIRE(bf16.status == 0);
  const auto b = step_lines(tmp.file("bf16/metrics.jsonl"));
  REQUIRE(b.size() == 2);
  for (const auto& m : b) {
    INFO(m.dump());
    // A rounded copy: close, not equal, and within the default tolerance of a bf16 engine.
    const double d = m["weight_sync/canary_max_abs"].get<double>();
    CHECK(d > 0);
    CHECK(d < tandem::trainer::kCanaryToleranceBf16);
  }
}

TEST_CASE("the weight_sync canary stops a job whose engine weights were corrupted after a publish",
          "[e2e]") {
  const tandem::test::TempDir tmp("canary-corrupt");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // The engine's own (bf16) copy, corrupted after the publish of step 2: step 1 is recorded, and
  // the job stops before step 3 generates from those weights.
  const auto r = train(tmp, 1, "run", "rollout.dtype=bf16", "0:2:model.norm.weight");
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK_THAT(r.out, Catch::Contains("rank 0 corrupts element 0 of its engine's model.norm.weight "
                                    "after publishing version 2"));
  CHECK_THAT(r.out, Catch::Contains("weight_sync canary: after the publish of step 2 (weight "
                                    "version 2) the rollout engine's logprobs of the probe's 8 "
                                    "greedy tokens differ from the trainer's by more than "
                                    "weight_sync.canary_tolerance = 2 "));
  CHECK_THAT(r.out, Catch::Contains("on replica 0 (rank 0) by up to "));
  CHECK(step_lines(tmp.file("run/metrics.jsonl")).size() == 1);
}

TEST_CASE("the weight_sync canary names the one replica of 2 data-parallel ranks that differs",
          "[multiproc]") {
  const tandem::test::TempDir tmp("canary-dp");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Two replicas of one rank, bf16 engines; rank 1's copy corrupted after the first publish.
  check_stopped(train(tmp, 2, "run", "rollout.dtype=bf16", "1:1:model.norm.weight"),
                tmp.file("run/metrics.jsonl"), "replica 1 (rank 1)");
}

TEST_CASE("the weight_sync canary catches a corrupted shard of a tensor-parallel engine",
          "[multiproc]") {
  const tandem::test::TempDir tmp("canary-tp");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const auto ok = train(tmp, 2, "ok", "placement.rollout_tp=2 rollout.seed=5");
  INFO(ok.out);
  REQUIRE(ok.status == 0);
  const auto a = step_lines(tmp.file("ok/metrics.jsonl"));
  REQUIRE(a.size() == 2);
  for (const auto& m : a) {
    INFO(m.dump());
    // The shards' partial sums are added in another order than the trainer's: rounding only.
    CHECK(m["weight_sync/canary_max_abs"].get<double>() < 1e-4);
  }

  // Rank 1's shard of layer 0's MLP down projection (row-parallel), corrupted after the first
  // step's publish: both ranks of the replica stop, before step 2 trains on its samples.
  const auto bad = train(tmp, 2, "bad", "placement.rollout_tp=2 rollout.seed=5",
                         "1:1:model.layers.0.mlp.down_proj.weight");
  INFO(bad.out);
  CHECK(bad.status != 0);
  CHECK_THAT(bad.out, Catch::Contains("weight_sync canary: after the publish of step 1 (weight "
                                      "version 1)"));
  CHECK_THAT(bad.out, Catch::Contains("on replica 0 (ranks 0-1) by up to "));
  CHECK(step_lines(tmp.file("bad/metrics.jsonl")).empty());
}

TEST_CASE("the weight_sync canary checks the engines of a tensor- and pipeline-parallel trainer",
          "[multiproc]") {
  const tandem::test::TempDir tmp("canary-grid");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Engines split as the trainer (tensor 2), and whole engines beside 2 pipeline stages: every
  // rank scores both replicas' probes in one call, the last stage's values count; the same bits.
  for (const std::string& layout :
       {std::string("trainer.tp=2 placement.rollout_tp=2"), std::string("trainer.pp=2")}) {
    INFO(layout);
    const auto ok = train(tmp, 2, "ok", layout + " rollout.seed=5");
    INFO(ok.out);
    REQUIRE(ok.status == 0);
    const auto steps = step_lines(tmp.file("ok/metrics.jsonl"));
    REQUIRE(steps.size() == 2);
    for (const auto& m : steps) CHECK(m["weight_sync/canary_max_abs"].get<double>() == 0);
    std::filesystem::remove_all(tmp.file("ok"));
  }

  // Stage 1's engine (rank 1, replica 1) corrupted after the first publish: stage 0 does not
  // compute the logprobs, stage 1 does, and every rank stops naming replica 1.
  check_stopped(train(tmp, 2, "bad", "trainer.pp=2 rollout.seed=5", "1:1:model.norm.weight"),
                tmp.file("bad/metrics.jsonl"), "replica 1 (rank 1)");
}
