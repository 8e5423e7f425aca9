// A reward function in a shared library with the tandem_reward_v1 C ABI (rewards/reward_plugin.h).
#pragma once

#include <memory>

#include "rewards/reward.h"

namespace tandem::rewards {

class PluginProcess;

struct PluginRewardOptions {
  // Run the plugin in a child process (rewards/plugin_process.h): a crash fails one batch (its
  // samples get the fallback), is counted, and a new process scores the next batch. false: in
  // this process, where a crash of the plugin ends the job.
  bool isolate = true;
};

class PluginReward : public RewardFunction {
 public:
  using Options = PluginRewardOptions;
  // dlopens `path`, resolves every symbol, checks the ABI version and runs init(config), in a
  // child process when isolated. Throws tandem::Error naming the reward, the path and what failed
  // (no such file, a missing symbol, a different ABI version, init's return code and
  // last_error) and leaves nothing loaded.
  PluginReward(std::string name, const std::string& path, const std::string& config,
               Options options = {});
  ~PluginReward() override;
  PluginReward(const PluginReward&) = delete;
  PluginReward& operator=(const PluginReward&) = delete;

  // A non-zero return code of the plugin's score gives every sample of the batch ok == false with
  // the code and the plugin's last_error, and so does a crash of an isolated plugin; it does not
  // throw (but when the plugin no longer loads in a new process).
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }
  const std::string& path() const { return path_; }
  bool isolated() const { return process_ != nullptr; }
  int64_t crashes() const;  // calls in which the isolated plugin's process died

 private:
  struct Api;
  std::unique_ptr<PluginProcess> process_;  // when isolated; the members below stay empty
  std::string name_;
  std::string path_;
  void* handle_ = nullptr;
  void* state_ = nullptr;
  std::unique_ptr<Api> api_;
};

}  // namespace tandem::rewards
