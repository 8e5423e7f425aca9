// The colocated job with a tensor- and pipeline-parallel trainer (trainer.tp, trainer.pp) over
// real processes (tandem launch, Gloo on loopback): layouts of up to 4 ranks with data parallelism
// beside them train the batches of 1 rank (deterministic mode: pipeline stages bitwise, tensor
// parallelism up to the rounding of its split sums); checkpoints are layout-free (one written
// under one layout resumes under another); a stage killed in the middle of the 1F1B schedule makes
// every rank exit within the timeout, the neighbours naming it.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/apps/dp_job.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

using tandem::test::TempDir;
using tandem::test::dp_job::job_worker_bin;
using tandem::test::dp_job::max_weight_diff;
using tandem::test::dp_job::step_lines;
using tandem::test::dp_job::write_job;

// The tiny random Llama of dp_job.h with 6 layers (pp = 2 and 3 split them) and an untied head
// (H = 4, Hkv = 2, F = 96, V = 49152: tp = 2 splits it). Untied, pipeline stages give one rank's
// gradients bitwise; a tied embedding's two copies add their gradients once a step instead of per
// micro-batch (docs/distributed.md).
void write_model(const TempDir& tmp) {
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"), 17, 6, false);
}

const std::string kDet = "trainer.deterministic=true rollout.seed=5";

struct Layout {
  int dp, tp, pp;
  int rollout_tp = 1;               // placement.rollout_tp
  std::string shard = "optimizer";  // trainer.shard
  int ranks() const { return dp * tp * pp; }
  std::string keys() const {
    return fmt::format("trainer.tp={} trainer.pp={} placement.rollout_tp={} trainer.shard={}", tp,
                       pp, rollout_tp, shard);
  }
  std::string name() const {
    return fmt::format("dp{}-tp{}-pp{}{}{}", dp, tp, pp,
                       rollout_tp > 1 ? fmt::format("-rtp{}", rollout_tp) : "",
                       shard == "optimizer" ? "" : "-" + shard);
  }
};

// The 3 step lines of a run that must succeed.
std::vector<nlohmann::json> run(const TempDir& tmp, const std::string& job, const Layout& l,
                                const std::string& overrides = "") {
  const auto r =
      tandem::test::dp_job::train(tmp, job, l.ranks(), l.name(), l.keys() + " " + overrides);
  INFO(r.out);
  REQUIRE(r.status == 0);
  if (l.tp * l.pp > 1) {
    // The rank map, printed by rank 0 at start.
    CHECK(r.out.find(fmt::format("trainer grid: {} ranks = data {} x tensor {} x pipeline {}",
                                 l.ranks(), l.dp, l.tp, l.pp)) != std::string::npos);
    CHECK(r.out.find(fmt::format("rank {}: dp {}, tp {}, pp {}", l.ranks() - 1, l.dp - 1, l.tp - 1,
                                 l.pp - 1)) != std::string::npos);
  }
  auto steps = step_lines(tmp.file(l.name() + "/metrics.jsonl"));
  REQUIRE(steps.size() == 3);
  return steps;
}

// Checks a layout's 3 steps and final weights against the one-rank run's: pipeline stages alone
// bitwise, tensor parallelism within the rounding of its split sums. The engines' logprobs are
// the trainer's bitwise when the engines split the model as the trainer does (the same ranks'
// parts added in rank order) or neither splits it.
void check_layout(const TempDir& tmp, const std::string& job, const Layout& l,
                  const std::vector<nlohmann::json>& one) {
  INFO(l.name());
  const auto b = run(tmp, job, l, kDet);
  const bool exact = l.tp == 1;
  for (size_t i = 0; i < 3; ++i) {
    INFO("step " << i + 1);
    CHECK(b[i]["distributed/ranks"] == l.ranks());
    CHECK(b[i]["distributed/trainer_tp"] == l.tp);
    CHECK(b[i]["distributed/trainer_pp"] == l.pp);
    // The same groups in the same order, whichever ranks generate and train each.
    CHECK(b[i]["samples_trained"] == one[i]["samples_trained"]);
    CHECK(b[i]["response_tokens"] == one[i]["response_tokens"]);
    CHECK(b[i]["reward/mean"].get<double>() == Approx(one[i]["reward/mean"].get<double>()));
    // Every engine holds its own copy, filled from the ranks' parts: the trainer recomputes the
    // old logprobs; they are the engine's bitwise unless the two split the sums differently.
    CHECK(b[i]["old_logp_recomputed"] == 1);
    CHECK(b[i]["weight_sync/copied_tensors"].get<int64_t>() > 0);
    const double logp = b[i]["rollout_trainer_logp/max_abs"].get<double>();
    const double loss = b[i]["loss"].get<double>(), loss1 = one[i]["loss"].get<double>();
    const double norm = b[i]["grad_norm"].get<double>(), norm1 = one[i]["grad_norm"].get<double>();
    if (l.rollout_tp == l.tp)
      CHECK(logp == 0);
    else
      CHECK(logp < 1e-4);
    if (exact) {
      CHECK(norm == norm1);
      // (The reported loss adds the micro-batches' parts in the last stage's order.)
      CHECK(std::abs(loss - loss1) <= 1e-12 * (std::abs(loss1) + 1));
    } else {
      CHECK(std::abs(norm - norm1) <= 1e-4 * norm1);
      CHECK(std::abs(loss - loss1) <= 1e-4 * (std::abs(loss1) + 1e-3));
    }
  }
  // The policy after 3 steps, one HF directory from every rank's part.
  const double diff = max_weight_diff(tmp.file("dp1-tp1-pp1/ckpt/step-3/policy"),
                                      tmp.file(l.name() + "/ckpt/step-3/policy"));
  INFO("max |w1 - w| " << diff);
  if (exact)
    CHECK(diff == 0);
  else
    CHECK(diff < 1e-5);
}

}  // namespace

TEST_CASE("tandem train with pipeline stages and data parallelism trains the weights of 1 rank",
          "[multiproc]") {
  const TempDir tmp("grid-pp-job");
  write_model(tmp);
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto one = run(tmp, job, {1, 1, 1}, kDet);
  // Data 2 x pipeline 2 with the optimizer state, the gradients and the parameters sharded over
  // each stage's data-parallel pair.
  for (const Layout& l : {Layout{1, 1, 2}, Layout{1, 1, 3}, Layout{2, 1, 2},
                          Layout{2, 1, 2, 1, "gradients"}, Layout{2, 1, 2, 1, "parameters"}})
    check_layout(tmp, job, l, one);
}

TEST_CASE(
    "tandem train with tensor parallelism and data parallelism trains the weights of 1 rank up "
    "to rounding",
    "[multiproc]") {
  const TempDir tmp("grid-tp-job");
  write_model(tmp);
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto one = run(tmp, job, {1, 1, 1}, kDet);
  // Engines split as the trainer (rollout TP 2) and whole (rollout TP 1, data 2 x tensor 2); data
  // 2 x tensor 2 with the gradients and with the parameters sharded over the data-parallel pairs.
  for (const Layout& l : {Layout{1, 2, 1, 2}, Layout{2, 2, 1}, Layout{1, 2, 2, 2},
                          Layout{2, 2, 1, 2, "gradients"}, Layout{2, 2, 1, 2, "parameters"}})
    check_layout(tmp, job, l, one);
}

TEST_CASE("a checkpoint written under one trainer layout resumes under another", "[multiproc]") {
  const TempDir tmp("grid-resume");
  write_model(tmp);
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto one = run(tmp, job, {1, 1, 1}, kDet);
  // Saved at step 2 under `from`, resumed for step 3 under `to`: the weights of the run that went
  // straight through (bitwise where neither splits a sum over tensor-parallel ranks).
  struct Case {
    Layout from, to;
  };
  for (const Case& c :
       {Case{{1, 1, 2}, {1, 1, 1}}, Case{{2, 1, 1}, {1, 1, 3}}, Case{{1, 1, 1}, {2, 1, 2}},
        Case{{1, 1, 2}, {1, 2, 2}}, Case{{2, 2, 1, 1, "parameters"}, {1, 1, 2}},
        Case{{1, 1, 3}, {2, 2, 1, 1, "parameters"}}, Case{{2, 1, 2, 1, "parameters"}, {1, 1, 1}}}) {
    const std::string name = fmt::format("{}-to-{}", c.from.name(), c.to.name());
    INFO(name);
    const auto saved = tandem::test::dp_job::train(tmp, job, c.from.ranks(), name,
                                                   c.from.keys() + " trainer.steps=2 " + kDet);
    INFO(saved.out);
    REQUIRE(saved.status == 0);
    const fs::path step2 = tmp.file(name + "/ckpt/step-2");
    REQUIRE(fs::exists(step2 / "COMMITTED"));
    const auto rest =
        tandem::test::dp_job::train(tmp, job, c.to.ranks(), name, c.to.keys() + " " + kDet);
    INFO(rest.out);
    REQUIRE(rest.status == 0);
    CHECK(rest.out.find("resumed from " + step2.string()) != std::string::npos);
    const double diff = max_weight_diff(tmp.file("dp1-tp1-pp1/ckpt/step-3/policy"),
                                        tmp.file(name + "/ckpt/step-3/policy"));
    INFO("max |w1 - w| " << diff);
    if (c.to.tp == 1 && c.from.tp == 1)
      CHECK(diff == 0);
    else
      CHECK(diff < 1e-5);
  }
}

TEST_CASE(
    "a pipeline stage killed mid-schedule makes every rank exit within the timeout and its "
    "neighbour name it",
    "[multiproc]") {
  const TempDir tmp("grid-kill-stage");
  write_model(tmp);
  const std::string job = write_job(tmp, tmp.file("model"));
  // 4 ranks: data 2 x pipeline 2 (ranks 2 and 3 run stage 1). Each replica's step is one
  // minibatch of 2 groups, one micro-batch each (deterministic mode); rank 2 dies before its
  // second backward pass: in the first step's 1F1B schedule, stage 0 waiting for its gradient.
  const std::string command = fmt::format(
      "{} {} trainer.steps=20 trainer.pp=2 trainer.minibatches=1 {} distributed.timeout_s=10 "
      "logging.dir={} checkpoint.dir={} --kill-in-pipeline 2:2",
      job_worker_bin(), job, kDet, tmp.file("run"), tmp.file("run/ckpt"));
  std::string script = fmt::format("export WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT={}; ",
                                   tandem::test::free_port());
  for (int r = 3; r >= 0; --r)
    script += fmt::format("RANK={} LOCAL_RANK={} {} >{} 2>&1 & p{}=$!; ", r, r, command,
                          tmp.file(fmt::format("rank{}.log", r)), r);
  script +=
      "wait $p2; s2=$?; start=$(date +%s); wait $p0; s0=$?; wait $p1; s1=$?; wait $p3; s3=$?; "
      "echo status $s0 $s1 $s2 $s3 seconds $(( $(date +%s) - start ))";
  const auto r = tandem::test::run_shell("timeout 120 bash -c '" + script + "'");
  std::vector<std::string> logs;
  for (int k = 0; k < 4; ++k)
    logs.push_back(tandem::test::read_text(tmp.file(fmt::format("rank{}.log", k))));
  INFO(r.out << "\nrank 0:\n"
             << logs[0] << "\nrank 1:\n"
             << logs[1] << "\nrank 2:\n"
             << logs[2] << "\nrank 3:\n"
             << logs[3]);
  CHECK(logs[2].find("rank 2 dies before backward 2") != std::string::npos);
  const size_t at = r.out.find("status ");
  REQUIRE(at != std::string::npos);
  int s0 = 0, s1 = 0, s2 = 0, s3 = 0, seconds = 0;
  REQUIRE(std::sscanf(r.out.c_str() + at, "status %d %d %d %d seconds %d", &s0, &s1, &s2, &s3,
                      &seconds) == 5);
  CHECK(s2 == 128 + SIGKILL);
  // Every survivor fails, none finishes a step.
  for (const int s : {s0, s1, s3}) CHECK(s != 0);
  CHECK(logs[0].find("step 1/20") == std::string::npos);
  // Its pipeline neighbour (rank 0, stage 0 of the same replica) names the stage and the rank.
  CHECK_THAT(logs[0], Catch::Contains("stage 1") && Catch::Contains("rank 2"));
  CHECK(seconds <= 24);  // within distributed.timeout_s, twice over: a neighbour, then its peers
}
