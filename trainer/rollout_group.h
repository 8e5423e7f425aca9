// The rollout side of a colocated job on one rank: the weights its engine reads (the trainer's own
// tensors, a copy in rollout.dtype, or its tensor-parallel shard of placement.rollout_tp), the
// tensor-parallel group of its replica, the replica's prompts, and the weight_sync Publisher that
// fills those weights from the trainer's after each step (docs/weight-sync.md, "One publish for
// every placement").
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "model/weights.h"
#include "weight_sync/layout.h"
#include "weight_sync/transfer.h"

namespace tandem::trainer {

struct JobConfig;
struct WeightSyncSection;

// The Publisher's options of a job's [weight_sync] section.
weight_sync::SyncOptions sync_options(const WeightSyncSection& ws);

// A model's parameters as weight_sync names them: the storage tensors (fused qkv and gate_up)
// with their shapes and dtype, the tensors themselves, and the dimensions of a tensor-parallel
// split.
std::vector<weight_sync::ParamSpec> param_specs(const model::Weights& w);
std::vector<weight_sync::Param> params_of(const model::Weights& w);
weight_sync::TpDims tp_dims(const model::ModelConfig& c);

// Checks placement.rollout_tp against the world size and the loaded model's config
// (model::tp_shard_config); throws tandem::Error naming the key, the sizes and the sizes that fit.
void check_rollout_tp(const JobConfig& job, int64_t world, const model::ModelConfig& config);

// What one publish did on this rank, as the job's weight_sync/* metrics report it.
struct PublishStats {
  uint64_t version = 0;
  int64_t shared = 0, copied = 0, cast = 0;  // parameters (storage tensors) this rank holds
  int64_t bytes_written = 0;                 // into this rank's engine weights
  int64_t bytes_sent = 0;                    // to other ranks (0 colocated)
  double seconds = 0;
};

class RolloutGroup {
 public:
  // policy: the trainer's full f32 weights on this rank (outlives the group). world: the job's
  // ranks (null: one process). Collective over world: the replicas' group splits and the plan's
  // digest. The engine weights hold version 0 (policy's values) on return.
  RolloutGroup(const JobConfig& job, const model::Weights& policy, Communicator* world);

  // What the engine is built on: its weights and its tensor-parallel group (null at tp = 1).
  const model::Weights& weights() const { return engine_weights_ ? *engine_weights_ : policy_; }
  // The engine's own weights (a copy in rollout.dtype or a tensor-parallel shard); null when it
  // reads the trainer's tensors.
  model::Weights* own_weights() const { return engine_weights_.get(); }
  Communicator* tp_group() const { return group_.get(); }
  int tp() const { return tp_; }
  int replica() const { return replica_; }
  // The prompts of a round of `count` this rank generates: its replica's ranks' contiguous shares,
  // [first, last), the same on every rank of the replica.
  std::pair<size_t, size_t> replica_prompts(size_t count) const;
  // Whether the engine reads the trainer's own tensors (publishing moves no bytes).
  bool zero_copy() const { return publisher_->zero_copy(); }

  // Makes the engine weights hold policy's values (one Publisher for every placement).
  PublishStats publish(uint64_t version);

 private:
  enum class Kind { shared, copied, cast };
  const model::Weights& policy_;
  const int rank_, world_, tp_, replica_;
  std::unique_ptr<Communicator> group_;
  std::unique_ptr<model::Weights> engine_weights_;  // null: the engine reads policy_ itself
  std::unique_ptr<weight_sync::Publisher> publisher_;
  std::vector<Kind> kinds_;  // [parameter this rank holds]
};

}  // namespace tandem::trainer
