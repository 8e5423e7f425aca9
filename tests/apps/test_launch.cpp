// tandem launch: per-rank variables, output prefixed with the rank, the failing rank's status and
// the others stopped, signals passed on, and bad input refused at start-up.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "tests/testutil.h"

namespace {

std::string worker() { return std::string(TANDEM_BIN_DIR) + "/tandem_comm_worker"; }

}  // namespace

TEST_CASE("tandem launch gives each rank its variables and prefixes its output", "[multiproc]") {
  const auto res =
      tandem::test::run_tandem(fmt::format("launch --nproc 3 -- {} info", worker()), true, 60);
  INFO(res.out);
  CHECK(res.status == 0);
  for (int r = 0; r < 3; ++r)
    CHECK(res.out.find(fmt::format("[rank {}] rank {} world 3 local {} node 0 launcher torchrun "
                                   "master 127.0.0.1:",
                                   r, r, r)) != std::string::npos);
  CHECK(res.out.find("sum 6") != std::string::npos);
}

TEST_CASE("tandem launch stops the others and exits with the failing rank's status",
          "[multiproc]") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto res = tandem::test::run_tandem(
      fmt::format("launch --nproc 3 --grace-s 2 -- {} fail 1 7", worker()), true, 60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(res.out);
  CHECK(res.status == 7);
  CHECK(s < 20);  // the others would sleep 60 s
  CHECK(res.out.find("[rank 0] hello from 0") != std::string::npos);
  CHECK(res.out.find("[rank 2] partial line from 2 finished") != std::string::npos);
  CHECK(res.out.find("tandem launch: rank 1 exited with status 7; stopping the other ranks") !=
        std::string::npos);
  CHECK(res.out.find("its last output:\n  [rank 1] hello from 1") != std::string::npos);
  CHECK(res.out.find("[rank 1] boom: rank 1 gives up") != std::string::npos);
  CHECK(res.out.find("slept to the end") == std::string::npos);
}

TEST_CASE("tandem launch passes SIGTERM to its ranks", "[multiproc]") {
  const auto t0 = std::chrono::steady_clock::now();
  // The launcher gets SIGTERM after a second; no rank fails by itself (rank 9 does not exist).
  const auto res =
      tandem::test::run_shell(fmt::format("{}/tandem launch --nproc 2 -- {} fail 9 7 2>&1 & "
                                          "pid=$!; sleep 1; kill -TERM $pid; wait $pid; "
                                          "echo status $?",
                                          TANDEM_BIN_DIR, worker()));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(res.out);
  CHECK(res.out.find("passing it to the ranks") != std::string::npos);
  CHECK(res.out.find("status 143") != std::string::npos);
  CHECK(s < 20);
}

TEST_CASE("tandem launch refuses bad input at start-up", "[multiproc]") {
  auto error_of = [](const std::string& args) {
    return tandem::test::run_tandem("launch " + args, true, 20);
  };
  auto r = error_of("--nproc 0 -- true");
  CHECK(r.status == 1);
  CHECK(r.out.find("--nproc 0 must be at least 1") != std::string::npos);
  r = error_of("--nproc 2 --nnodes 2 --node-rank 2 --master h:1 -- true");
  CHECK(r.out.find("--node-rank 2 is out of range for --nnodes 2") != std::string::npos);
  r = error_of("--nproc 2 --nnodes 2 --node-rank 1 -- true");
  CHECK(r.out.find("needs --master HOST:PORT") != std::string::npos);
  r = error_of("--nproc 2 -- /nonexistent/program");
  CHECK(r.status == 127);
  CHECK(r.out.find("cannot run '/nonexistent/program'") != std::string::npos);
}

TEST_CASE("tandem launch shares the node's CPUs among its ranks unless told", "[multiproc]") {
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  const std::string expected =
      fmt::format("threads {} {}", std::max(1, cpus / 2), std::max(1, cpus / 2));
  const auto shared = tandem::test::run_tandem(
      "launch --nproc 2 -- sh -c 'echo threads $TANDEM_NUM_THREADS $OMP_NUM_THREADS'", true, 60,
      "unset TANDEM_NUM_THREADS OMP_NUM_THREADS;");
  INFO(shared.out);
  CHECK(shared.status == 0);
  CHECK(shared.out.find("[rank 0] " + expected) != std::string::npos);
  CHECK(shared.out.find("[rank 1] " + expected) != std::string::npos);
  const auto told =
      tandem::test::run_tandem("launch --nproc 2 -- sh -c 'echo threads $TANDEM_NUM_THREADS'", true,
                               60, "TANDEM_NUM_THREADS=3");
  INFO(told.out);
  CHECK(told.out.find("[rank 1] threads 3") != std::string::npos);
}
