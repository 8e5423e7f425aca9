// The disaggregated job over real processes: two `tandem serve` workers on a tiny random model
// generate the rollouts of `tandem train`; the steps train the batches of the colocated job (with
// the trainer's parameters sharded too), and every step finishes with all its samples when one
// worker is killed mid-run; a stopped worker is set aside without the steps waiting for it and
// caught up once it answers again; a push does not wait for a worker that stops answering in it;
// start-up refusals; the weight_sync canary on every worker.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model/hf.h"
#include "model/weights.h"
#include "rollout/service/client.h"
#include "tests/apps/dp_job.h"
#include "tests/apps/serve_worker.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

using tandem::test::disaggregated;
using tandem::test::start_worker;
using tandem::test::dp_job::step_lines;

// The shared tiny job as it is, on one rank.
std::string write_job(const tandem::test::TempDir& tmp, const std::string& model) {
  return tandem::test::dp_job::write_tiny_job(tmp, model);
}

tandem::test::CommandResult train(const tandem::test::TempDir& tmp, const std::string& job,
                                  const std::string& name, const std::string& overrides = "") {
  return tandem::test::run_tandem(fmt::format("train {} logging.dir={} checkpoint.dir={} {}", job,
                                              tmp.file(name), tmp.file(name + "/ckpt"), overrides),
                                  true, 180);
}

// The step lines (`steps` of them) of a run that must succeed.
std::vector<nlohmann::json> steps_of(const tandem::test::TempDir& tmp, const std::string& job,
                                     const std::string& name, const std::string& overrides = "",
                                     size_t steps_expected = 3) {
  const auto r = train(tmp, job, name, overrides);
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto steps = step_lines(tmp.file(name + "/metrics.jsonl"));
  REQUIRE(steps.size() == steps_expected);
  return steps;
}

// A tiny model, its job and two `tandem serve` workers of it, in tmp.
struct TwoWorkers {
  std::string job;
  std::unique_ptr<tandem::test::Subprocess> w0, w1;
  int port0 = 0, port1 = 0;
  explicit TwoWorkers(const tandem::test::TempDir& tmp) {
    tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
    job = write_job(tmp, tmp.file("model"));
    port0 = start_worker(w0, tmp, tmp.file("model"));
    port1 = start_worker(w1, tmp, tmp.file("model"));
  }
};

// The calls' deadline (a generate's, a push's) of `timeout_s`; a health check every 0.5 s with a
// deadline of 2 s.
std::string health_checked(int64_t timeout_s) {
  return fmt::format(
      " placement.request_timeout_ms={} placement.health_check_interval_s=0.5 "
      "placement.health_check_timeout_s=2",
      timeout_s * 1000);
}

// The sampled tokens and logprobs of a seeded probe on the worker at `port`, under the weights it
// serves, and their version.
tandem::rollout::rpc::GenerateResponse probe(int port) {
  tandem::rollout::RolloutClient c({.address = fmt::format("127.0.0.1:{}", port)});
  tandem::rollout::rpc::GenerateRequest r;
  r.request_id = "probe";
  r.prompt_tokens = {1, 20, 300, 4000, 77, 9};
  r.params.n = 2;
  r.params.seed = 11;
  r.params.max_tokens = 8;
  r.params.stop_at_eos = false;
  return c.generate(r);
}

void check_same_probe(const tandem::rollout::rpc::GenerateResponse& a,
                      const tandem::rollout::rpc::GenerateResponse& b) {
  REQUIRE(a.samples.size() == b.samples.size());
  for (size_t i = 0; i < a.samples.size(); ++i) {
    CHECK(a.samples[i].tokens == b.samples[i].tokens);
    CHECK(a.samples[i].logprobs == b.samples[i].logprobs);  // bitwise
  }
}

// `tandem train` of the workers' job for `steps` steps in tmp/run, in the background, with calls'
// deadline `timeout_s` and health_checked's checks.
struct BackgroundJob {
  std::string metrics;
  tandem::test::Subprocess run;
  BackgroundJob(const tandem::test::TempDir& tmp, const TwoWorkers& w, int steps, int64_t timeout_s)
      : metrics(tmp.file("run/metrics.jsonl")),
        run({"/bin/sh", "-c",
             fmt::format("exec {}/tandem train {} logging.dir={} checkpoint.dir={} {}{} "
                         "trainer.steps={} 2>&1",
                         TANDEM_BIN_DIR, w.job, tmp.file("run"), tmp.file("run/ckpt"),
                         disaggregated(w.port0, w.port1), health_checked(timeout_s), steps)}) {}
  // Reads the job's output (so that it never blocks on a full pipe) until `steps` step lines are
  // written or `bound_s` passed; the step lines written.
  size_t wait_for_steps(size_t steps, int bound_s) {
    for (int i = 0; i < bound_s * 5 && step_lines(metrics).size() < steps; ++i)
      run.wait_for_line("\x01", 200);
    return step_lines(metrics).size();
  }
};

// A loopback TCP proxy to a worker that forwards every connection until a client has sent a call
// of `method` `nth` times; from then on it forwards nothing (a worker that stops answering in the
// middle of that call, and after it). Given `at_nth`, it forwards that call, runs at_nth once
// (e.g. kills the worker in the middle of the call) and goes on forwarding every connection.
class FreezingProxy {
 public:
  FreezingProxy(int to, std::string method, int nth, std::function<void()> at_nth = {})
      : to_(to), method_(std::move(method)), nth_(nth), at_nth_(std::move(at_nth)) {
    listen_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    REQUIRE(::listen(listen_, 64) == 0);
    socklen_t n = sizeof(a);
    REQUIRE(::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &n) == 0);
    port_ = ntohs(a.sin_port);
    threads_.emplace_back([this] { accept_loop(); });
  }
  ~FreezingProxy() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    ::close(listen_);
  }
  int port() const { return port_; }
  bool frozen() const { return frozen_; }
  bool fired() const { return fired_; }

 private:
  void accept_loop() {
    std::vector<std::thread> pumps;
    while (!stop_) {
      pollfd p{listen_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int client = ::accept(listen_, nullptr, nullptr);
      if (client < 0) continue;
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(to_));
      if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        ::close(server);
        ::close(client);
        continue;
      }
      pumps.emplace_back([this, client, server] { pump(client, server); });
    }
    for (std::thread& t : pumps) t.join();
  }
  // Copies bytes both ways until either side closes or the proxy stops; frozen, drops them.
  void pump(int client, int server) {
    char buf[65536];
    while (!stop_) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 50) <= 0) continue;
      bool closed = false;
      for (int side = 0; side < 2; ++side) {
        if (!(p[side].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t n = ::read(p[side].fd, buf, sizeof buf);
        if (n <= 0) {
          closed = true;
          break;
        }
        const bool nth =
            side == 0 &&
            std::string_view(buf, static_cast<size_t>(n)).find(method_) != std::string_view::npos &&
            ++seen_ == nth_;
        if (nth && !at_nth_) frozen_ = true;
        if (!frozen_ && ::write(side == 0 ? server : client, buf, static_cast<size_t>(n)) != n)
          closed = true;
        if (nth && at_nth_) {
          at_nth_();
          fired_ = true;
        }
      }
      if (closed) break;
    }
    ::close(client);
    ::close(server);
  }

  int to_;
  std::string method_;
  int nth_;
  std::function<void()> at_nth_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false}, frozen_{false}, fired_{false};
  std::atomic<int> seen_{0};
  std::vector<std::thread> threads_;
};

}  // namespace

TEST_CASE("a disaggregated job on two workers trains the colocated job's batches", "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-job");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto a = steps_of(tmp, job, "colocated");

  std::unique_ptr<tandem::test::Subprocess> w0, w1;
  const int port0 = start_worker(w0, tmp, tmp.file("model"));
  const int port1 = start_worker(w1, tmp, tmp.file("model"));
  {
    const auto b = steps_of(tmp, job, "remote", disaggregated(port0, port1));
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
    // Over the wire (placement.weights = "wire", the default): no directory written.
    CHECK_FALSE(fs::exists(tmp.file("remote/rollout-weights")));
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
    CHECK(out.find(fmt::format("rollout worker 127.0.0.1:{} set aside", port1)) !=
          std::string::npos);
    CHECK(w1->stop() == 128 + SIGKILL);
  }
  CHECK(w0->stop() == 0);
}

// The trainer at trainer.shard = parameters (deterministic: the sharded optimizer on one rank)
// keeps its f32 weights as pieces, and with rollout.dtype = bf16 its own engine holds a bf16 copy:
// the workers' f32 weights come from the whole copy the rollout group keeps for them.
TEST_CASE(
    "a disaggregated job with parameters sharded pushes every version to its workers and trains "
    "the colocated job's batches",
    "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-parameters");
  TwoWorkers w(tmp);
  const std::string det = "trainer.deterministic=true";
  const auto a = steps_of(tmp, w.job, "colocated", det);
  const auto b = steps_of(
      tmp, w.job, "remote",
      det + " trainer.shard=parameters rollout.dtype=bf16 " + disaggregated(w.port0, w.port1));
  for (size_t i = 0; i < 3; ++i) {
    INFO("step " << i + 1 << ": " << b[i].dump());
    CHECK(b[i]["disaggregated/workers"] == 2);
    // Every step's version pushed, whole, to both workers.
    CHECK(b[i]["disaggregated/workers_stale"] == 0);
    CHECK(b[i]["disaggregated/push_bytes"].get<int64_t>() > 0);
    if (i > 0)
      CHECK(b[i]["disaggregated/weight_version"].get<int64_t>() ==
            b[i - 1]["disaggregated/weight_version"].get<int64_t>() + 1);
    // The workers sample from each step's weights as the colocated engine does: the same batch.
    CHECK(b[i]["samples_trained"] == a[i]["samples_trained"]);
    CHECK(b[i]["response_tokens"] == a[i]["response_tokens"]);
    CHECK(b[i]["reward/mean"].get<double>() == Approx(a[i]["reward/mean"].get<double>()));
    CHECK(b[i]["rollout_trainer_logp/max_abs"].get<double>() < 1e-4);
    CHECK(b[i]["loss"].get<double>() ==
          Approx(a[i]["loss"].get<double>()).margin(1e-6).epsilon(1e-5));
    // The trainer's own engine: a bf16 copy cast from the pieces.
    CHECK(b[i]["weight_sync/cast_tensors"].get<int64_t>() > 0);
    CHECK(b[i]["weight_sync/shared_tensors"] == 0);
  }
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

TEST_CASE(
    "a disaggregated job sets a stopped worker aside without waiting for it and catches it up "
    "when it answers again",
    "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-stopped");
  TwoWorkers w(tmp);
  const int port1 = w.port1;
  // A generate call's deadline of 60 s: a step that waited for the stopped worker would take it.
  const int64_t timeout_s = 60;
  BackgroundJob job(tmp, w, 6, timeout_s);
  tandem::test::Subprocess& run = job.run;
  const std::string& metrics = job.metrics;
  auto wait_for_steps = [&](size_t steps, int bound_s) {
    return job.wait_for_steps(steps, bound_s);
  };
  REQUIRE(wait_for_steps(1, 120) >= 1);
  REQUIRE(::kill(w.w1->pid(), SIGSTOP) == 0);
  // Two steps with the worker stopped: neither their rollout nor their push waits the generate
  // deadline for it.
  const size_t stopped = wait_for_steps(3, 150);
  INFO(run.output());
  REQUIRE(stopped >= 3);
  {
    const auto b = step_lines(metrics);
    for (size_t i = 1; i < 3; ++i) {
      INFO("step " << i + 1 << ": " << b[i].dump());
      CHECK(b[i]["time/rollout_s"].get<double>() < static_cast<double>(timeout_s) / 2);
      CHECK(b[i]["time/publish_s"].get<double>() < static_cast<double>(timeout_s) / 2);
    }
    INFO(b[2].dump());
    CHECK(b[2]["disaggregated/workers_set_aside"] == 1);
    CHECK(b[2]["disaggregated/set_aside_total"].get<int64_t>() >= 1);
    CHECK(b[2]["disaggregated/workers_stale"] == 1);
  }
  REQUIRE(::kill(w.w1->pid(), SIGCONT) == 0);
  // The job goes on and ends on its own.
  CHECK(wait_for_steps(6, 240) == 6);
  const int status = run.stop(0, 60000);
  run.wait_for_line("\x01", 1000);  // the rest of its output
  INFO(run.output());
  REQUIRE(status == 0);
  const auto b = step_lines(metrics);
  REQUIRE(b.size() == 6);
  INFO(b[5].dump());
  // Back: answered a health check, took the latest weights, and served again.
  CHECK(b[5]["disaggregated/workers_set_aside"] == 0);
  CHECK(b[5]["disaggregated/workers_stale"] == 0);
  CHECK(b[5]["disaggregated/back_total"].get<int64_t>() >= 1);
  CHECK_THAT(run.output(),
             Catch::Contains(fmt::format("rollout worker 127.0.0.1:{} set aside", port1)));
  CHECK_THAT(run.output(),
             Catch::Contains(
                 fmt::format("rollout worker 127.0.0.1:{} answers again and serves again", port1)));
  tandem::rollout::RolloutClient c({.address = fmt::format("127.0.0.1:{}", port1)});
  CHECK(c.weight_version() == b[5]["disaggregated/weight_version"].get<int64_t>());
  CHECK(w.w1->stop() == 0);
  CHECK(w.w0->stop() == 0);
}

TEST_CASE("a disaggregated job goes on without a worker that stops answering in a weight push",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-push-hang");
  TwoWorkers w(tmp);
  // Worker 1 behind a proxy that goes silent in the second commit of a weight push (its buckets go
  // over the worker's data channel, past the proxy): the first is the push at start, the second
  // the push after step 1.
  FreezingProxy proxy(w.port1, "commit_weight_push", 2);
  const int64_t timeout_s = 60;
  const auto r =
      train(tmp, w.job, "run", disaggregated(w.port0, proxy.port()) + health_checked(timeout_s));
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(proxy.frozen());
  const auto b = step_lines(tmp.file("run/metrics.jsonl"));
  REQUIRE(b.size() == 3);
  for (const auto& m : b) {
    INFO(m.dump());
    CHECK(m["time/publish_s"].get<double>() < static_cast<double>(timeout_s) / 2);
    CHECK(m["time/rollout_s"].get<double>() < static_cast<double>(timeout_s) / 2);
  }
  INFO(b[2].dump());
  CHECK(b[2]["disaggregated/workers_set_aside"] == 1);
  CHECK(b[2]["disaggregated/workers_stale"] == 1);
  CHECK_THAT(r.out,
             Catch::Contains(fmt::format("rollout worker 127.0.0.1:{} set aside", proxy.port())));
  CHECK(w.w1->stop() == 0);
  CHECK(w.w0->stop() == 0);
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

TEST_CASE(
    "weights pushed over the wire to two workers generate bitwise as the same weights loaded from "
    "a directory",
    "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-wire");
  TwoWorkers w(tmp);
  // Deterministic: both jobs train the same batches into the same weights, one pushing them over
  // the wire and one through a directory, to the same two workers.
  const std::string job = "trainer.deterministic=true trainer.steps=2 " +
                          disaggregated(w.port0, w.port1) + " weight_sync.bucket_mb=1";
  const auto wire = steps_of(tmp, w.job, "wire", job + " placement.weights=wire", 2);
  const int64_t wire_version = wire[1]["disaggregated/weight_version"].get<int64_t>();
  for (const auto& m : wire) {
    INFO(m.dump());
    CHECK(m["disaggregated/workers_stale"] == 0);
    CHECK(m["disaggregated/push_bytes"].get<int64_t>() > (1 << 20));  // several buckets of 1 MiB
    CHECK(m["disaggregated/push_write_s"].get<double>() == 0);        // nothing written
  }
  CHECK_FALSE(fs::exists(tmp.file("wire/rollout-weights")));
  const auto p0 = probe(w.port0), p1 = probe(w.port1);
  CHECK(p0.samples[0].weight_version == wire_version);
  check_same_probe(p0, p1);

  const auto dir = steps_of(tmp, w.job, "dir", job + " placement.weights=directory", 2);
  for (size_t i = 0; i < 2; ++i) {
    INFO("step " << i + 1 << ": " << dir[i].dump());
    CHECK(dir[i]["response_tokens"] == wire[i]["response_tokens"]);
    CHECK(dir[i]["loss"] == wire[i]["loss"]);
    CHECK(dir[i]["disaggregated/push_write_s"].get<double>() > 0);
  }
  const auto d0 = probe(w.port0);
  CHECK(d0.samples[0].weight_version > wire_version);
  check_same_probe(d0, p0);
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

TEST_CASE("a worker restarted during a disaggregated job gets the current weights over the wire",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-restart");
  TwoWorkers w(tmp);
  BackgroundJob job(tmp, w, 5, 60);
  tandem::test::Subprocess& run = job.run;
  const std::string& metrics = job.metrics;
  auto wait_for_steps = [&](size_t steps, int bound_s) {
    return job.wait_for_steps(steps, bound_s);
  };
  REQUIRE(wait_for_steps(1, 120) >= 1);
  // Worker 1 dies, and a new one (the model's own weights, version 0) starts on its port.
  REQUIRE(::kill(w.w1->pid(), SIGKILL) == 0);
  CHECK(w.w1->stop() == 128 + SIGKILL);
  start_worker(w.w1, tmp, tmp.file("model"), "f32", "", w.port1);
  CHECK(wait_for_steps(5, 240) == 5);
  const int status = run.stop(0, 60000);
  run.wait_for_line("\x01", 1000);
  INFO(run.output());
  REQUIRE(status == 0);
  const auto b = step_lines(metrics);
  REQUIRE(b.size() == 5);
  INFO(b[4].dump());
  CHECK(b[4]["disaggregated/workers_stale"] == 0);
  CHECK(b[4]["disaggregated/workers_set_aside"] == 0);
  // Caught up (on the health-check thread from the job's copy of a version it missed, or by the
  // next push when it died after taking the last one), then serving again.
  CHECK_THAT(
      run.output(),
      Catch::Contains(fmt::format("rollout worker 127.0.0.1:{} holds weight version", w.port1)) &&
          Catch::Contains(
              fmt::format("rollout worker 127.0.0.1:{} answers again and serves again", w.port1)));
  // The new worker holds the job's last version, and samples as the worker that took every one.
  const auto p0 = probe(w.port0), p1 = probe(w.port1);
  CHECK(p1.samples[0].weight_version == b[4]["disaggregated/weight_version"].get<int64_t>());
  check_same_probe(p0, p1);
  CHECK(w.w1->stop() == 0);
  CHECK(w.w0->stop() == 0);
}

// Worker 1 is killed in the middle of the weight push after step 1 (its begin_weight_push taken,
// its buckets on the way) and a new one started on its port: the job goes on without it, catches
// the new one up with the latest version before it serves again, and it samples as worker 0.
TEST_CASE("a worker killed in a weight push and restarted catches up before it serves again",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-killed-in-push");
  TwoWorkers w(tmp);
  const pid_t first = w.w1->pid();
  FreezingProxy proxy(w.port1, "begin_weight_push", 2, [first] { ::kill(first, SIGKILL); });
  tandem::test::Subprocess run(
      {"/bin/sh", "-c",
       fmt::format("exec {}/tandem train {} logging.dir={} checkpoint.dir={} {}{} "
                   "trainer.steps=6 2>&1",
                   TANDEM_BIN_DIR, w.job, tmp.file("run"), tmp.file("run/ckpt"),
                   disaggregated(w.port0, proxy.port()), health_checked(60))});
  for (int i = 0; i < 600 && !proxy.fired(); ++i) run.wait_for_line("\x01", 100);
  REQUIRE(proxy.fired());
  CHECK(w.w1->stop() == 128 + SIGKILL);
  start_worker(w.w1, tmp, tmp.file("model"), "f32", "", w.port1);
  const std::string metrics = tmp.file("run/metrics.jsonl");
  for (int i = 0; i < 1200 && step_lines(metrics).size() < 6; ++i) run.wait_for_line("\x01", 200);
  const int status = run.stop(0, 60000);
  run.wait_for_line("\x01", 1000);
  INFO(run.output());
  REQUIRE(status == 0);
  const auto b = step_lines(metrics);
  REQUIRE(b.size() == 6);
  const std::string name = fmt::format("rollout worker 127.0.0.1:{}", proxy.port());
  CHECK_THAT(run.output(), Catch::Contains(name + " set aside") &&
                               Catch::Contains(name + " holds weight version") &&
                               Catch::Contains(name + " answers again and serves again"));
  INFO(b[5].dump());
  CHECK(b[5]["disaggregated/workers_stale"] == 0);
  CHECK(b[5]["disaggregated/workers_set_aside"] == 0);
  const auto p0 = probe(w.port0), p1 = probe(w.port1);
  CHECK(p1.samples[0].weight_version == b[5]["disaggregated/weight_version"].get<int64_t>());
  check_same_probe(p0, p1);
  CHECK(w.w1->stop() == 0);
  CHECK(w.w0->stop() == 0);
}

// The old logprobs: the canary probes every worker after each push; where it measures 0 (f32
// workers, the trainer's kernels) the workers' logprobs are the trainer's bitwise, so the trainer
// takes them instead of recomputing: the same losses and weights as a run that recomputes, and
// the log says which it did.
TEST_CASE(
    "a disaggregated job takes the workers' logprobs as old ones where the canary found them "
    "exact",
    "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-old-logp");
  TwoWorkers w(tmp);
  const std::string keys =
      "trainer.deterministic=true weight_sync.canary=true weight_sync.canary_tokens=8 " +
      disaggregated(w.port0, w.port1);
  const auto r = train(tmp, w.job, "taken", keys);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("old logprobs: the workers' (the canary found them the "
                                    "trainer's bitwise at this weight version)"));
  const auto taken = step_lines(tmp.file("taken/metrics.jsonl"));
  const auto recomputed =
      steps_of(tmp, w.job, "recomputed", keys + " trainer.always_recompute_old=true");
  REQUIRE(taken.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    INFO("step " << i + 1 << ": " << taken[i].dump() << "\n" << recomputed[i].dump());
    CHECK(taken[i]["weight_sync/canary_max_abs"].get<double>() == 0);
    CHECK(taken[i]["old_logp_recomputed"] == 0);
    CHECK(recomputed[i]["old_logp_recomputed"] == 1);
    CHECK(recomputed[i]["rollout_trainer_logp/max_abs"].get<double>() == 0);
    CHECK(taken[i]["samples_trained"] == recomputed[i]["samples_trained"]);
    CHECK(taken[i]["loss"].get<double>() == recomputed[i]["loss"].get<double>());
    CHECK(taken[i]["grad_norm"].get<double>() == recomputed[i]["grad_norm"].get<double>());
  }
  // Without the canary nothing tells: the trainer recomputes.
  const auto off =
      steps_of(tmp, w.job, "off", "trainer.deterministic=true " + disaggregated(w.port0, w.port1));
  for (const auto& m : off) CHECK(m["old_logp_recomputed"] == 1);
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

// rollout.max_staleness = 1: the workers generate the next step's batch while the trainer updates
// on this one, so its samples come from the version before the one they are trained on; none
// from further back. The versions are the workers' (each sample's first token's), the bound the
// trainer's: a queue that ran two steps ahead, or samples stamped with a wrong version, fail here.
TEST_CASE("a disaggregated job at rollout.max_staleness 1 trains on samples at most 1 version old",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-async");
  TwoWorkers w(tmp);
  const std::string workers = disaggregated(w.port0, w.port1);
  const auto r = train(tmp, w.job, "async", workers + " rollout.max_staleness=1 trainer.steps=5");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("old logprobs: the workers' behaviour logprobs") != std::string::npos);
  const auto steps = step_lines(tmp.file("async/metrics.jsonl"));
  REQUIRE(steps.size() == 5);
  int64_t stale_steps = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const nlohmann::json& m = steps[i];
    INFO("step " << i + 1 << ": " << m.dump());
    CHECK(m["async/max_staleness"] == 1);
    REQUIRE(m["samples_trained"].get<int64_t>() > 0);
    const int64_t version = m["async/weight_version"], oldest = m["async/oldest_version"];
    CHECK(version == static_cast<int64_t>(i));  // one update a step
    CHECK(oldest <= version);
    CHECK(version - oldest <= 1);
    CHECK(m["async/staleness_max"] == version - oldest);
    CHECK(m["async/staleness_min"].get<int64_t>() >= 0);
    stale_steps += m["async/staleness_max"].get<int64_t>() > 0 ? 1 : 0;
    // The old logprobs are the behaviour's: not recomputed; the mismatch is the loss's ratio.
    CHECK(m["old_logp_recomputed"] == 0);
    CHECK(m.contains("rollout_trainer_logp/kl_k3"));
    // The first step's samples are of the weights it updates: the workers' logprobs are the
    // trainer's (as recomputed at 0).
    if (i == 0) CHECK(m["rollout_trainer_logp/max_abs"].get<double>() < 1e-4);
    CHECK(m["rollout_trainer_logp/mean_abs"].get<double>() <=
          m["rollout_trainer_logp/max_abs"].get<double>());
    CHECK(m["time/trainer_idle_s"].get<double>() >= 0);
    CHECK(m["time/rollout_idle_s"].get<double>() >= 0);
  }
  // Batches were generated (from their first token) during the update before their step.
  CHECK(stale_steps >= 1);

  // At 0 the job is the sequential one: every sample of the version it is trained on.
  const auto r0 = train(tmp, w.job, "sync", workers + " trainer.steps=3");
  INFO(r0.out);
  REQUIRE(r0.status == 0);
  for (const nlohmann::json& m : step_lines(tmp.file("sync/metrics.jsonl"))) {
    CHECK(m["async/max_staleness"] == 0);
    CHECK(m["async/staleness_max"] == 0);
  }
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

// The prompts each step trained (samples.jsonl's trained_prompts, sorted), by step; a step
// logged twice (by a run killed after its line and the run that resumed before it) counts as the
// later line says.
std::map<int64_t, std::vector<std::string>> trained_prompts(const std::string& samples) {
  std::map<int64_t, std::vector<std::string>> by_step;
  std::ifstream in(samples);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    auto ids = j["trained_prompts"].get<std::vector<std::string>>();
    std::sort(ids.begin(), ids.end());
    by_step[j["step"].get<int64_t>()] = std::move(ids);
  }
  return by_step;
}

// A trainer killed mid-run at rollout.max_staleness 1 (the batch of the next step in the making
// or made, its prompts drawn) and started again resumes from its checkpoint and trains every
// step on the prompts of the run that was not interrupted: no group lost, none used twice.
TEST_CASE(
    "a disaggregated job at rollout.max_staleness 1 killed and resumed trains each prompt once",
    "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-async-kill");
  TwoWorkers w(tmp);
  const std::string async = disaggregated(w.port0, w.port1) +
                            " rollout.max_staleness=1 checkpoint.every=1 checkpoint.keep_last=5 "
                            "logging.samples_every=1 trainer.steps=5";
  const auto r = train(tmp, w.job, "whole", async);
  INFO(r.out);
  REQUIRE(r.status == 0);
  const auto whole = trained_prompts(tmp.file("whole/samples.jsonl"));
  REQUIRE(whole.size() == 5);
  {
    tandem::test::Subprocess run(
        {"/bin/sh", "-c",
         fmt::format("exec {}/tandem train {} logging.dir={} checkpoint.dir={} {} 2>&1",
                     TANDEM_BIN_DIR, w.job, tmp.file("cut"), tmp.file("cut/ckpt"), async)});
    // Killed once the third checkpoint is written ("tandem: checkpoint <dir>/step-3").
    std::string written;
    while (written.find("step-3") == std::string::npos) {
      written = run.wait_for_line("tandem: checkpoint ", 180000);
      INFO(run.output());
      REQUIRE(!written.empty());
    }
    REQUIRE(::kill(run.pid(), SIGKILL) == 0);
    CHECK(run.stop() == 128 + SIGKILL);
  }
  const auto resumed_run = train(tmp, w.job, "cut", async);
  INFO(resumed_run.out);
  REQUIRE(resumed_run.status == 0);
  CHECK_THAT(resumed_run.out, Catch::Contains("resumed from"));
  const auto resumed = trained_prompts(tmp.file("cut/samples.jsonl"));
  CHECK(resumed == whole);
  // One pass over the data's first 20 prompts (4 a step), each once.
  std::set<std::string> once;
  size_t trained = 0;
  for (const auto& [step, ids] : resumed) {
    INFO("step " << step);
    CHECK(ids.size() == 4);
    trained += ids.size();
    once.insert(ids.begin(), ids.end());
  }
  CHECK(trained == 20);
  CHECK(once.size() == 20);
  for (const nlohmann::json& m : step_lines(tmp.file("cut/metrics.jsonl")))
    CHECK(m["async/staleness_max"].get<int64_t>() <= 1);
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}

// The batches made ahead draw their prompts before the step they belong to: a checkpoint records
// the stream after the prompts of the steps it trained, so that a resumed job draws the prompts
// of the batches made ahead again (none lost, none trained twice), and resumes within the bound.
TEST_CASE("a disaggregated job at rollout.max_staleness 1 checkpoints the prompts it trained",
          "[multiproc]") {
  const tandem::test::TempDir tmp("disaggregated-async-resume");
  TwoWorkers w(tmp);
  const std::string async = disaggregated(w.port0, w.port1) +
                            " rollout.max_staleness=1 checkpoint.every=1 checkpoint.keep_last=5";
  {
    const auto r = train(tmp, w.job, "run", async + " trainer.steps=3");
    INFO(r.out);
    REQUIRE(r.status == 0);
  }
  for (int s = 1; s <= 3; ++s) {
    std::ifstream in(tmp.file(fmt::format("run/ckpt/step-{}/trainer_state.json", s)));
    REQUIRE(in.good());
    const nlohmann::json state = nlohmann::json::parse(in);
    INFO("step " << s << ": " << state.dump());
    CHECK(state["data_position"] == 4 * s);  // rollout.prompts_per_step = 4, one epoch
    CHECK(state["extra"]["stream"]["index"] == 4 * s);
    CHECK(state["weight_version"] == s);
  }
  const auto r = train(tmp, w.job, "run", async + " trainer.steps=5");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("resumed from") != std::string::npos);
  const auto steps = step_lines(tmp.file("run/metrics.jsonl"));
  REQUIRE(steps.size() == 5);
  for (size_t i = 3; i < 5; ++i) {
    INFO("step " << i + 1 << ": " << steps[i].dump());
    CHECK(steps[i]["step"] == i + 1);
    CHECK(steps[i]["async/weight_version"] == i);
    CHECK(steps[i]["async/staleness_max"].get<int64_t>() <= 1);
  }
  std::ifstream in(tmp.file("run/ckpt/step-5/trainer_state.json"));
  REQUIRE(in.good());
  CHECK(nlohmann::json::parse(in)["data_position"] == 20);
  CHECK(w.w0->stop() == 0);
  CHECK(w.w1->stop() == 0);
}
