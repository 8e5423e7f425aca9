// `tandem train`: load and validate the job config (with overrides), then run the colocated loop.
// Ctrl-C finishes the current step, writes a checkpoint and exits.
#include "apps/train_command.h"

#include <atomic>
#include <csignal>
#include <cstdio>

#include "core/log.h"
#include "trainer/job.h"
#include "trainer/job_config.h"

namespace tandem::apps {
namespace {

std::string config_path;
std::vector<std::string> overrides;
bool print_config = false;
CLI::App* train_cmd = nullptr;
std::atomic<bool> stop_requested{false};

extern "C" void on_interrupt(int) { stop_requested.store(true); }

}  // namespace

void add_train_command(CLI::App& app) {
  train_cmd = app.add_subcommand("train", "run a GRPO job from a TOML config");
  train_cmd->add_option("config", config_path, "the job file (see configs/default.toml)")
      ->required();
  train_cmd->add_option("overrides", overrides, "dotted overrides: trainer.lr=1e-6 rollout.n=8");
  train_cmd->add_flag("--print-config", print_config, "print the resolved config and exit");
}

int run_train_command() {
  if (train_cmd == nullptr || !train_cmd->parsed()) return -1;
  const trainer::JobConfig job = trainer::load_job_config(config_path, overrides);
  if (print_config) {
    std::fputs(trainer::to_toml(job).c_str(), stdout);
    return 0;
  }
  apply_config_log_level(job.logging.level);
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
  const trainer::JobResult r = trainer::run_job(job, stop_requested);
  if (r.first_eval) {
    const trainer::PassInterval &a = *r.first_eval, &b = *r.last_eval;
    std::fprintf(stderr,
                 "tandem: %lld steps; held-out pass@1 %.3f [%.3f, %.3f] -> %.3f [%.3f, %.3f] "
                 "(95%% intervals, %lld prompts)\n",
                 static_cast<long long>(r.steps_done), a.pass1, a.low, a.high, b.pass1, b.low,
                 b.high, static_cast<long long>(b.prompts));
  }
  return r.interrupted ? 130 : 0;
}

}  // namespace tandem::apps
