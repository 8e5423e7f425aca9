// Layout-free checkpoints of a trainer laid out as a data x tensor x pipeline parallel grid
// (trainer.tp, trainer.pp): the same directory a one-rank job writes (the policy as one HF
// directory, the whole model's AdamW moments and counters, the trainer state), so that any layout
// resumes it and any layout's checkpoint resumes here (docs/distributed.md, "Checkpoints across
// layouts").
#pragma once

#include <string>

#include "core/comm.h"
#include "trainer/checkpoint.h"
#include "trainer/job_grid.h"
#include "trainer/optimizer.h"
#include "weight_sync/transfer.h"

namespace tandem::trainer {

// Collective over world (the grid's ranks): every rank's part of the weights and of the moments
// (gathered over its data-parallel group) goes to rank 0 through a weight_sync plan from the
// grid's layout, in buckets of sync.bucket_bytes; rank 0 then writes the checkpoint of the whole
// model as save_checkpoint's one-rank overload does (temporary directory, renamed) and every rank
// learns whether it succeeded (a failure throws on every rank, naming rank 0's error there).
// Rank 0 holds the whole model's f32 weights and moments while it writes. Returns the directory.
std::string save_grid_checkpoint(const std::string& root, int64_t step, ShardedAdamW& optimizer,
                                 const JobGrid& grid, Communicator& world,
                                 const TrainerState& state, const CheckpointOptions& options,
                                 const weight_sync::SyncOptions& sync);

// Restores a checkpoint written under any layout (any number of data-parallel ranks, trainer.shard
// level, or grid) into this rank's part: the whole model read and checked as load_checkpoint
// does, then cut to the part (its weights and its pieces of the moments). Not collective.
void load_grid_checkpoint(const std::string& dir, ShardedAdamW& optimizer, const JobGrid& grid,
                          TrainerState& state);

}  // namespace tandem::trainer
