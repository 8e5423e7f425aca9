// A reward plugin run in a child process: a crash of the plugin costs one batch, not the job.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "rewards/reward.h"

namespace tandem::rewards {

// Forks a child that loads the plugin (dlopen and init, as PluginReward does in-process) and
// scores the batches the parent sends it over a Unix socket pair. When the child dies in a call
// (a segfault, an abort, an exit), every sample of that batch fails with the signal or status,
// the crash is counted and a new child is started for the next call. The child exits when the
// parent closes the socket or dies, ignores SIGINT (the parent decides when to stop), and keeps
// only stdin, stdout, stderr and its socket open.
class PluginProcess {
 public:
  // Starts the child and waits for the plugin's init; throws tandem::Error with the child's
  // message (the same as PluginReward's) when it cannot load, or naming the crash.
  PluginProcess(std::string name, std::string path, std::string config);
  ~PluginProcess();  // closes the socket: the child frees the plugin and exits
  PluginProcess(const PluginProcess&) = delete;
  PluginProcess& operator=(const PluginProcess&) = delete;

  // The plugin's results, or N failures saying why (its return code, a crash). Throws
  // tandem::Error only when a new child cannot be started (the plugin no longer loads).
  std::vector<RewardResult> score(std::span<const RewardSample> samples);

  int64_t crashes() const;   // children that died in a call
  int64_t restarts() const;  // children started after the first
  int pid() const;           // the current child, -1 while none runs

 private:
  void start();
  // Waits for the dead (or killed) child and says how it ended: "killed by signal 11 (...)".
  std::string reap();

  std::string name_, path_, config_;
  mutable std::mutex mutex_;
  int pid_ = -1;
  int fd_ = -1;  // the parent's end of the socket pair
  int64_t crashes_ = 0, restarts_ = 0;
};

}  // namespace tandem::rewards
