// The disaggregated job over real processes: two `tandem serve` workers on a tiny random model
// generate the rollouts of `tandem train`; the steps train the batches of the colocated job, and
// every step finishes with all its samples when one worker is killed mid-run; start-up refusals;
// the weight_sync canary on every worker.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model/hf.h"
#include "model/weights.h"
#include "tests/apps/dp_job.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

using tandem::test::dp_job::step_lines;

// The shared tiny job as it is, on one rank.
std::string write_job(const tandem::test::TempDir& tmp, const std::string& model) {
  return tandem::test::dp_job::write_tiny_job(tmp, model);
}

// `tandem serve` of `model` (its weights in `dtype`) on a free loopback port, requiring `token`
// when it is not empty; its port.
int start_worker(std::unique_ptr<tandem::test::Subprocess>& worker,
                 const tandem::test::TempDir& tmp, const std::string& model,
                 const std::string& dtype = "f32", const std::string& token = "") {
  const std::string config = tmp.write(
      "serve-" + dtype + ".toml", fmt::format(R"([model]
path = "{}"
dtype = "{}"
[engine]
num_blocks = 256
max_context = 256
[server]
port = 0
token_env = "{}"
[limits]
max_prompt_tokens = 128
max_new_tokens = 64
max_n = 8
)",
                                              model, dtype, token.empty() ? "" : "WORKER_TOKEN"));
  std::vector<std::string> argv{std::string(TANDEM_BIN_DIR) + "/tandem", "serve", config};
  if (!token.empty()) argv.insert(argv.begin(), {"/usr/bin/env", "WORKER_TOKEN=" + token});
  worker = std::make_unique<tandem::test::Subprocess>(argv);
  const std::string line = worker->wait_for_line("listening on ", 30000);
  INFO(worker->output());
  REQUIRE(!line.empty());
  return std::stoi(line.substr(13));
}

tandem::test::CommandResult train(const tandem::test::TempDir& tmp, const std::string& job,
                                  const std::string& name, const std::string& overrides = "") {
  return tandem::test::run_tandem(fmt::format("train {} logging.dir={} checkpoint.dir={} {}", job,
                                              tmp.file(name), tmp.file(name + "/ckpt"), overrides),
                                  true, 180);
}

std::string disaggregated(int port0, int port1) {
  return fmt::format(
      "placement.mode=disaggregated 'placement.workers=[\"127.0.0.1:{}\", \"127.0.0.1:{}\"]' "
      "placement.request_timeout_ms=30000",
      port0, port1);
}

}  // namespace

TEST_CASE("a disaggregated job on two workers trains the colocated job's batches", "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-job");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto colocated = train(tmp, job, "colocated");
  INFO(colocated.out);
  REQUIRE(colocated.status == 0);
  const auto a = step_lines(tmp.file("colocated/metrics.jsonl"));
  REQUIRE(a.size() == 3);

  std::unique_ptr<tandem::test::Subprocess> w0, w1;
  const int port0 = start_worker(w0, tmp, tmp.file("model"));
  const int port1 = start_worker(w1, tmp, tmp.file("model"));
  {
    const auto remote = train(tmp, job, "remote", disaggregated(port0, port1));
    INFO(remote.out);
    REQUIRE(remote.status == 0);
    const auto b = step_lines(tmp.file("remote/metrics.jsonl"));
    REQUIRE(b.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      INFO("step " << i + 1 << ": " << b[i].dump());
      CHECK(b[i]["samples_trained"] == a[i]["samples_trained"]);
      CHECK(b[i]["disaggregated/workers"] == 2);
      CHECK(b[i]["disaggregated/workers_stale"] == 0);
      // The workers sample as the job's own engine does (same seeds, weights and kernels).
      CHECK(b[i]["response_tokens"] == a[i]["response_tokens"]);
      CHECK(b[i]["reward/mean"].get<double>() == Approx(a[i]["reward/mean"].get<double>()));
      CHECK(b[i]["old_logp_recomputed"] == 1);
      CHECK(b[i]["rollout_trainer_logp/max_abs"].get<double>() < 1e-4);
    }
    // The weights written for the workers: the latest version only.
    CHECK(fs::exists(tmp.file("remote/rollout-weights")));
  }

  {  // one worker killed mid-run
    std::string out;
    int status = -1;
    std::thread run([&] {
      const auto r = train(tmp, job, "killed", disaggregated(port0, port1));
      out = r.out;
      status = r.status;
    });
    for (int tries = 0; tries < 6000 && step_lines(tmp.file("killed/metrics.jsonl")).empty();
         ++tries)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    REQUIRE(::kill(w1->pid(), SIGKILL) == 0);
    run.join();
    INFO(out);
    REQUIRE(status == 0);
    const auto b = step_lines(tmp.file("killed/metrics.jsonl"));
    REQUIRE(b.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      INFO("step " << i + 1 << ": " << b[i].dump());
      CHECK(b[i]["samples_trained"] == a[i]["samples_trained"]);
      CHECK(b[i]["dynamic_sampling/groups_generated"] == a[i]["dynamic_sampling/groups_generated"]);
    }
    CHECK(b[2]["disaggregated/workers_stale"] == 1);
    CHECK(out.find("did not take weight version") != std::string::npos);
    CHECK(w1->stop() == 128 + SIGKILL);
  }
  CHECK(w0->stop() == 0);
}

TEST_CASE("a disaggregated job refuses a worker that does not answer naming it", "[e2e]") {
  const tandem::test::TempDir tmp("disaggregated-refusals");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const int port = tandem::test::free_port();
  const auto r =
      train(tmp, job, "none",
            fmt::format("placement.mode=disaggregated 'placement.workers=[\"127.0.0.1:{}\"]' "
                        "placement.connect_timeout_s=0.5",
                        port));
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK(r.out.find(fmt::format("rollout worker 127.0.0.1:{} did not answer", port)) !=
        std::string::npos);

  const auto empty = train(tmp, job, "empty", "placement.mode=disaggregated");
  INFO(empty.out);
  CHECK(empty.status != 0);
  CHECK(empty.out.find("placement.workers") != std::string::npos);

  const auto colocated = train(tmp, job, "colocated", "'placement.workers=[\"127.0.0.1:1\"]'");
  INFO(colocated.out);
  CHECK(colocated.status != 0);
  CHECK(colocated.out.find("disaggregated") != std::string::npos);
}

TEST_CASE("a disaggregated job names a worker that refuses its token and only that cause",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-token");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  std::unique_ptr<tandem::test::Subprocess> worker;
  const int port = start_worker(worker, tmp, tmp.file("model"), "f32", "s3cret");
  const std::string job = write_job(tmp, tmp.file("model"));
  const std::string placement =
      fmt::format("placement.mode=disaggregated 'placement.workers=[\"127.0.0.1:{}\"]' ", port);
  const std::string refused = fmt::format("rollout worker 127.0.0.1:{} refused the token", port);
  {  // no token at all
    const auto r = train(tmp, job, "none", placement);
    INFO(r.out);
    CHECK(r.status != 0);
    CHECK_THAT(r.out, Catch::Contains(refused) && Catch::Contains("the job sends none") &&
                          Catch::Contains("placement.token_env"));
    CHECK_THAT(r.out, !Catch::Contains("did not answer"));
  }
  {  // a wrong one
    const auto r = tandem::test::run_tandem(
        fmt::format("train {} logging.dir={} checkpoint.dir={} {} placement.token_env=WRONG_TOKEN",
                    job, tmp.file("wrong"), tmp.file("wrong/ckpt"), placement),
        true, 180, "WRONG_TOKEN=guess");
    INFO(r.out);
    CHECK(r.status != 0);
    CHECK_THAT(r.out, Catch::Contains(refused) && Catch::Contains("$WRONG_TOKEN"));
    CHECK_THAT(r.out, !Catch::Contains("did not answer"));
  }
  CHECK(worker->stop() == 0);
}

TEST_CASE("a disaggregated job refuses a worker that serves a model of another shape",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-other-model");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // The same vocabulary and tokenizer, one layer fewer.
  tandem::model::ModelConfig c =
      tandem::test::tiny_model_config(tandem::test::TinyKind::llama_tied);
  c.vocab_size = 49152;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.num_layers = 1;
  tandem::model::Weights w(c, tandem::DType::f32);
  tandem::test::fill_random_weights(w, 5);
  tandem::model::SaveOptions o;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    std::ifstream in(fs::path(tmp.file("model")) / f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    o.extra_files[f] = ss.str();
  }
  tandem::model::save_hf(w, tmp.file("other"), o);

  std::unique_ptr<tandem::test::Subprocess> worker;
  const int port = start_worker(worker, tmp, tmp.file("other"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto r = train(tmp, job, "run",
                       fmt::format("placement.mode=disaggregated "
                                   "'placement.workers=[\"127.0.0.1:{}\"]'",
                                   port));
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK(r.out.find(fmt::format("rollout worker 127.0.0.1:{} did not take the job's weights",
                               port)) != std::string::npos);
  CHECK(r.out.find("it serves '" + tmp.file("other") + "' and the job trains '" +
                   tmp.file("model") + "'") != std::string::npos);
  CHECK(worker->stop() == 0);
}

TEST_CASE(
    "the weight_sync canary probes every worker of a disaggregated job and names one that differs",
    "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-canary");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  std::unique_ptr<tandem::test::Subprocess> w0, w1;
  const int port0 = start_worker(w0, tmp, tmp.file("model"));
  const int port1 = start_worker(w1, tmp, tmp.file("model"), "bf16");
  const std::string canary = " trainer.steps=2 weight_sync.canary=true weight_sync.canary_tokens=8";
  {  // an f32 worker: the job's kernels on the same weights
    const auto r = train(tmp, job, "f32",
                         fmt::format("placement.mode=disaggregated "
                                     "'placement.workers=[\"127.0.0.1:{}\"]'",
                                     port0) +
                             canary);
    INFO(r.out);
    REQUIRE(r.status == 0);
    const auto b = step_lines(tmp.file("f32/metrics.jsonl"));
    REQUIRE(b.size() == 2);
    for (const auto& m : b) {
      INFO(m.dump());
      CHECK(m["weight_sync/canary_max_abs"].get<double>() < 1e-4);
    }
  }
  // With a bf16 worker beside it, the job's f32 tolerance (rollout.dtype = f32) refuses that one
  // before the first step.
  const auto r = train(tmp, job, "mixed", disaggregated(port0, port1) + canary);
  INFO(r.out);
  CHECK(r.status != 0);
  CHECK_THAT(r.out, Catch::Contains("weight_sync canary: after the publish of step 0 (weight "
                                    "version 0)"));
  CHECK_THAT(r.out, Catch::Contains(fmt::format("on rollout worker 127.0.0.1:{} by up to", port1)));
  CHECK_THAT(r.out, !Catch::Contains(fmt::format("rollout worker 127.0.0.1:{} by up to", port0)));
  CHECK(step_lines(tmp.file("mixed/metrics.jsonl")).empty());
  CHECK(w0->stop() == 0);
  CHECK(w1->stop() == 0);
}
