// The per-rank side of the job tests that inject a fault: `tandem train` (trainer::run_job on a
// job file with overrides) with the job's test hooks set from the command line. Started alone, by
// hand with the launchers' variables, or by `tandem launch --nproc N -- tandem_job_worker ...`.
//
//   tandem_job_worker JOB.toml [key=value ...] [--stall-checkpoint RANK:STAGE:STEP]
//                     [--corrupt-engine-weights RANK:VERSION:PARAMETER] [--kill-in-gather RANK:N]
//                     [--kill-in-pipeline RANK:N]
//
// --stall-checkpoint: that rank stops at that stage of that step's checkpoint save, says so on
//   stderr ("stalls at checkpoint stage") and sleeps, for the test to kill it there; not killed
//   within 120 s, it fails.
// --corrupt-engine-weights: after that version's publish, that rank adds 100 to element 0 of its
//   engine's copy of that storage tensor (e.g. model.norm.weight; its shard at rollout_tp > 1), as
//   a corrupted shard would, and says so on stderr. The engine must have weights of its own
//   (rollout.dtype = bf16 or rollout_tp > 1): otherwise it reads the trainer's tensors, and
//   changing them is no corruption of a publish.
// --kill-in-gather: at trainer.shard = "parameters", that rank, on its communication thread just
//   before its Nth all-gather of a unit's weights (1: the first), says so on stderr ("dies before
//   gather") and kills itself with SIGKILL, as a rank lost in the middle of a step would die.
// --kill-in-pipeline: with trainer.pp > 1, that rank, before its Nth backward pass of a
//   micro-batch through its stage (1: the first), says so on stderr ("dies before backward") and
//   kills itself with SIGKILL, as a stage lost in the middle of the 1F1B schedule would die.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/log.h"
#include "trainer/job.h"
#include "trainer/job_config.h"

namespace {

using namespace tandem;

std::atomic<bool> stop_requested{false};
extern "C" void on_interrupt(int) { stop_requested.store(true); }

// "<a>:<b>:<c>" split at its first two colons (c may hold more).
std::vector<std::string> three_fields(const std::string& flag, const std::string& spec) {
  const size_t a = spec.find(':');
  const size_t b = a == std::string::npos ? a : spec.find(':', a + 1);
  TANDEM_CHECK(b != std::string::npos, "{} '{}': expected three fields separated by ':'", flag,
               spec);
  return {spec.substr(0, a), spec.substr(a + 1, b - a - 1), spec.substr(b + 1)};
}

void stall_checkpoint(trainer::JobHooks& hooks, const std::string& spec) {
  const auto f = three_fields("--stall-checkpoint", spec);
  const int victim = std::stoi(f[0]);
  const int64_t at_step = std::stoll(f[2]);
  hooks.on_checkpoint_stage = [victim, stage = f[1], at_step](int rank, int64_t step,
                                                              const std::string& at) {
    if (rank != victim || step != at_step || at != stage) return;
    std::fprintf(stderr, "tandem: rank %d stalls at checkpoint stage %s of step %lld\n", rank,
                 stage.c_str(), static_cast<long long>(step));
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(120));
    TANDEM_FAIL("--stall-checkpoint: rank {} was not killed within 120 s", rank);
  };
}

void corrupt_engine_weights(trainer::JobHooks& hooks, const std::string& spec) {
  const auto f = three_fields("--corrupt-engine-weights", spec);
  const int victim = std::stoi(f[0]);
  const uint64_t at_version = std::stoull(f[1]);
  hooks.after_publish = [victim, at_version, name = f[2]](int rank, uint64_t version,
                                                          model::Weights* engine) {
    if (rank != victim || version != at_version) return;
    TANDEM_CHECK(engine != nullptr,
                 "--corrupt-engine-weights: the engine reads the trainer's own weights "
                 "(rollout.dtype = f32, rollout_tp = 1): there is no engine copy to corrupt");
    Tensor target;
    for (const model::NamedTensor& t : engine->storage())
      if (t.name == name) target = t.tensor;
    TANDEM_CHECK(target.defined(),
                 "--corrupt-engine-weights: no storage tensor '{}' in the engine weights", name);
    if (target.dtype() == DType::bf16) {
      auto* x = target.data_as<bf16>();
      x[0] = bf16(static_cast<float>(x[0]) + 100.0f);
    } else {
      target.data_as<float>()[0] += 100.0f;
    }
    std::fprintf(stderr,
                 "tandem: rank %d corrupts element 0 of its engine's %s after publishing version "
                 "%llu\n",
                 rank, name.c_str(), static_cast<unsigned long long>(version));
  };
}

void kill_in_gather(trainer::JobHooks& hooks, const std::string& spec) {
  const size_t colon = spec.find(':');
  TANDEM_CHECK(colon != std::string::npos, "--kill-in-gather '{}': expected RANK:N", spec);
  const int victim = std::stoi(spec.substr(0, colon));
  const int64_t nth = std::stoll(spec.substr(colon + 1));
  auto seen = std::make_shared<std::atomic<int64_t>>(0);
  hooks.before_gather = [victim, nth, seen](int rank, size_t unit) {
    if (rank != victim || ++*seen != nth) return;
    std::fprintf(stderr, "tandem: rank %d dies before gather %lld (unit %zu)\n", rank,
                 static_cast<long long>(nth), unit);
    std::fflush(stderr);
    std::raise(SIGKILL);
  };
}

void kill_in_pipeline(trainer::JobHooks& hooks, const std::string& spec) {
  const size_t colon = spec.find(':');
  TANDEM_CHECK(colon != std::string::npos, "--kill-in-pipeline '{}': expected RANK:N", spec);
  const int victim = std::stoi(spec.substr(0, colon));
  const int64_t nth = std::stoll(spec.substr(colon + 1));
  auto seen = std::make_shared<int64_t>(0);
  hooks.before_stage_backward = [victim, nth, seen](int rank, int micro_batch) {
    if (rank != victim || ++*seen != nth) return;
    std::fprintf(stderr, "tandem: rank %d dies before backward %lld (micro-batch %d)\n", rank,
                 static_cast<long long>(nth), micro_batch);
    std::fflush(stderr);
    std::raise(SIGKILL);
  };
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: tandem_job_worker JOB.toml [key=value ...] [--stall-checkpoint "
                 "RANK:STAGE:STEP] [--corrupt-engine-weights RANK:VERSION:PARAMETER] "
                 "[--kill-in-gather RANK:N] [--kill-in-pipeline RANK:N]\n");
    return 2;
  }
  try {
    init_logging();
    trainer::JobHooks hooks;
    std::vector<std::string> overrides;
    for (int i = 2; i < argc; ++i) {
      const std::string arg = argv[i];
      const bool valued = arg == "--stall-checkpoint" || arg == "--corrupt-engine-weights" ||
                          arg == "--kill-in-gather" || arg == "--kill-in-pipeline";
      TANDEM_CHECK(!valued || i + 1 < argc, "{} needs a value", arg);
      if (arg == "--stall-checkpoint")
        stall_checkpoint(hooks, argv[++i]);
      else if (arg == "--corrupt-engine-weights")
        corrupt_engine_weights(hooks, argv[++i]);
      else if (arg == "--kill-in-gather")
        kill_in_gather(hooks, argv[++i]);
      else if (arg == "--kill-in-pipeline")
        kill_in_pipeline(hooks, argv[++i]);
      else
        overrides.push_back(arg);
    }
    const trainer::JobConfig job = trainer::load_job_config(argv[1], overrides);
    std::signal(SIGINT, on_interrupt);
    std::signal(SIGTERM, on_interrupt);
    const trainer::JobResult r = trainer::run_job(job, stop_requested, hooks);
    return r.interrupted ? 130 : 0;
  } catch (...) {
    std::fprintf(stderr, "tandem: error: %s\n", current_error_line(false).c_str());
    return 1;
  }
}
