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
#include "model/shard_layout.h"
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
  // The same for a trainer that keeps only its ZeRO-3 pieces (trainer.shard = parameters): the
  // model's config, the split of its storage tensors over the ranks of `world` (the optimizer's
  // layout()) and this rank's local buffer of pieces (f32, shards.local_size() elements: its
  // local_params(); the memory outlives the group and is refilled in place by each step).
  // Publishing reshards those pieces straight into the engines' layout in buckets of
  // weight_sync.bucket_mb (docs/weight-sync.md, "From sharded parameters"): no rank builds the
  // whole f32 model, and the engine always holds its own copy.
  RolloutGroup(const JobConfig& job, const model::ModelConfig& config,
               const model::ShardLayout& shards, const Tensor& local, Communicator* world);
  // The same for a trainer laid out as a data x tensor x pipeline parallel grid (trainer.tp,
  // trainer.pp): `grid` is the whole model's parameters over the job's ranks
  // (trainer::JobGrid::layout: weight_sync::Layout::grid, or grid_zero at trainer.shard =
  // "parameters") and `from` this rank's tensors of it (weight_sync::bind of its part, or
  // bind_local of its optimizer's pieces; their memory outlives the group and is refilled in
  // place by each step). Each engine's elements come from the ranks that hold them, spread over
  // the data-parallel replicas; the engine always holds its own copy.
  RolloutGroup(const JobConfig& job, const model::ModelConfig& config,
               const weight_sync::Layout& grid, std::vector<Tensor> from, Communicator* world);

  // What the engine is built on: its weights and its tensor-parallel group (null at tp = 1).
  const model::Weights& weights() const { return engine_weights_ ? *engine_weights_ : *policy_; }
  // The engine's own weights (a copy in rollout.dtype or a tensor-parallel shard); null when it
  // reads the trainer's tensors.
  model::Weights* own_weights() const { return engine_weights_.get(); }
  // The policy's whole f32 weights on this rank, which a disaggregated job pushes to its workers
  // after each publish: the trainer's own when it keeps them whole; from ZeRO-3 pieces, the
  // engine's weights where they are the whole model in f32 (placement.rollout_tp = 1,
  // rollout.dtype = f32), else a copy the group keeps on rank 0 of a disaggregated job and
  // refills at every publish. Throws tandem::Error on other ranks and colocated jobs then.
  const model::Weights& whole_policy() const;
  Communicator* tp_group() const { return group_.get(); }
  int tp() const { return tp_; }
  int replica() const { return replica_; }
  // The prompts of a round of `count` this rank generates: its replica's ranks' contiguous shares,
  // [first, last), the same on every rank of the replica.
  std::pair<size_t, size_t> replica_prompts(size_t count) const;
  // Whether the engine reads the trainer's own tensors (publishing moves no bytes).
  bool zero_copy() const { return publisher_->zero_copy(); }
  // Bytes the publishers hold beyond the weights (their buckets, or staging buffers).
  int64_t added_bytes() const;

  // Makes the engine weights hold policy's values (one Publisher for every placement).
  PublishStats publish(uint64_t version);

 private:
  enum class Kind { shared, copied, cast };
  // The members every constructor sets: the placement's sizes of this rank.
  RolloutGroup(const JobConfig& job, const model::Weights* policy, Communicator* world);
  // Allocates the engine weights and the tensor-parallel group.
  void make_engine(const model::ModelConfig& config, Communicator* world);
  // The plan from `src` (this rank's tensors `from`) into the engines' layout of the model
  // `config`, and version 0.
  void make_publisher(const JobConfig& job, const model::ModelConfig& config,
                      const weight_sync::Layout& src, std::vector<Tensor> from,
                      Communicator* world);
  // A disaggregated job whose engine is not the whole f32 model (placement.rollout_tp > 1, or
  // rollout.dtype other than f32): rank 0's whole f32 copy for its workers, from `src`.
  void make_whole(const JobConfig& job, const model::ModelConfig& config,
                  const weight_sync::Layout& src, std::vector<Tensor> from, Communicator* world);

  const model::Weights* policy_;  // null: the trainer keeps ZeRO-3 pieces only
  const int rank_, world_, tp_, replica_;
  const DType dtype_;
  std::unique_ptr<Communicator> group_;
  std::unique_ptr<model::Weights> engine_weights_;  // null: the engine reads *policy_ itself
  std::unique_ptr<weight_sync::Publisher> publisher_;
  std::vector<Kind> kinds_;  // [parameter this rank holds]
  // From ZeRO-3 pieces in a disaggregated job whose engine is not the whole f32 model: the whole
  // f32 weights on rank 0 and their publisher.
  std::unique_ptr<model::Weights> whole_;
  std::unique_ptr<weight_sync::Publisher> whole_publisher_;
};

}  // namespace tandem::trainer
