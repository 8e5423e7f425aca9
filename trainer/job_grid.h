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
  // The whole model's parameters over the grid's ranks (weight_sync::Layout::grid), in f32.
  weight_sync::Layout layout() const;
  const model::ModelConfig& whole_config() const { return whole_; }

 private:
  ParallelGrid grid_;
  GridCoord at_;
  model::ModelConfig whole_;
  StageLayers layers_;
  std::unique_ptr<Communicator> dp_, tp_, pp_, mp_, tie_;
};

}  // namespace tandem::trainer
