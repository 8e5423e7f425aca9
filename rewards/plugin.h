// A reward function in a shared library with the tandem_reward_v1 C ABI (rewards/reward_plugin.h).
#pragma once

#include <memory>

#include "rewards/reward.h"

namespace tandem::rewards {

class PluginReward : public RewardFunction {
 public:
  // dlopens `path`, resolves every symbol, checks the ABI version and runs init(config). Throws
  // tandem::Error naming the reward, the path and what failed (no such file, a missing symbol, a
  // different ABI version, init's return code and last_error) and leaves nothing loaded.
  PluginReward(std::string name, const std::string& path, const std::string& config);
  ~PluginReward() override;
  PluginReward(const PluginReward&) = delete;
  PluginReward& operator=(const PluginReward&) = delete;

  // A non-zero return code of the plugin's score gives every sample of the batch ok == false with
  // the code and the plugin's last_error; it does not throw.
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }
  const std::string& path() const { return path_; }

 private:
  struct Api;
  std::string name_;
  std::string path_;
  void* handle_ = nullptr;
  void* state_ = nullptr;
  std::unique_ptr<Api> api_;
};

}  // namespace tandem::rewards
