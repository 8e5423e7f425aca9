// Communicator over Gloo with real processes on loopback (tests/workers/comm_worker.cpp is each
// rank): every collective against a plain reference, sub-groups, send/recv, dead and stuck peers,
// config checks, the TCP and file stores and their start-up errors.
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "core/comm.h"
#include "tests/testutil.h"

namespace {

using tandem::test::RankResult;
using tandem::test::run_shell;
using tandem::test::TempDir;

std::string worker() { return std::string(TANDEM_BIN_DIR) + "/tandem_comm_worker"; }

// The comm workers: rank r with env_of(r) (shell assignments), each killed after limit_s.
std::vector<RankResult> run_ranks(int n, const std::string& args,
                                  const std::function<std::string(int)>& env_of, int limit_s = 60) {
  return tandem::test::run_ranks(n, env_of, worker() + " " + args, limit_s);
}

std::function<std::string(int)> torchrun_env(int n, int port, const std::string& extra = "") {
  return [=](int r) {
    return fmt::format(
        "RANK={} WORLD_SIZE={} LOCAL_RANK={} MASTER_ADDR=127.0.0.1 MASTER_PORT={} {}", r, n, r,
        port, extra);
  };
}

void check_all_ok(const std::vector<RankResult>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    INFO("rank " << r << " output:\n" << results[r].out);
    CHECK(results[r].status == 0);
    CHECK(results[r].out.find(fmt::format("ok rank {} of {}", r, results.size())) !=
          std::string::npos);
  }
}

}  // namespace

TEST_CASE("every collective matches a plain reference at world size 2", "[multiproc]") {
  check_all_ok(run_ranks(2, "collectives",
                         torchrun_env(2, tandem::test::free_port(), "TANDEM_TEST_TIMEOUT_S=30")));
}

TEST_CASE("every collective matches a plain reference at world size 4", "[multiproc]") {
  check_all_ok(run_ranks(4, "collectives",
                         torchrun_env(4, tandem::test::free_port(), "TANDEM_TEST_TIMEOUT_S=30")));
}

TEST_CASE(
    "point to point transfers between some ranks leave the next collective of all ranks in step",
    "[multiproc]") {
  check_all_ok(run_ranks(4, "p2p_then_collective",
                         torchrun_env(4, tandem::test::free_port(), "TANDEM_TEST_TIMEOUT_S=5"),
                         30));
}

TEST_CASE("the file store bootstraps ranks from a shared directory", "[multiproc]") {
  TempDir shared("comm_file_store");
  check_all_ok(run_ranks(2, "collectives",
                         torchrun_env(2, tandem::test::free_port(),
                                      "TANDEM_TEST_STORE=file:" + shared.path.string())));
}

TEST_CASE("a killed rank makes the others fail naming the collective and the peer", "[multiproc]") {
  const auto results =
      run_ranks(3, "die 2", torchrun_env(3, tandem::test::free_port(), "TANDEM_TEST_TIMEOUT_S=8"));
  CHECK(results[2].status == 137);  // killed by SIGKILL (timeout reports 128 + 9)
  for (int r = 0; r < 2; ++r) {
    const auto& out = results[static_cast<size_t>(r)].out;
    INFO("rank " << r << " output:\n" << out);
    CHECK(results[static_cast<size_t>(r)].status == 3);
    CHECK(out.find("all_reduce on group 'world'") != std::string::npos);
    CHECK((out.find("rank 2 failed") != std::string::npos ||
           out.find("connection to rank 2 was lost") != std::string::npos));
    CHECK(out.find("cannot be used again") != std::string::npos);
    double seconds = 1e9;
    if (const size_t at = out.find("error after "); at != std::string::npos)
      seconds = std::stod(out.substr(at + 12));
    CHECK(seconds < 9.0);
  }
}

TEST_CASE("a stuck rank makes the others time out naming the collective and the peer",
          "[multiproc]") {
  const auto results = run_ranks(
      2, "stuck 1", torchrun_env(2, tandem::test::free_port(), "TANDEM_TEST_TIMEOUT_S=2"), 5);
  const auto& out = results[0].out;
  INFO(out);
  CHECK(results[0].status == 3);
  CHECK(out.find("all_reduce on group 'world' (rank 0 of 2, 16384 bytes)") != std::string::npos);
  CHECK(out.find("rank 1 within 2 s (distributed.timeout_s)") != std::string::npos);
  CHECK(results[1].status == 124);  // the stuck rank, ended by the test's timeout
}

TEST_CASE("verify_same_config names the keys that differ between ranks", "[multiproc]") {
  const auto same = run_ranks(2, "config same", torchrun_env(2, tandem::test::free_port()));
  for (const auto& r : same) {
    INFO(r.out);
    CHECK(r.status == 0);
    CHECK(r.out.find("same config") != std::string::npos);
  }
  const auto differ = run_ranks(2, "config differ", torchrun_env(2, tandem::test::free_port()));
  for (const auto& r : differ) {
    INFO(r.out);
    CHECK(r.status == 3);
    CHECK(r.out.find("run different configs") != std::string::npos);
    CHECK(r.out.find("trainer.lr: rank 0 has 1e-05, rank 1 has 2e-05") != std::string::npos);
    CHECK(r.out.find("rollout.n: rank 0 has 8, rank 1 lacks it") != std::string::npos);
    CHECK(r.out.find("steps") == std::string::npos);
  }
}

TEST_CASE("a coordinator port in use is a clear error at start-up", "[multiproc]") {
  tandem::rendezvous::TcpStoreServer holder(0);
  const auto results = run_ranks(1, "info", [&](int) {
    return fmt::format("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={}", holder.port());
  });
  INFO(results[0].out);
  CHECK(results[0].status == 3);
  CHECK(results[0].out.find(fmt::format("cannot serve the tcp store on port {}", holder.port())) !=
        std::string::npos);
  CHECK(results[0].out.find("pick a free port") != std::string::npos);
}

TEST_CASE("an unreachable coordinator is an error naming its address after the timeout",
          "[multiproc]") {
  const int port = tandem::test::free_port();
  const auto t0 = std::chrono::steady_clock::now();
  const auto results = run_ranks(1, "info", [&](int) {
    return fmt::format(
        "RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} TANDEM_TEST_TIMEOUT_S=1", port);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(results[0].out);
  CHECK(results[0].status == 3);
  CHECK(results[0].out.find(fmt::format("cannot reach the coordinator's tcp store at 127.0.0.1:{}",
                                        port)) != std::string::npos);
  CHECK(s < 5);
}

TEST_CASE("a rank that never comes is named after the timeout", "[multiproc]") {
  const auto results = run_ranks(2, "info", [&, port = tandem::test::free_port()](int r) {
    return fmt::format(
        "RANK={} WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT={} "
        "TANDEM_TEST_TIMEOUT_S=1",
        r, port);
  });
  for (const auto& r : results) {
    INFO(r.out);
    CHECK(r.status == 3);
    CHECK(r.out.find("never wrote") != std::string::npos);
    CHECK(r.out.find("'world/2'") != std::string::npos);
  }
}
