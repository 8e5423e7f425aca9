// The data-parallel GRPO job over real processes (tandem launch, Gloo on loopback): the weights
// after three steps on 2 ranks (and 4, deterministic) against 1, rank 0 alone writing the outputs;
// the start-up refusals of a world the batch does not allow; a rank killed mid-job; a checkpoint
// of 2 ranks resumed on 1 and on 4; a rank killed mid-save.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include "model/hf.h"
#include "model/weights.h"
#include "tests/apps/dp_job.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

using namespace tandem::test::dp_job;

const fs::path kRepo = TANDEM_SOURCE_DIR;

// Runs the job on 1 rank, then on each of `ranks`, with `overrides`; checks every step's batch,
// metrics and optimizer memory (`state_factor` x 1 rank's / ranks), and that the weights after
// 3 steps are those of 1 rank bitwise.
void check_ranks_match(const std::string& overrides, std::initializer_list<int> ranks,
                       double state_factor) {
  const tandem::test::TempDir tmp("dp-job");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const auto one = train(tmp, job, 1, "one", overrides);
  INFO(one.out);
  REQUIRE(one.status == 0);
  const auto a = step_lines(tmp.file("one/metrics.jsonl"));
  REQUIRE(a.size() == 3);
  const double moved = max_weight_diff(tmp.file("one/ckpt/step-3/policy"), tmp.file("model"));
  CHECK(moved > 1e-3);

  for (const int n : ranks) {
    INFO(n << " ranks");
    const std::string name = fmt::format("ranks{}", n);
    const auto many = train(tmp, job, n, name, overrides);
    INFO(many.out);
    REQUIRE(many.status == 0);
    // One progress line per step, from rank 0 only.
    CHECK(many.out.find("[rank 0] step 3/3") != std::string::npos);
    CHECK(many.out.find("[rank 1] step") == std::string::npos);
    const auto b = step_lines(tmp.file(name + "/metrics.jsonl"));
    REQUIRE(b.size() == 3);  // rank 0 alone appended to metrics.jsonl
    for (size_t i = 0; i < 3; ++i) {
      INFO("step " << i + 1);
      CHECK(b[i]["distributed/ranks"] == n);
      // The same batch, whichever rank generated each group.
      CHECK(b[i]["samples_trained"] == a[i]["samples_trained"]);
      CHECK(b[i]["response_tokens"] == a[i]["response_tokens"]);
      CHECK(b[i]["reward/mean"].get<double>() == Approx(a[i]["reward/mean"].get<double>()));
      CHECK(b[i]["loss"].get<double>() ==
            Approx(a[i]["loss"].get<double>()).margin(1e-6).epsilon(1e-5));
      CHECK(b[i]["grad_norm"].get<double>() ==
            Approx(a[i]["grad_norm"].get<double>()).epsilon(1e-5));
      CHECK(b[i]["memory/optimizer_state_mib"].get<double>() ==
            Approx(a[i]["memory/optimizer_state_mib"].get<double>() * state_factor / n)
                .epsilon(1e-2));
    }
    const double diff =
        max_weight_diff(tmp.file("one/ckpt/step-3/policy"), tmp.file(name + "/ckpt/step-3/policy"));
    INFO("max |w1 - w" << n << "| " << diff << " of weights that moved by up to " << moved);
    CHECK(diff == 0);
  }
}

}  // namespace

// Each minibatch (2 groups) lies on one rank: summed over the ranks it is one rank's sum, so the
// weights are equal bitwise. Where a minibatch spans ranks (4 ranks) the sum is rounded in another
// order, and the next rollouts of a tiny random model sample other tokens from the slightly
// different weights: that needs trainer.deterministic.
TEST_CASE("tandem train on 2 ranks ends with the weights of 1 rank", "[multiproc]") {
  // Moments and gradient range of 1 / ranks of the parameters, against two moments of all.
  check_ranks_match("", {2}, 1.5);
}

TEST_CASE("tandem train deterministic on 2 and 4 ranks ends with the weights of 1 rank",
          "[multiproc]") {
  check_ranks_match("trainer.deterministic=true", {2, 4}, 1.0);
}

// The sharded levels (trainer.shard): gradients reduce-scattered as backward makes them, and the
// f32 weights kept as pieces and gathered layer by layer, with the engines filled from the pieces.
TEST_CASE(
    "tandem train deterministic with gradients sharded on 2 and 4 ranks ends with the "
    "weights of 1 rank",
    "[multiproc]") {
  check_ranks_match("trainer.deterministic=true trainer.shard=gradients", {2, 4}, 1.0);
}

TEST_CASE(
    "tandem train deterministic with parameters sharded on 2 and 4 ranks ends with the "
    "weights of 1 rank",
    "[multiproc]") {
  check_ranks_match("trainer.deterministic=true trainer.shard=parameters", {2, 4}, 1.0);
}

TEST_CASE("tandem train refuses a world the batch does not allow before writing anything",
          "[multiproc]") {
  const tandem::test::TempDir tmp("dp-refuse");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  SECTION("prompts_per_step not a multiple of the ranks") {
    const auto r = train(tmp, job, 3, "run");
    INFO(r.out);
    CHECK(r.status != 0);
    CHECK(r.out.find("rollout.prompts_per_step = 4 is not a multiple of the 3 ranks") !=
          std::string::npos);
    CHECK(!fs::exists(tmp.file("run")));
  }
  SECTION("placement.ranks other than the launcher's") {
    const auto r = train(tmp, job, 1, "run", "placement.ranks=2");
    INFO(r.out);
    CHECK(r.status != 0);
    CHECK(r.out.find("placement.ranks = 2 but 1 rank was started") != std::string::npos);
    CHECK(!fs::exists(tmp.file("run")));
  }
}

TEST_CASE("a rank killed mid-job makes the other exit with an error naming it", "[multiproc]") {
  const tandem::test::TempDir tmp("dp-kill");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  // Two ranks started by hand (tandem launch would stop the survivor itself); rank 1 is killed
  // once rank 0 has finished a step.
  const std::string train = fmt::format(
      "{} train {} trainer.steps=20 distributed.timeout_s=10 logging.dir={} checkpoint.dir={}",
      tandem_bin(), job, tmp.file("run"), tmp.file("run/ckpt"));
  const std::string script = fmt::format(
      "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={}; "
      "RANK=1 LOCAL_RANK=1 {} >{} 2>&1 & p1=$!; "
      "RANK=0 LOCAL_RANK=0 {} >{} 2>&1 & p0=$!; "
      "for i in $(seq 600); do grep -q \"^step 1/20\" {} && break; sleep 0.1; done; "
      "kill -9 $p1; start=$(date +%s); wait $p0; status=$?; "
      "echo status $status seconds $(( $(date +%s) - start ))",
      tandem::test::free_port(), train, tmp.file("rank1.log"), train, tmp.file("rank0.log"),
      tmp.file("rank0.log"));
  const auto r = tandem::test::run_shell("timeout 120 bash -c '" + script + "'");
  const std::string out0 = tandem::test::read_text(tmp.file("rank0.log"));
  INFO(r.out << "\nrank 0:\n" << out0);
  CHECK(out0.find("step 1/20") != std::string::npos);
  CHECK(out0.find("step 20/20") == std::string::npos);
  CHECK(r.out.find("status 0 ") == std::string::npos);
  CHECK((out0.find("rank 1 failed") != std::string::npos ||
         out0.find("connection to rank 1 was lost") != std::string::npos));
  const size_t at = r.out.find("seconds ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stoi(r.out.substr(at + 8)) <= 12);  // within distributed.timeout_s
}

namespace {

// A deterministic job saved at step 2 by 2 ranks with `first` and resumed for step 3 on 1 rank
// with `on_one` and on 4 with `on_four` (trainer.shard levels) ends with the weights of 1 rank
// that ran straight through, bitwise.
void check_resume(const std::string& name, const std::string& first, const std::string& on_one,
                  const std::string& on_four) {
  const tandem::test::TempDir tmp(name);
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const std::string det = "trainer.deterministic=true";
  const auto straight = train(tmp, job, 1, "one", det);
  INFO(straight.out);
  REQUIRE(straight.status == 0);
  const auto saved = train(tmp, job, 2, "run", det + " trainer.steps=2 " + first);
  INFO(saved.out);
  REQUIRE(saved.status == 0);
  // Each rank wrote its range of the optimizer state; rank 0 the marker naming both.
  const fs::path step2 = tmp.file("run/ckpt/step-2");
  REQUIRE(fs::exists(step2 / "COMMITTED"));
  const auto marker = nlohmann::json::parse(tandem::test::read_text(step2 / "COMMITTED"));
  CHECK(marker["world_size"] == 2);
  CHECK(fs::exists(step2 / "optimizer/rank-00000-of-00002.safetensors"));
  CHECK(fs::exists(step2 / "optimizer/rank-00001-of-00002.safetensors"));
  CHECK(!fs::exists(step2 / "optimizer.safetensors"));
  fs::copy(tmp.file("run"), tmp.file("run4"), fs::copy_options::recursive);
  // The same job (trainer.steps = 3) resumed on one rank and on four: each rank reads the pieces
  // of the two ranks' files that overlap its range; the prompt stream continues where it was.
  for (const auto& [n, dir, level] :
       {std::tuple{1, "run", on_one}, std::tuple{4, "run4", on_four}}) {
    INFO(n << " ranks, " << level);
    const auto rest = train(tmp, job, n, dir, det + " " + level);
    INFO(rest.out);
    REQUIRE(rest.status == 0);
    CHECK(rest.out.find("resumed from " + tmp.file(std::string(dir) + "/ckpt/step-2")) !=
          std::string::npos);
    const fs::path step3 = tmp.file(std::string(dir) + "/ckpt/step-3");
    CHECK(nlohmann::json::parse(tandem::test::read_text(step3 / "COMMITTED"))["world_size"] == n);
    CHECK(max_weight_diff(tmp.file("one/ckpt/step-3/policy"), (step3 / "policy").string()) == 0);
  }
}

// The all-gather of a unit's weights before which rank 1 dies: one of the third step's (rank 0 has
// finished two steps).
constexpr int kGatherToDieIn = 40;

}  // namespace

TEST_CASE(
    "a checkpoint written by 2 ranks resumes on 1 and on 4 ranks bitwise as if it had run "
    "alone",
    "[multiproc]") {
  check_resume("dp-resume", "", "", "");
}

// The pieces of the f32 weights (parameters) are saved as one policy, which the other levels load
// whole (optimizer) or cut into their own pieces (gradients keeps whole weights too).
TEST_CASE(
    "a checkpoint written by 2 ranks with parameters sharded resumes on 1 rank with the optimizer "
    "sharded and on 4 with gradients sharded bitwise as if it had run alone",
    "[multiproc]") {
  check_resume("dp-resume-levels", "trainer.shard=parameters", "trainer.shard=optimizer",
               "trainer.shard=gradients");
}

// Rank 1 dies on its communication thread just before one of its all-gathers of a unit's weights
// (tandem_job_worker --kill-in-gather), while rank 0 takes part in that gather or the next.
TEST_CASE(
    "a rank killed in a parameter gather makes the other exit within the timeout with an error "
    "naming it",
    "[multiproc]") {
  const tandem::test::TempDir tmp("dp-kill-gather");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const std::string command = fmt::format(
      "{} {} trainer.steps=20 trainer.shard=parameters distributed.timeout_s=10 logging.dir={} "
      "checkpoint.dir={} --kill-in-gather 1:{}",
      job_worker_bin(), job, tmp.file("run"), tmp.file("run/ckpt"), kGatherToDieIn);
  const std::string script = fmt::format(
      "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={}; "
      "RANK=1 LOCAL_RANK=1 {} >{} 2>&1 & p1=$!; "
      "RANK=0 LOCAL_RANK=0 {} >{} 2>&1 & p0=$!; "
      "wait $p1; s1=$?; start=$(date +%s); wait $p0; status=$?; "
      "echo status $status $s1 seconds $(( $(date +%s) - start ))",
      tandem::test::free_port(), command, tmp.file("rank1.log"), command, tmp.file("rank0.log"));
  const auto r = tandem::test::run_shell("timeout 120 bash -c '" + script + "'");
  const std::string out0 = tandem::test::read_text(tmp.file("rank0.log")),
                    out1 = tandem::test::read_text(tmp.file("rank1.log"));
  INFO(r.out << "\nrank 0:\n" << out0 << "\nrank 1:\n" << out1);
  CHECK(out1.find(fmt::format("rank 1 dies before gather {}", kGatherToDieIn)) !=
        std::string::npos);
  CHECK(r.out.find(fmt::format(" {} seconds", 128 + SIGKILL)) != std::string::npos);
  CHECK(out0.find("step 2/20") != std::string::npos);
  CHECK(out0.find("step 3/20") == std::string::npos);
  CHECK(r.out.find("status 0 ") == std::string::npos);
  // The survivor's error names the collective, its group and the rank it lost.
  CHECK_THAT(out0, Catch::Contains("error: all_gather on group 'world/shard") &&
                       Catch::Contains("rank 1") && Catch::Contains("that rank died or gave up"));
  const size_t at = r.out.find("seconds ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stoi(r.out.substr(at + 8)) <= 12);  // within distributed.timeout_s
}

TEST_CASE(
    "a rank killed mid-save leaves the previous checkpoint the latest and a restart resumes "
    "from it",
    "[multiproc]") {
  const tandem::test::TempDir tmp("dp-kill-save");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const std::string det = "trainer.deterministic=true";
  const auto straight = train(tmp, job, 1, "one", det);
  INFO(straight.out);
  REQUIRE(straight.status == 0);
  // Rank 1 stopped after writing its range of step 2's save (rank 0 waits for every rank's part);
  // rank 0 stopped after writing the marker, before the rename. Each is killed there.
  for (const auto& [victim, stage] : {std::pair{1, "optimizer"}, std::pair{0, "committed"}}) {
    const std::string name = fmt::format("kill{}", victim);
    INFO("rank " << victim << " killed after " << stage);
    // The job worker: `tandem train` that stops the victim there (--stall-checkpoint).
    const std::string command = fmt::format(
        "{} {} {} checkpoint.every=1 logging.dir={} checkpoint.dir={} --stall-checkpoint {}:{}:2",
        job_worker_bin(), job, det, tmp.file(name), tmp.file(name + "/ckpt"), victim, stage);
    const std::string log0 = tmp.file(name + "-rank0.log"), log1 = tmp.file(name + "-rank1.log");
    const std::string script = fmt::format(
        "export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={}; "
        "RANK=1 LOCAL_RANK=1 {} >{} 2>&1 & p1=$!; "
        "RANK=0 LOCAL_RANK=0 {} >{} 2>&1 & p0=$!; "
        "for i in $(seq 600); do grep -q \"stalls at checkpoint\" {} && break; sleep 0.1; done; "
        "kill -9 $p{}; wait $p0; s0=$?; wait $p1; echo status $s0 $?",
        tandem::test::free_port(), command, log1, command, log0, victim == 0 ? log0 : log1, victim);
    const auto r = tandem::test::run_shell("timeout 120 bash -c '" + script + "'");
    const std::string out0 = tandem::test::read_text(log0), out1 = tandem::test::read_text(log1);
    INFO(r.out << "\nrank 0:\n" << out0 << "\nrank 1:\n" << out1);
    CHECK((victim == 0 ? out0 : out1).find("stalls at checkpoint stage") != std::string::npos);
    CHECK(r.out.find("status 0") == std::string::npos);
    CHECK(r.out.find(" 0\n") == std::string::npos);
    // Step 1's checkpoint is the latest; step 2's save left at most a temporary directory.
    const fs::path ckpt = tmp.file(name + "/ckpt");
    CHECK(fs::exists(ckpt / "step-1" / "COMMITTED"));
    CHECK(!fs::exists(ckpt / "step-2"));
    std::vector<std::string> leftovers;
    for (const auto& e : fs::directory_iterator(ckpt))
      if (e.path().filename().string().starts_with(".tmp-step-2-"))
        leftovers.push_back(e.path().string());
    if (victim == 1) {
      // The survivor, rank 0, saw rank 1 go and removed the temporary directory itself.
      CHECK(out0.find("abandoned") != std::string::npos);
      CHECK(leftovers.empty());
    } else {
      REQUIRE(leftovers.size() == 1);
      CHECK(fs::exists(fs::path(leftovers[0]) / "COMMITTED"));  // written, never renamed
    }

    const auto rest = train(tmp, job, 2, name, det);
    INFO(rest.out);
    REQUIRE(rest.status == 0);
    CHECK(rest.out.find("resumed from " + (ckpt / "step-1").string()) != std::string::npos);
    if (victim == 0) CHECK(rest.out.find("removed " + leftovers[0]) != std::string::npos);
    CHECK(max_weight_diff(tmp.file("one/ckpt/step-3/policy"), (ckpt / "step-3/policy").string()) ==
          0);
  }
}

TEST_CASE("tandem train deterministic with dynamic sampling and batch-std on 2 ranks",
          "[multiproc]") {
  // Groups without reward variance dropped and refilled (3 refill rounds in a step here): the kept
  // groups, the refills and the batch's advantage std are every rank's alike.
  check_ranks_match(
      "trainer.deterministic=true trainer.algorithm.dynamic_sampling=true "
      "trainer.algorithm.advantage_scale=batch-std",
      {2}, 1.0);
}

// The job started by the launchers clusters run: Open MPI's mpirun, and Slurm's variables (as srun
// sets them for each task) with the coordinator taken from the node list.
TEST_CASE("tandem train under mpirun and under Slurm variables ends with the weights of 1 rank",
          "[multiproc]") {
  const tandem::test::TempDir tmp("dp-launchers");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = write_job(tmp, tmp.file("model"));
  const std::string det = "trainer.deterministic=true";
  const auto one = train(tmp, job, 1, "one", det);
  INFO(one.out);
  REQUIRE(one.status == 0);
  auto args = [&](const std::string& name) {
    return fmt::format("{} train {} logging.dir={} checkpoint.dir={} {}", tandem_bin(), job,
                       tmp.file(name), tmp.file(name + "/ckpt"), det);
  };

  const auto mpi = tandem::test::run_shell(fmt::format(
      "MASTER_PORT={} timeout -k 2 180 mpirun --allow-run-as-root --oversubscribe -np 2 "
      "{} 2>&1",
      tandem::test::free_port(), args("mpirun")));
  INFO(mpi.out);
  REQUIRE(mpi.status == 0);
  CHECK(step_lines(tmp.file("mpirun/metrics.jsonl")).at(2)["distributed/ranks"] == 2);
  CHECK(max_weight_diff(tmp.file("one/ckpt/step-3/policy"),
                        tmp.file("mpirun/ckpt/step-3/policy")) == 0);

  std::string script = "pids=''; ";
  const int port = tandem::test::free_port();
  for (int r = 0; r < 2; ++r)
    script += fmt::format(
        "SLURM_PROCID={} SLURM_NTASKS=2 SLURM_LOCALID={} SLURM_NODEID=0 "
        "SLURM_STEP_NODELIST=localhost MASTER_PORT={} timeout -k 2 180 {} & pids=\"$pids $!\"; ",
        r, r, port, args("slurm"));
  script += "for p in $pids; do wait $p || echo failed $?; done";
  const auto slurm = tandem::test::run_shell("bash -c '" + script + "' 2>&1");
  INFO(slurm.out);
  CHECK(slurm.out.find("failed") == std::string::npos);
  CHECK(step_lines(tmp.file("slurm/metrics.jsonl")).at(2)["distributed/ranks"] == 2);
  CHECK(max_weight_diff(tmp.file("one/ckpt/step-3/policy"), tmp.file("slurm/ckpt/step-3/policy")) ==
        0);
}
