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
  const model::Weights& part = optimizer.params();
  model::Weights m(part.config(), part.part(), DType::f32),
      v(part.config(), part.part(), DType::f32);
  optimizer.gather_moments(m, v);

  const bool writer = world.rank() == 0;
  std::unique_ptr<model::Weights> whole;
  std::unique_ptr<AdamW> adam;
  if (writer) {
    whole = std::make_unique<model::Weights>(grid.whole_config(), DType::f32);
    adam = std::make_unique<AdamW>(*whole, optimizer.config());
  }
  const weight_sync::Layout src = grid.layout();
  const weight_sync::Layout dst =
      weight_sync::Layout::replicated({src.params().begin(), src.params().end()}, 1)
          .placed(0, world.size());
  const weight_sync::ReshardPlan plan = weight_sync::ReshardPlan::make(src, dst);
  const std::vector<std::pair<const model::Weights*, model::Weights*>> moves = {
      {&part, whole.get()},
      {&m, writer ? &adam->m() : nullptr},
      {&v, writer ? &adam->v() : nullptr}};
  for (const auto& [from, to] : moves) {
    std::vector<Tensor> dst_tensors(src.params().size());
    if (to != nullptr) dst_tensors = weight_sync::bind(dst, 0, params_of(*to));
    weight_sync::Publisher(plan, &world, weight_sync::bind(src, world.rank(), params_of(*from)),
                           std::move(dst_tensors), sync)
        .publish(static_cast<uint64_t>(step));
  }

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
  optimizer.params().copy_from(*grid.cut(whole));
  optimizer.set_moments(*grid.cut(adam.m()), *grid.cut(adam.v()));
  optimizer.set_counters(adam.counters());
  state = std::move(read);
}

}  // namespace tandem::trainer
