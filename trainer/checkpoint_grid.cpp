// Checkpoints of a grid trainer: reassembled on rank 0 through weight_sync, read back whole and
// cut to each rank's part.
#include "trainer/checkpoint_grid.h"

#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "trainer/rollout_group.h"
#include "weight_sync/plan.h"

namespace tandem::trainer {

std::string save_grid_checkpoint(const std::string& root, int64_t step, ShardedAdamW& optimizer,
                                 const JobGrid& grid, Communicator& world,
                                 const TrainerState& state, const CheckpointOptions& options,
                                 const weight_sync::SyncOptions& sync) {
  const std::unique_ptr<model::Weights> table = grid.part_table();
  model::Weights m(table->config(), table->part(), DType::f32),
      v(table->config(), table->part(), DType::f32);
  optimizer.gather_moments(m, v);

  const bool writer = world.rank() == 0;
  std::unique_ptr<model::Weights> whole;
  std::unique_ptr<AdamW> adam;
  if (writer) {
    whole = std::make_unique<model::Weights>(grid.whole_config(), DType::f32);
    adam = std::make_unique<AdamW>(*whole, optimizer.config());
  }
  // The weights from the grid's layout (the parts, or their pieces at trainer.shard =
  // "parameters"); the moments, gathered whole over each data-parallel group, from the parts'.
  const weight_sync::Layout params_src = grid.layout();
  const weight_sync::Layout parts_src = grid.sharded_params() ? grid.parts_layout() : params_src;
  const weight_sync::Layout dst =
      weight_sync::Layout::replicated({params_src.params().begin(), params_src.params().end()}, 1)
          .placed(0, world.size());
  auto move = [&](const weight_sync::Layout& src, std::vector<Tensor> from, model::Weights* to) {
    std::vector<Tensor> dst_tensors(src.params().size());
    if (to != nullptr) dst_tensors = weight_sync::bind(dst, 0, params_of(*to));
    weight_sync::Publisher(weight_sync::ReshardPlan::make(src, dst), &world, std::move(from),
                           std::move(dst_tensors), sync)
        .publish(static_cast<uint64_t>(step));
  };
  if (grid.sharded_params())
    move(params_src, weight_sync::bind_local(params_src, world.rank(), optimizer.local_params()),
         whole.get());
  else
    move(params_src, weight_sync::bind(params_src, world.rank(), params_of(optimizer.params())),
         whole.get());
  move(parts_src, weight_sync::bind(parts_src, world.rank(), params_of(m)),
       writer ? &adam->m() : nullptr);
  move(parts_src, weight_sync::bind(parts_src, world.rank(), params_of(v)),
       writer ? &adam->v() : nullptr);

  std::string dir = checkpoint_dir(root, step), error;
  if (writer) {
    try {
      adam->set_counters(optimizer.counters());
      dir = save_checkpoint(root, step, *whole, *adam, state, options);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const double ok = error.empty() ? 1 : 0;
  const std::vector<double> outcome = gather_doubles(world, std::span<const double>(&ok, 1));
  TANDEM_CHECK(outcome[0] != 0, "checkpoint of step {}: {}", step,
               writer ? error : "rank 0 could not write it (its log names the cause)");
  return dir;
}

void load_grid_checkpoint(const std::string& dir, ShardedAdamW& optimizer, const JobGrid& grid,
                          TrainerState& state) {
  model::Weights whole(grid.whole_config(), DType::f32);
  AdamW adam(whole, optimizer.config());
  TrainerState read;
  load_checkpoint(dir, whole, adam, read);
  // Everything read and checked: now this rank's part.
  if (grid.sharded_params())
    optimizer.set_local_params(*grid.cut(whole));
  else
    optimizer.params().copy_from(*grid.cut(whole));
  optimizer.set_moments(*grid.cut(adam.m()), *grid.cut(adam.v()));
  optimizer.set_counters(adam.counters());
  state = std::move(read);
}

}  // namespace tandem::trainer
