// A job's trainer laid out as a data x tensor x pipeline parallel grid (trainer.tp, trainer.pp;
// trainer/parallel/grid.h): this rank's coordinates and groups, its part of the model (the stage's
// layers of its tensor-parallel shard), the sharded optimizer's and the trainer's options for that
// part, and the weight_sync layout of the whole grid that rollout engines and checkpoints are
// resharded from (docs/distributed.md, "Tensor and pipeline parallelism").
#pragma once

#include <memory>
#include <vector>

#include "core/comm.h"
#include "model/config.h"
#include "model/weights.h"
#include "trainer/optimizer.h"
#include "trainer/parallel/grid.h"
#include "trainer/train_step.h"
#include "weight_sync/layout.h"

namespace tandem::trainer {

struct JobConfig;

// Checks trainer.tp and trainer.pp against the job's world and the model (the heads, key-value
// heads, MLP width and vocabulary tp splits; the layers pp stages take); throws tandem::Error
// naming the key, the sizes and the sizes that fit.
void check_trainer_grid(const JobConfig& job, int64_t world, const model::ModelConfig& config);

class JobGrid {
 public:
  // Collective over world: splits its groups (every rank the same calls in the same order).
  JobGrid(const JobConfig& job, Communicator& world, const model::ModelConfig& whole);

  const ParallelGrid& grid() const { return grid_; }
  const GridCoord& at() const { return at_; }
  int dp_size() const { return grid_.dp_size(); }
  // The data-parallel group (the optimizer's ranks; null when dp = 1).
  Communicator* dp() const { return dp_.get(); }
  // This rank's part of `whole` (f32): its tensor-parallel shard's layers of its stage.
  std::unique_ptr<model::Weights> cut(const model::Weights& whole) const;
  // The part's table without memory (its config and the names and shapes of its tensors).
  std::unique_ptr<model::Weights> part_table() const;
  // `base` (trainer.shard's options) with the grid's: the model-parallel group the global norm
  // sums over, the replicas this rank leaves out of it, the tied embedding's copies.
  ShardOptions shard_options(ShardOptions base) const;
  ModelParallel model_parallel() const;
  // The whole model's parameters over the grid's ranks, every rank its whole part, in f32
  // (weight_sync::Layout::grid): where the weights lie below trainer.shard = "parameters", and
  // the moments a checkpoint gathers (ShardedAdamW::gather_moments) at every level.
  weight_sync::Layout parts_layout() const;
  // Where the weights lie, in f32: parts_layout(), or at trainer.shard = "parameters"
  // weight_sync::Layout::grid_zero (each position's part split over its
  // data-parallel group as ShardedAdamW splits it: model::ShardLayout of its part's table), whose
  // local tensor on a rank is its optimizer's local_params().
  weight_sync::Layout layout() const;
  // Whether the grid's ranks keep only their data-parallel group's pieces of their part
  // (trainer.shard = "parameters").
  bool sharded_params() const { return sharded_params_; }
  const model::ModelConfig& whole_config() const { return whole_; }

 private:
  // Stage s's part's table (the tensor-parallel shard's layers of the stage).
  std::unique_ptr<model::Weights> part_table(int stage) const;
  // Each stage's layers.
  std::vector<weight_sync::LayerRange> stage_ranges() const;

  ParallelGrid grid_;
  GridCoord at_;
  bool sharded_params_ = false;
  model::ModelConfig whole_;
  StageLayers layers_;
  std::unique_ptr<Communicator> dp_, tp_, pp_, mp_, tie_;
};

}  // namespace tandem::trainer
