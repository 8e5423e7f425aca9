// Reshards over Gloo between real processes on loopback (tests/workers/sync_worker.cpp is each
// rank): every destination shard bitwise equal to the slice of the full tensor (rounded to bf16
// where the destination is bf16), a rank killed in the middle of a sync, a corrupted byte.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testutil.h"

namespace {

using tandem::test::RankResult;
using tandem::test::run_shell;
using tandem::test::TempDir;

// Starts n sync workers at once (torchrun's variables), waits for all (each killed after
// limit_s) and returns each rank's exit status and output.
std::vector<RankResult> run_ranks(int n, const std::string& args, const std::string& env = "",
                                  int limit_s = 60) {
  const int port = tandem::test::free_port();
  return tandem::test::run_ranks(
      n, [&](int r) { return tandem::test::torchrun_env(r, n, port) + " " + env; },
      std::string(TANDEM_BIN_DIR) + "/tandem_sync_worker " + args, limit_s);
}

void check_all_ok(const std::vector<RankResult>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    INFO("rank " << r << " output:\n" << results[r].out);
    CHECK(results[r].status == 0);
    CHECK(results[r].out.find(fmt::format("ok rank {} of {}", r, results.size())) !=
          std::string::npos);
  }
}

// Every rank ok, and each printed `text`.
void check_all_say(const std::vector<RankResult>& results, const std::string& text) {
  check_all_ok(results);
  for (const auto& r : results) {
    INFO(r.out);
    CHECK(r.out.find(text) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("zero over 4 ranks reshards into 2 tensor parallel replicas of 2 as bf16",
          "[multiproc]") {
  check_all_ok(run_ranks(4, "zero4_tp2x2"));
}

TEST_CASE(
    "zero over 4 ranks reshards into tensor parallel replicas unstaged through two receive "
    "buckets",
    "[multiproc]") {
  check_all_ok(run_ranks(4, "zero4_tp2x2 unstaged"));
}

TEST_CASE(
    "a byte corrupted on the way fails the sync on every rank by checksum and the old "
    "version stays",
    "[multiproc]") {
  const auto results = run_ranks(4, "corrupt");
  check_all_ok(results);
  for (const auto& r : results) {
    INFO(r.out);
    CHECK(r.out.find("version 2 not published: checksums differ after the transfer on rank 0 (1 "
                     "shards)") != std::string::npos);
  }
  CHECK(results[0].out.find("(here: model.") != std::string::npos);
}

// ZeRO-3: each rank holds only its local buffer of pieces; the engines get bitwise what a publish
// of the whole weights gives them, through buckets (the worker checks the bytes the publisher
// adds: 4 buckets unstaged, 2 send buckets and the bytes received staged).
TEST_CASE("zero3 local buffers of 2 ranks reshard into replicated bf16 engines as whole weights do",
          "[multiproc]") {
  check_all_ok(run_ranks(2, "zero3x2_replicated"));
}

TEST_CASE(
    "zero3 local buffers of 4 ranks reshard into replicated bf16 engines unstaged within four "
    "buckets",
    "[multiproc]") {
  // 4096-byte buckets: 16 KiB at most, against a 266 KiB f32 model.
  check_all_say(run_ranks(4, "zero3x4_replicated unstaged"), "(bound 16384)");
}

TEST_CASE(
    "zero3 local buffers reshard into tensor parallel engines as whole weights do on 2 and 4 "
    "ranks",
    "[multiproc]") {
  check_all_ok(run_ranks(2, "zero3x2_tp2 unstaged"));
  check_all_ok(run_ranks(4, "zero3x4_tp2x2"));
  check_all_ok(run_ranks(4, "zero3x4_tp4_f32 unstaged"));
}

TEST_CASE(
    "a job's rollout side publishes from zero3 pieces the engine weights it publishes from whole "
    "weights",
    "[multiproc]") {
  check_all_ok(run_ranks(2, "group 2 bf16 colocated"));
  check_all_ok(run_ranks(4, "group 1 f32 colocated"));
  check_all_ok(run_ranks(4, "group 2 f32 colocated"));
  // Disaggregated (one rank): the whole f32 weights the workers load, from the pieces.
  check_all_ok(run_ranks(1, "group 1 bf16 disaggregated"));
  check_all_ok(run_ranks(1, "group 1 f32 disaggregated"));
}

TEST_CASE("zero over 2 ranks reshards into tensor parallel 2 bitwise", "[multiproc]") {
  check_all_ok(run_ranks(2, "zero2_tp2"));
}

TEST_CASE("tensor parallel 2 reshards into one rank's full bf16 tensors", "[multiproc]") {
  check_all_ok(run_ranks(2, "tp2_tp1"));
}

TEST_CASE("a trainer rank reshards into a tensor parallel engine on two other ranks",
          "[multiproc]") {
  check_all_ok(run_ranks(3, "disaggregated"));
}

TEST_CASE("replicated ranks reshard into tensor parallel 2 without sending a byte", "[multiproc]") {
  // Every piece is on its own rank: no rounds at all.
  check_all_say(run_ranks(2, "replicated_tp2"), ": 0 rounds");
}

TEST_CASE(
    "a rank killed in the middle of a sync fails it on every other rank within the timeout "
    "naming the rank and the old version stays",
    "[multiproc]") {
  const auto results = run_ranks(4, "die 1", "TANDEM_TEST_TIMEOUT_S=5", 40);
  CHECK(results[1].status == 137);  // killed by SIGKILL
  // A survivor names the first peer whose transfer failed for it: the killed rank, or (where it
  // was still waiting on another survivor when that one gave up) that survivor. At least one
  // names the killed rank.
  int named = 0;
  for (int r : {0, 2, 3}) {
    const auto& out = results[static_cast<size_t>(r)].out;
    INFO("rank " << r << " output:\n" << out);
    CHECK(results[static_cast<size_t>(r)].status == 3);
    CHECK(out.find("weight_sync: version 2 not published") != std::string::npos);
    CHECK(out.find("destination keeps version 1") != std::string::npos);
    if (out.find("to rank 1 failed") != std::string::npos ||
        out.find("from rank 1 failed") != std::string::npos ||
        out.find("connection to rank 1 was lost") != std::string::npos ||
        out.find("rank 1 within") != std::string::npos)
      ++named;
    CHECK(out.find(fmt::format("ok rank {} of 4", r)) != std::string::npos);
    double seconds = 1e9;
    if (const size_t at = out.find("error after "); at != std::string::npos)
      seconds = std::stod(out.substr(at + 12));
    CHECK(seconds < 6.0);
  }
  CHECK(named >= 1);
}

TEST_CASE("a rank stuck in the middle of a sync makes the others time out and keep the old version",
          "[multiproc]") {
  const auto results = run_ranks(4, "stuck 2", "TANDEM_TEST_TIMEOUT_S=3", 30);
  int named = 0;
  for (int r = 0; r < 4; ++r) {
    const auto& out = results[static_cast<size_t>(r)].out;
    INFO("rank " << r << " output:\n" << out);
    CHECK(results[static_cast<size_t>(r)].status == 3);
    CHECK(out.find("weight_sync: version 2 not published") != std::string::npos);
    CHECK(out.find("destination keeps version 1") != std::string::npos);
    CHECK(out.find(fmt::format("ok rank {} of 4", r)) != std::string::npos);
    if (r == 2) continue;  // the stuck rank itself fails when it wakes
    if (out.find("no progress sending to rank 2 within 3 s") != std::string::npos ||
        out.find("no progress receiving from rank 2 within 3 s") != std::string::npos)
      ++named;
    double seconds = 1e9;
    if (const size_t at = out.find("error after "); at != std::string::npos)
      seconds = std::stod(out.substr(at + 12));
    CHECK(seconds < 4.5);  // the 3 s timeout, and not much more
  }
  CHECK(named >= 1);
}
