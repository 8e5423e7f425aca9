// tandem launch: per-rank variables, output prefixed with the rank, the failing rank's status and
// the others stopped, signals passed on, ranks that end with a killed launcher, and bad input
// refused at start-up.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/apps/dp_job.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace {

std::string worker() { return std::string(TANDEM_BIN_DIR) + "/tandem_comm_worker"; }

// Whether process `pid` has ended (gone, or a zombie nobody has reaped yet).
bool ended(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren == std::string::npos || text.substr(paren + 2, 1) == "Z";
}

// Whether another process could lock `dir`'s run-directory lock now (a restart is not refused).
bool lock_free(const std::string& dir) {
  const int fd = ::open((dir + "/.tandem.lock").c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  ::close(fd);
  return ok;
}

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

TEST_CASE("killing tandem launch ends its ranks and what they started and frees the run directory",
          "[multiproc]") {
  const tandem::test::TempDir tmp("launch-killed");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const std::string job = tandem::test::dp_job::write_tiny_job(tmp, tmp.file("model"));
  // Each rank: a shell that starts a child of its own, says both pids and becomes a long job.
  const std::string rank = tmp.write(
      "rank.sh",
      fmt::format("sleep 300 &\necho pids $$ $!\nexec {} train {} trainer.steps=1000 "
                  "logging.dir={} checkpoint.dir={}\n",
                  tandem::test::dp_job::tandem_bin(), job, tmp.file("run"), tmp.file("run/ckpt")));
  const std::string log = tmp.file("launch.log");
  const auto r = tandem::test::run_shell(fmt::format(
      "timeout 300 bash -c '{}/tandem launch --nproc 2 --grace-s 2 -- sh {} >{} 2>&1 & l=$!; "
      "for i in $(seq 2400); do grep -q \"step 1/1000\" {} && break; sleep 0.1; done; "
      "kill -9 $l; wait $l; echo launcher status $?'",
      TANDEM_BIN_DIR, rank, log, log));
  INFO(r.out);
  REQUIRE(r.out.find("launcher status 137") != std::string::npos);
  std::vector<pid_t> pids;
  {
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);) {
      int rank_id = 0, a = 0, b = 0;
      if (std::sscanf(line.c_str(), "[rank %d] pids %d %d", &rank_id, &a, &b) == 3) {
        pids.push_back(a);
        pids.push_back(b);
      }
    }
  }
  // Within the grace (2 s) and a margin: every pid ends, and the locks are free (a process
  // whose main thread is already a zombie may still be closing its files).
  auto all_ended = [&] { return std::all_of(pids.begin(), pids.end(), ended); };
  auto released = [&] { return lock_free(tmp.file("run")) && lock_free(tmp.file("run/ckpt")); };
  const auto t0 = std::chrono::steady_clock::now();
  while (!(all_ended() && released()) &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::stringstream log_text;
  log_text << std::ifstream(log).rdbuf();
  INFO(log_text.str());
  REQUIRE(pids.size() == 4);
  CHECK(log_text.str().find("step 1/1000") != std::string::npos);
  const bool ok = all_ended();
  CHECK(ok);  // no rank or child of one outlives the launcher
  CHECK(lock_free(tmp.file("run")));
  CHECK(lock_free(tmp.file("run/ckpt")));
  if (!ok)  // the orphans of a launcher that could not stop them: the test's to end
    for (pid_t p : pids)
      if (!ended(p)) ::kill(p, SIGKILL);
}
