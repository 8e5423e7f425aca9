// The emulated link of a Communicator: each collective lasts the time of its ring model (ranks as
// threads, and as real processes through tests/workers/comm_worker.cpp) without spending CPU, a
// split group inherits it, a group of one rank is not delayed, a CommThread hides it behind
// compute, and the job's keys set it.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/error.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "trainer/job_config.h"

namespace tandem {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One timed call of one rank, checked on the test's thread after the ranks joined.
struct Timed {
  std::string what;
  double seconds = 0, modeled = 0;
};

void check_timed(const std::vector<Timed>& calls) {
  for (const Timed& c : calls) {
    INFO(c.what << ": " << c.seconds << " s, the model " << c.modeled << " s");
    CHECK(c.seconds >= c.modeled);
    CHECK(c.seconds < 1.5 * c.modeled + 0.015);
  }
}

TEST_CASE("EmulatedLink seconds are the bits over the bandwidth plus the latency of each step",
          "[unit]") {
  CHECK(EmulatedLink{8, 10}.seconds(1e9, 3) == Approx(1.00003).epsilon(1e-12));
  CHECK(EmulatedLink{0.5, 0}.seconds(1 << 20, 1) == Approx(8.0 * (1 << 20) / 0.5e9));
  CHECK(EmulatedLink{0, 100}.seconds(1e9, 3) == 0);  // off
  CHECK_FALSE(EmulatedLink{0, 100}.on());
  CHECK(EmulatedLink{0.1, 0}.on());
}

TEST_CASE("every collective over an emulated link lasts its ring model on 2 ranks", "[unit]") {
  test::TempDir dir("comm_link_model");
  // 0.05 Gbit/s and 5 ms a step: 262144 bytes take 41.9 ms.
  const double bytes_per_s = 0.05e9 / 8, step_s = 5e-3;
  auto model = [&](double bytes, int steps) { return bytes / bytes_per_s + steps * step_s; };
  std::vector<std::vector<Timed>> calls(2);
  test::on_ranks(2, dir.path.string(), [&](int r, Communicator& comm) {
    comm.set_link({0.05, 5000});
    auto& mine = calls[static_cast<size_t>(r)];
    auto timed = [&](const std::string& what, double modeled, auto&& call) {
      comm.barrier();  // both ranks start together
      const auto t0 = std::chrono::steady_clock::now();
      call();
      mine.push_back({fmt::format("rank {} {}", r, what), seconds_since(t0), modeled});
    };
    const int64_t n = 65536;  // f32: 262144 bytes
    Tensor t = test::random_tensor({n}, DType::f32, 1 + r, -1, 1);
    Tensor twice = test::random_tensor({2 * n}, DType::f32, 3 + r, -1, 1);
    Tensor half = Tensor::empty({n / 2}, DType::f32);
    // All-reduce: a reduce-scatter and an all-gather, each sending half of the bytes in 1 step.
    timed("all_reduce", model(262144, 2), [&] { comm.all_reduce(t); });
    timed("reduce_scatter", model(262144, 1), [&] { comm.reduce_scatter(twice, t); });
    timed("all_gather", model(262144, 1), [&] { comm.all_gather(t, twice); });
    const std::vector<int64_t> counts{30000, 70000};
    Tensor piece = Tensor::empty({counts[static_cast<size_t>(r)]}, DType::f32);
    Tensor all = Tensor::empty({100000}, DType::f32);
    timed("all_gather_v", model(200000, 1), [&] { comm.all_gather_v(piece, all, counts); });
    timed("broadcast", model(262144, 1), [&] { comm.broadcast(t, 1); });
    // Rank 0 sends 262144 bytes and receives 131072, rank 1 the other way round: the larger.
    std::vector<P2POp> ops{send_to(1 - r, r == 0 ? t : half), recv_from(1 - r, r == 0 ? half : t)};
    timed("send_recv", model(262144, 1), [&] { comm.send_recv(ops); });
    timed("barrier", model(0, 1), [&] { comm.barrier(); });
  });
  for (const auto& rank_calls : calls) {
    CHECK(rank_calls.size() == 7);
    check_timed(rank_calls);
  }
}

TEST_CASE("a split group inherits the emulated link and a group of one rank is not delayed",
          "[unit]") {
  test::TempDir dir("comm_link_split");
  std::vector<std::vector<Timed>> calls(2);
  std::vector<double> refused_gbps(2), split_gbps(2), solo_seconds(2), off_seconds(2);
  std::vector<std::string> refusal(2);
  test::on_ranks(2, dir.path.string(), [&](int r, Communicator& comm) {
    const auto i = static_cast<size_t>(r);
    try {
      comm.set_link({-1, 0});
    } catch (const Error& e) {
      refusal[i] = e.what();
    }
    refused_gbps[i] = comm.link().gbps;  // unchanged by the refused call
    comm.set_link({0.05, 0});
    std::unique_ptr<Communicator> pair = comm.split("pair", {0, 1});
    std::unique_ptr<Communicator> solo = comm.split("solo", {r});
    split_gbps[i] = pair->link().gbps;
    Tensor t = test::random_tensor({262144}, DType::f32, 5 + r, -1, 1);  // 1 MiB: 168 ms
    auto t0 = std::chrono::steady_clock::now();
    solo->broadcast(t, 0);
    solo_seconds[i] = seconds_since(t0);
    Tensor small = Tensor::empty({16384}, DType::f32);  // 65536 bytes: 10.5 ms a broadcast
    comm.barrier();
    t0 = std::chrono::steady_clock::now();
    pair->broadcast(small, 0);
    calls[i].push_back({fmt::format("rank {} broadcast on the split group", r), seconds_since(t0),
                        65536 * 8 / 0.05e9});
    comm.set_link({});
    pair->set_link({});
    t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 4; ++k) pair->broadcast(small, 0);
    off_seconds[i] = seconds_since(t0);
  });
  for (size_t i = 0; i < 2; ++i) {
    INFO("rank " << i);
    CHECK(refusal[i].find("group 'world': the emulated link needs gbps >= 0 (0: off) and "
                          "latency_us >= 0, found -1 gbps") != std::string::npos);
    CHECK(refused_gbps[i] == 0);
    CHECK(split_gbps[i] == 0.05);
    CHECK(solo_seconds[i] < 0.05);
    CHECK(off_seconds[i] < 4 * 0.0105);
    check_timed(calls[i]);
  }
}

TEST_CASE("the job's distributed keys set the emulated link and refuse negative or partial ones",
          "[unit]") {
  const std::string job =
      "[model]\npath = \"m.gguf\"\n"
      "[[rewards]]\nname = \"correct\"\nfunction = \"math_match\"\n";
  const trainer::JobConfig off = trainer::parse_job_config(job, "job.toml");
  CHECK_FALSE(trainer::comm_options(off.distributed).link.on());
  const std::vector<std::string> on{"distributed.emulated_link_gbps=2.5",
                                    "distributed.emulated_link_latency_us=30",
                                    "distributed.timeout_s=7"};
  const CommOptions o =
      trainer::comm_options(trainer::parse_job_config(job, "job.toml", on).distributed);
  CHECK(o.link.gbps == 2.5);
  CHECK(o.link.latency_us == 30);
  CHECK(o.timeout_s == 7);
  for (const char* key : {"distributed.emulated_link_gbps", "distributed.emulated_link_latency_us"})
    CHECK_THROWS_WITH(trainer::parse_job_config(job, "job.toml", {{fmt::format("{}=-1", key)}}),
                      Catch::Contains(key));
  CHECK_THROWS_WITH(
      trainer::parse_job_config(job, "job.toml", {{"distributed.emulated_link_latency_us=30"}}),
      Catch::Contains("30 us is used only with an emulated bandwidth: set "
                      "distributed.emulated_link_gbps > 0 too"));
}

// --- real processes ------------------------------------------------------------------------------

// One rank's output and the numbers it printed.
struct RankNumbers {
  std::string out;
  std::vector<double> v;
};

// The worker on 2 ranks; of each (which must end well), the numbers after each `key ` on its
// line that starts with keys[0].
std::vector<RankNumbers> run_worker(const std::string& args, const std::vector<std::string>& keys) {
  const int port = test::free_port();
  const auto results = test::run_ranks(
      2, [&](int r) { return test::torchrun_env(r, 2, port) + " TANDEM_TEST_TIMEOUT_S=30"; },
      std::string(TANDEM_BIN_DIR) + "/tandem_comm_worker " + args, 60);
  std::vector<RankNumbers> ranks;
  for (size_t r = 0; r < results.size(); ++r) {
    const std::string& out = results[r].out;
    INFO("rank " << r << " output:\n" << out);
    REQUIRE(results[r].status == 0);
    CHECK(out.find(fmt::format("ok rank {} of 2", r)) != std::string::npos);
    RankNumbers mine{out, {}};
    const size_t line = out.find(keys[0] + " ");
    for (const std::string& key : keys) {
      const size_t at = line == std::string::npos ? line : out.find(key + " ", line);
      if (at != std::string::npos) mine.v.push_back(std::stod(out.substr(at + key.size() + 1)));
    }
    REQUIRE(mine.v.size() == keys.size());
    ranks.push_back(std::move(mine));
  }
  return ranks;
}

TEST_CASE("all_gathers over an emulated link of 1 Gbit/s take the modeled time asleep",
          "[multiproc]") {
  // Each rank: 4 all-gathers of 8 MiB from each rank, 268 ms on the link.
  for (const RankNumbers& r :
       run_worker("link_gather 1 8", {"wall", "modeled", "cpu", "fastest", "modeled_one"})) {
    INFO(r.out);
    const double wall = r.v[0], modeled = r.v[1], cpu = r.v[2], fastest = r.v[3],
                 modeled_one = r.v[4];
    CHECK(modeled_one == Approx((8 << 20) * 8 / 1e9).epsilon(1e-3));
    CHECK(modeled == Approx(4 * modeled_one).epsilon(1e-9));
    CHECK(fastest >= modeled_one);
    CHECK(fastest <= 1.1 * modeled_one);
    CHECK(wall >= modeled);
    CHECK(wall <= 1.5 * modeled);  // late wake-ups on a busy machine add to the slower calls
    CHECK(cpu < 0.3 * wall);       // asleep, not spinning
  }
}

TEST_CASE("all_gathers on a CommThread over an emulated link overlap the main thread's compute",
          "[multiproc]") {
  // 4 all-gathers of 1 MiB from each rank over 0.1 Gbit/s, 336 ms on the link: little real
  // transfer, which needs the cores the ranks' compute keeps busy.
  for (const RankNumbers& r :
       run_worker("link_overlap 0.1 1", {"total", "compute", "modeled", "busy", "waited"})) {
    INFO(r.out);
    const double total = r.v[0], compute = r.v[1], modeled = r.v[2], busy = r.v[3], waited = r.v[4];
    CHECK(busy >= modeled);                        // the link delayed the thread's gathers
    CHECK(total < 1.5 * std::max(compute, busy));  // run one after the other: their sum
    CHECK(waited < 0.25 * busy);                   // the exposed part
  }
}

}  // namespace
}  // namespace tandem
