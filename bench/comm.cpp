// `tandem bench comm`: all-reduce and all-gather bandwidth over Gloo on loopback between 2 ranks
// (threads of this process, each with its own communicator and sockets), beside memcpy of the
// same bytes as the limit; and the step time of the default data-parallel job on 2 processes
// beside 1 (`tandem launch --nproc N -- tandem train configs/default.toml`).
#include <fmt/format.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/peers.h"
#include "core/comm.h"
#include "core/error.h"

namespace tandem::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Seconds of one memcpy of `bytes` (median), the limit a loopback transfer of them meets.
double memcpy_seconds(size_t bytes, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::vector<double> t;
  std::memcpy(dst.data(), src.data(), bytes);
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(t);
}

namespace fs = std::filesystem;

// Median time/step_s of the default job's steps after the first (which warms the caches) when
// launched on `procs` processes; its run, checkpoint and log files go to a temporary directory.
double dp_step_seconds(int procs, int steps) {
  const fs::path root = repo_root();
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("tandem-bench-dp-{}-{}", ::getpid(), procs);
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path bin = root / "build" / "bin" / "tandem";
  const std::string cmd = fmt::format(
      "cd '{}' && '{}' launch --nproc {} -- '{}' train configs/default.toml trainer.steps={} "
      "eval.every=0 logging.tensorboard=false logging.dir='{}' checkpoint.dir='{}' "
      "checkpoint.every=0 >'{}' 2>&1",
      root.string(), bin.string(), procs, bin.string(), steps, (dir / "run").string(),
      (dir / "ckpt").string(), (dir / "log.txt").string());
  const int status = std::system(cmd.c_str());
  TANDEM_CHECK(status == 0,
               "bench comm: the {}-process job failed (status {}); its output is in {}", procs,
               status, (dir / "log.txt").string());
  std::vector<double> t;
  std::ifstream in(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("time/step_s") && j.value("step", 0) > 1)
      t.push_back(j["time/step_s"].get<double>());
  }
  TANDEM_CHECK(!t.empty(), "bench comm: no step times in {}",
               (dir / "run" / "metrics.jsonl").string());
  fs::remove_all(dir);
  return median(t);
}

}  // namespace

int run_comm_bench(const Options& opt) {
  constexpr int kRanks = 2;
  std::vector<size_t> sizes_mib =
      opt.quick ? std::vector<size_t>{1, 4} : std::vector<size_t>{1, 4, 16, 64, 256};
  const std::vector<std::unique_ptr<Communicator>> comms =
      loopback_communicators(kRanks, 120, "bench comm");

  int emitted = 0;
  for (const char* op : {"all_reduce", "all_gather"}) {
    for (size_t mib : sizes_mib) {
      const size_t bytes = mib << 20;  // all_reduce: the tensor; all_gather: the output
      const std::string case_name = fmt::format("f32 {} MiB {} ranks gloo loopback", mib, kRanks);
      if (!Runner(opt, {}).wants(op, case_name)) continue;
      const int reps = opt.quick ? 3 : std::clamp(static_cast<int>(2048 / mib), 5, 30);
      std::vector<std::vector<double>> seconds(kRanks);
      on_rank_threads(
          kRanks,
          [&](int r) {
            Communicator& c = *comms[static_cast<size_t>(r)];
            const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
            Tensor full = Tensor::zeros({n}, DType::f32);
            Tensor part = full.narrow(r * (n / kRanks), n / kRanks);
            auto once = [&] {
              if (std::string_view(op) == "all_reduce")
                c.all_reduce(full);
              else
                c.all_gather(part, full);  // in place: part is this rank's piece of full
            };
            once();
            for (int i = 0; i < reps; ++i) {
              c.barrier();
              const auto t0 = Clock::now();
              once();
              seconds[static_cast<size_t>(r)].push_back(
                  std::chrono::duration<double>(Clock::now() - t0).count());
            }
          },
          "bench comm");
      // nccl-tests' bus bandwidth: the bytes each rank must move, whatever the algorithm.
      const double bus_factor = std::string_view(op) == "all_reduce"
                                    ? 2.0 * (kRanks - 1) / kRanks
                                    : static_cast<double>(kRanks - 1) / kRanks;
      const double t = median(seconds[0]);
      Ceilings limit;
      limit.gbytes = static_cast<double>(bytes) / memcpy_seconds(bytes, reps) / 1e9;
      limit.gbytes_source = "memcpy of the same bytes";
      Runner runner(opt, limit);
      runner.emit(Measurement{"comm", op, case_name, t, 0, bus_factor * static_cast<double>(bytes),
                              std::nullopt, 0});
      ++emitted;
    }
  }
  // The data-parallel job: every process runs rollout and training on the same cores, so on a
  // machine with fewer cores than processes times threads the step time stays about 1x; the
  // row shows what the exchange of gradients and weights costs on top.
  const std::string dp_case = "default job 2 processes vs 1";
  if (Runner(opt, {}).wants("dp_step", dp_case)) {
    const int steps = opt.quick ? 2 : 4;
    const double one = dp_step_seconds(1, steps);
    const double two = dp_step_seconds(2, steps);
    Runner(opt, {}).emit(Measurement{"comm", "dp_step", dp_case, two, 0, 0, "1 process", one});
    ++emitted;
  }
  return emitted > 0 ? 0 : 1;
}

}  // namespace tandem::bench
