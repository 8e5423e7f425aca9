// The rollout a job generates its samples with and publishes each weight version to, behind one
// interface (DESIGN.md, "Parallelism and layouts"): this rank's engine (LocalRollout, its weights
// filled by the RolloutGroup's weight_sync plan) or the pool of served workers (RemoteRollout,
// trainer/disaggregated.h). The job chooses once at start and calls generate and publish without
// asking which it holds.
#pragma once

#include <cstdint>
#include <vector>

#include "rollout/engine.h"

namespace tandem::trainer {

class RolloutGroup;

class Rollout {
 public:
  virtual ~Rollout() = default;
  // Outputs in the order of `requests`; throws tandem::Error when the rollout cannot answer one.
  virtual std::vector<rollout::RequestOutput> generate(std::vector<rollout::Request> requests) = 0;
  // Samples from weight version `version` from the next generate on. The trainer's side has
  // published it (RolloutGroup::publish): this hands it to the engines that sample.
  virtual void publish(uint64_t version) = 0;
};

// This rank's engine: generate is the engine's; publish points it at the group's weights of the
// version (Engine::set_weights: running samples continue on them).
class LocalRollout final : public Rollout {
 public:
  LocalRollout(rollout::Engine& engine, const RolloutGroup& group)
      : engine_(engine), group_(group) {}
  std::vector<rollout::RequestOutput> generate(std::vector<rollout::Request> requests) override {
    return engine_.generate(std::move(requests));
  }
  void publish(uint64_t version) override;

 private:
  rollout::Engine& engine_;
  const RolloutGroup& group_;
};

}  // namespace tandem::trainer
