// JobGrid: the groups of a DP x TP x PP trainer, split from the job's world in one order on every
// rank, and the part of the model, the optimizer's options and the weight_sync layout of a rank.
#include "trainer/job_grid.h"

#include <fmt/format.h>

#include <string>

#include "core/error.h"
#include "model/tensor_parallel.h"
#include "trainer/job_config.h"
#include "trainer/rollout_group.h"

namespace tandem::trainer {

namespace {

constexpr const char* kEmbed = "model.embed_tokens.weight";

}  // namespace

void check_trainer_grid(const JobConfig& job, int64_t world, const model::ModelConfig& config) {
  const int64_t tp = job.trainer.tp, pp = job.trainer.pp;
  int64_t dp = 0;
  try {
    dp =
        ParallelGrid(static_cast<int>(world), static_cast<int>(tp), static_cast<int>(pp)).dp_size();
  } catch (const Error& e) {
    TANDEM_FAIL("{} ({}, {})", e.what(), job.where("trainer.tp"), job.where("trainer.pp"));
  }
  TANDEM_CHECK(job.rollout.prompts_per_step % dp == 0,
               "rollout.prompts_per_step = {} is not a multiple of the {} data-parallel replicas "
               "({} ranks / trainer.tp {} / trainer.pp {}): each replica trains whole groups ({})",
               job.rollout.prompts_per_step, dp, world, tp, pp,
               job.where("rollout.prompts_per_step"));
  if (tp > 1) {
    try {
      model::tp_shard_config(config, static_cast<int>(tp));
    } catch (const Error& e) {
      TANDEM_FAIL("trainer.tp = {} does not fit the model '{}': {} ({})", tp, job.model.path,
                  e.what(), job.where("trainer.tp"));
    }
    TANDEM_CHECK(config.num_kv_heads % tp == 0,
                 "trainer.tp = {} does not divide the model's {} key-value heads: a head "
                 "replicated on several ranks would need its gradients summed, which training "
                 "does not do (a rollout engine may: placement.rollout_tp); use a divisor of {} "
                 "({})",
                 tp, config.num_kv_heads, config.num_kv_heads, job.where("trainer.tp"));
  }
  TANDEM_CHECK(pp <= config.num_layers,
               "trainer.pp = {} does not fit the model '{}' of {} layers: each stage needs a "
               "layer ({})",
               pp, job.model.path, config.num_layers, job.where("trainer.pp"));
}

JobGrid::JobGrid(const JobConfig& job, Communicator& world, const model::ModelConfig& whole)
    : grid_(world.size(), static_cast<int>(job.trainer.tp), static_cast<int>(job.trainer.pp)),
      at_(grid_.coord(world.rank())),
      sharded_params_(job.trainer.shard.level == ShardLevel::parameters),
      whole_(whole),
      layers_(stage_layers(static_cast<int>(whole.num_layers), at_.pp, grid_.pp_size())) {
  const int r = world.rank(), tp = grid_.tp_size(), pp = grid_.pp_size();
  // Every rank splits the same kinds in the same order, each into its own group of the kind.
  if (grid_.dp_size() > 1)
    dp_ = world.split(fmt::format("grid-dp{}.{}", at_.pp, at_.tp), grid_.dp_group(r));
  if (pp > 1) pp_ = world.split(fmt::format("grid-pp{}.{}", at_.dp, at_.tp), grid_.pp_group(r));
  if (tp > 1) tp_ = world.split(fmt::format("grid-tp{}.{}", at_.pp, at_.dp), grid_.tp_group(r));
  // The model-parallel ranks of this data-parallel index, in rank order: the global norm's parts.
  std::vector<int> mp;
  for (int s = 0; s < pp; ++s)
    for (int t = 0; t < tp; ++t) mp.push_back(grid_.rank({at_.dp, t, s}));
  mp_ = world.split(fmt::format("grid-mp{}", at_.dp), mp);
  if (whole.tie_word_embeddings && pp > 1 && (at_.pp == 0 || at_.pp == pp - 1))
    tie_ = world.split(fmt::format("grid-tie{}.{}", at_.dp, at_.tp),
                       {grid_.rank({at_.dp, at_.tp, 0}), grid_.rank({at_.dp, at_.tp, pp - 1})});
}

std::unique_ptr<model::Weights> JobGrid::part_table() const { return part_table(at_.pp); }

std::unique_ptr<model::Weights> JobGrid::part_table(int stage) const {
  const model::ModelConfig c =
      grid_.tp_size() > 1 ? model::tp_shard_config(whole_, grid_.tp_size()) : whole_;
  const StageLayers l = stage_layers(static_cast<int>(whole_.num_layers), stage, grid_.pp_size());
  return model::Weights::unbound(c, model::ModelPart::stage(c, l.first, l.end - l.first),
                                 DType::f32);
}

std::unique_ptr<model::Weights> JobGrid::cut(const model::Weights& whole) const {
  std::unique_ptr<model::Weights> shard;
  if (grid_.tp_size() > 1) shard = model::cut_tp_shard(whole, at_.tp, grid_.tp_size());
  const model::Weights& from = shard ? *shard : whole;
  auto part = std::make_unique<model::Weights>(
      from.config(),
      model::ModelPart::stage(from.config(), layers_.first, layers_.end - layers_.first),
      DType::f32);
  part->copy_from(from);
  return part;
}

ShardOptions JobGrid::shard_options(ShardOptions o) const {
  o.model_parallel = mp_.get();
  const bool copies = tie_ != nullptr;
  if (copies) o.shared = {{kEmbed, tie_.get()}};
  // Stage 0 counts the tied embedding's values, tensor-parallel rank 0 the replicated norms.
  if (copies && at_.pp == grid_.pp_size() - 1) o.norm_excluded.push_back(kEmbed);
  const std::unique_ptr<model::Weights> table = part_table();
  if (at_.tp > 0)
    for (const model::NamedTensor& n : table->storage())
      if (n.name.find("norm") != std::string::npos) o.norm_excluded.push_back(n.name);
  return o;
}

ModelParallel JobGrid::model_parallel() const {
  return {.tp = tp_.get(), .pp = pp_.get(), .tp_kv_heads = whole_.num_kv_heads};
}

std::vector<weight_sync::LayerRange> JobGrid::stage_ranges() const {
  std::vector<weight_sync::LayerRange> stages;
  for (int s = 0; s < grid_.pp_size(); ++s) {
    const StageLayers l = stage_layers(static_cast<int>(whole_.num_layers), s, grid_.pp_size());
    stages.push_back({l.first, l.end});
  }
  return stages;
}

weight_sync::Layout JobGrid::parts_layout() const {
  return weight_sync::Layout::grid(tp_dims(whole_),
                                   param_specs(*model::Weights::unbound(whole_, DType::f32)),
                                   grid_.tp_size(), grid_.dp_size(), stage_ranges());
}

weight_sync::Layout JobGrid::layout() const {
  if (!sharded_params_) return parts_layout();
  // Every tensor-parallel rank of a stage holds a table of the same shapes.
  std::vector<model::ShardLayout> shards;
  for (int s = 0; s < grid_.pp_size(); ++s) {
    const model::ShardLayout stage(*part_table(s), grid_.dp_size());
    for (int t = 0; t < grid_.tp_size(); ++t) shards.push_back(stage);
  }
  return weight_sync::Layout::grid_zero(tp_dims(whole_),
                                        param_specs(*model::Weights::unbound(whole_, DType::f32)),
                                        grid_.tp_size(), stage_ranges(), shards);
}

}  // namespace tandem::trainer
