// The disaggregated job with a trainer on several ranks (tandem launch, Gloo on loopback): two
// `tandem serve` workers generate every rank's share of the groups, rank 0 pushes each version
// (the other ranks wait for its push before they generate again) and probes the workers with the
// weight_sync canary for every rank. Data-parallel ranks, ZeRO-3 pieces and pipeline stages (their
// engine in f32, or in bf16 with rank 0's whole f32 copy for the workers) train the batches of the
// one-rank job to the same weights (deterministic mode), taking the workers' logprobs as the old
// ones on every rank alike where the canary measured them exact.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/apps/dp_job.h"
#include "tests/apps/serve_worker.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace {

using tandem::test::disaggregated;
using tandem::test::start_worker;
using tandem::test::Subprocess;
using tandem::test::TempDir;
using tandem::test::dp_job::max_weight_diff;
using tandem::test::dp_job::step_lines;

struct Layout {
  int ranks;
  std::string name, keys;
  // The trainer's engine holds f32 weights: the canary measures 0 everywhere. In bf16 (and its
  // whole f32 copy on rank 0 for the workers) it measures the engine's rounding, and the trainer
  // recomputes the old logprobs: the workers' bitwise, so the same weights still.
  bool engine_f32 = true;
};

// A tiny model of 6 layers (pp = 2 splits them) and an untied head, so that pipeline stages train
// one rank's gradients bitwise (tests/apps/test_grid_job.cpp); its job of one minibatch, so that
// the old logprobs may be the workers' (30 s bounds every collective); two workers of it.
struct Setup {
  std::string job;
  std::unique_ptr<Subprocess> w0, w1;
  int port0 = 0, port1 = 0;
  explicit Setup(const TempDir& tmp) {
    tandem::test::write_tiny_smollm2_hf(tmp.file("model"), 17, 6, false);
    job = tandem::test::dp_job::write_tiny_job(tmp, tmp.file("model"), "",
                                               "[distributed]\ntimeout_s = 30\n");
    port0 = start_worker(w0, tmp, tmp.file("model"));
    port1 = start_worker(w1, tmp, tmp.file("model"));
  }
};

TEST_CASE("a disaggregated job on several ranks trains the batches of one rank", "[multiproc]") {
  const TempDir tmp("disaggregated-ranks");
  Setup w(tmp);
  const std::string& job = w.job;
  const std::string keys =
      "trainer.deterministic=true rollout.seed=5 weight_sync.canary=true "
      "weight_sync.canary_tokens=4 " +
      disaggregated(w.port0, w.port1);
  auto run = [&](const Layout& l) {
    const auto r = tandem::test::dp_job::train(tmp, job, l.ranks, l.name, keys + " " + l.keys);
    INFO(r.out);
    REQUIRE(r.status == 0);
    CHECK_THAT(r.out, Catch::Contains(l.engine_f32 ? "old logprobs: the workers'"
                                                   : "old logprobs: recomputed by the trainer"));
    auto steps = step_lines(tmp.file(l.name + "/metrics.jsonl"));
    REQUIRE(steps.size() == 3);
    return steps;
  };
  const auto one = run({1, "one", "", true});
  for (const Layout& l : {Layout{2, "dp2", "placement.ranks=2"},
                          Layout{2, "dp2-parameters", "placement.ranks=2 trainer.shard=parameters"},
                          Layout{2, "pp2", "trainer.pp=2"},
                          Layout{2, "pp2-bf16", "trainer.pp=2 rollout.dtype=bf16", false}}) {
    INFO(l.name);
    const auto b = run(l);
    for (size_t i = 0; i < 3; ++i) {
      INFO("step " << i + 1 << ": " << b[i].dump());
      CHECK(b[i]["distributed/ranks"] == l.ranks);
      CHECK(b[i]["disaggregated/workers"] == 2);
      CHECK(b[i]["disaggregated/workers_stale"] == 0);
      // One push a step (the workers' numbering goes on from the runs before).
      CHECK(b[i]["disaggregated/weight_version"].get<int64_t>() ==
            b[0]["disaggregated/weight_version"].get<int64_t>() + static_cast<int64_t>(i));
      // The workers' samples of the same seeds and weights, whichever rank asked for them.
      CHECK(b[i]["samples_trained"] == one[i]["samples_trained"]);
      CHECK(b[i]["response_tokens"] == one[i]["response_tokens"]);
      CHECK(b[i]["reward/mean"].get<double>() == one[i]["reward/mean"].get<double>());
      // Probed by rank 0 on both workers, scored by every rank: the trainer's logprobs bitwise.
      CHECK((b[i]["weight_sync/canary_max_abs"].get<double>() == 0) == l.engine_f32);
      CHECK(b[i]["old_logp_recomputed"] == (l.engine_f32 ? 0 : 1));
      if (!l.engine_f32) CHECK(b[i]["rollout_trainer_logp/max_abs"].get<double>() == 0);
      CHECK(b[i]["grad_norm"].get<double>() == one[i]["grad_norm"].get<double>());
      const double loss = b[i]["loss"].get<double>(), loss1 = one[i]["loss"].get<double>();
      CHECK(std::abs(loss - loss1) <= 1e-12 * (std::abs(loss1) + 1));
    }
    CHECK(max_weight_diff(tmp.file("one/ckpt/step-3/policy"),
                          tmp.file(l.name + "/ckpt/step-3/policy")) == 0);
  }
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

// rollout.max_staleness = 1 on several ranks: every rank generates its share of the next step's
// batch on its rollout queue's thread (exchanging it with the others over a group of its own)
// while the ranks update; every sample trained is at most one version old, on every rank.
TEST_CASE("a disaggregated job on several ranks at rollout.max_staleness 1 trains within the bound",
          "[multiproc]") {
  const TempDir tmp("disaggregated-ranks-async");
  Setup w(tmp);
  for (const Layout& l :
       {Layout{2, "dp2", "placement.ranks=2"}, Layout{2, "pp2", "trainer.pp=2"}}) {
    INFO(l.name);
    const auto r = tandem::test::dp_job::train(
        tmp, w.job, l.ranks, l.name,
        disaggregated(w.port0, w.port1) + " rollout.max_staleness=1 trainer.steps=5 " + l.keys);
    INFO(r.out);
    REQUIRE(r.status == 0);
    CHECK_THAT(r.out, Catch::Contains("old logprobs: the workers' behaviour logprobs"));
    const auto steps = step_lines(tmp.file(l.name + "/metrics.jsonl"));
    REQUIRE(steps.size() == 5);
    int64_t stale_steps = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const nlohmann::json& m = steps[i];
      INFO("step " << i + 1 << ": " << m.dump());
      CHECK(m["distributed/ranks"] == l.ranks);
      CHECK(m["samples_trained"] == 16);
      CHECK(m["async/weight_version"] == static_cast<int64_t>(i));
      CHECK(m["async/staleness_max"].get<int64_t>() <= 1);
      CHECK(m["async/weight_version"].get<int64_t>() - m["async/oldest_version"].get<int64_t>() <=
            1);
      CHECK(m["old_logp_recomputed"] == 0);
      stale_steps += m["async/staleness_max"].get<int64_t>() > 0 ? 1 : 0;
    }
    CHECK(stale_steps >= 1);
  }
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

// Rank 0 cannot start the workers (none answers): every rank stops, none waits for it.
TEST_CASE("a disaggregated job on 2 ranks whose workers do not answer stops every rank",
          "[multiproc]") {
  const TempDir tmp("disaggregated-ranks-down");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = tandem::test::dp_job::write_job(tmp, tmp.file("model"));
  const int port = tandem::test::free_port();
  const auto r = tandem::test::dp_job::train(
      tmp, job, 2, "down",
      fmt::format("placement.ranks=2 placement.mode=disaggregated "
                  "'placement.workers=[\"127.0.0.1:{}\"]' placement.connect_timeout_s=1",
                  port));
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK_THAT(r.out,
             Catch::Contains(fmt::format("rollout worker 127.0.0.1:{} did not answer", port)));
  CHECK_THAT(r.out, Catch::Contains("rank 0 could not start the rollout workers"));
}

}  // namespace
