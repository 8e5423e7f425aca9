// RolloutGroup: the engine weights of a colocated rank, its tensor-parallel replica, and their
// publish through weight_sync: a plan from the trainer's replicated weights to the engines' layout
// (every piece within the rank, so colocated publishing sends nothing), or from its ZeRO-3 pieces
// (each element from the rank that owns it, in buckets).
#include "trainer/rollout_group.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/half.h"
#include "model/tensor_parallel.h"
#include "trainer/job_config.h"
#include "weight_sync/layout.h"
#include "weight_sync/plan.h"

namespace tandem::trainer {

weight_sync::SyncOptions sync_options(const WeightSyncSection& ws) {
  weight_sync::SyncOptions o;
  o.bucket_bytes = ws.bucket_mb << 20;
  o.staged = ws.staged;
  o.checksums = ws.checksums;
  return o;
}

std::vector<weight_sync::ParamSpec> param_specs(const model::Weights& w) {
  std::vector<weight_sync::ParamSpec> specs;
  for (size_t i = 0; i < w.storage().size(); ++i)  // bound or not
    specs.push_back({w.storage()[i].name, w.storage_shape(i), w.dtype()});
  return specs;
}

std::vector<weight_sync::Param> params_of(const model::Weights& w) {
  std::vector<weight_sync::Param> params;
  for (const model::NamedTensor& t : w.storage()) params.push_back({t.name, t.tensor});
  return params;
}

weight_sync::TpDims tp_dims(const model::ModelConfig& c) {
  return {c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size};
}

void check_rollout_tp(const JobConfig& job, int64_t world, const model::ModelConfig& config) {
  const int64_t tp = job.placement.rollout_tp;
  TANDEM_CHECK(world % tp == 0,
               "placement.rollout_tp = {} does not divide the {} ranks: each rollout replica is "
               "{} ranks of the job; start a multiple of {} ranks or set placement.rollout_tp to "
               "a divisor of {} ({})",
               tp, world, tp, tp, world, job.where("placement.rollout_tp"));
  if (tp == 1) return;
  try {
    model::tp_shard_config(config, static_cast<int>(tp));
  } catch (const Error& e) {
    TANDEM_FAIL("placement.rollout_tp = {} does not fit the model '{}': {} ({})", tp,
                job.model.path, e.what(), job.where("placement.rollout_tp"));
  }
}

RolloutGroup::RolloutGroup(const JobConfig& job, const model::Weights* policy, Communicator* world)
    : policy_(policy),
      rank_(world != nullptr ? world->rank() : 0),
      world_(world != nullptr ? world->size() : 1),
      tp_(static_cast<int>(job.placement.rollout_tp)),
      replica_(rank_ / tp_),
      dtype_(dtype_from_name(job.rollout.dtype.c_str())) {}

RolloutGroup::RolloutGroup(const JobConfig& job, const model::Weights& policy, Communicator* world)
    : RolloutGroup(job, &policy, world) {
  if (tp_ > 1 || dtype_ != policy.dtype()) make_engine(policy.config(), world);
  // Source: every rank's trainer holds the full weights. The plan takes every piece from the
  // destination rank itself.
  const weight_sync::Layout src = weight_sync::Layout::replicated(param_specs(policy), world_);
  make_publisher(job, policy.config(), src, weight_sync::bind(src, rank_, params_of(policy)),
                 world);
}

RolloutGroup::RolloutGroup(const JobConfig& job, const model::ModelConfig& config,
                           const model::ShardLayout& shards, const Tensor& local,
                           Communicator* world)
    : RolloutGroup(job, nullptr, world) {
  TANDEM_CHECK(shards.world() == world_,
               "rollout: the trainer's parameters are split over {} ranks, the job has {}",
               shards.world(), world_);
  make_engine(config, world);
  // Source: every rank's ZeRO-3 pieces, in its local buffer; each engine's elements come from
  // the ranks that own them, in buckets, cast by the sender.
  const std::vector<weight_sync::ParamSpec> specs =
      param_specs(*model::Weights::unbound(config, DType::f32));
  const weight_sync::Layout src = weight_sync::Layout::zero(specs, shards, /*full_tensors=*/false);
  make_publisher(job, config, src, weight_sync::bind_local(src, rank_, local), world);
  make_whole(job, config, src, weight_sync::bind_local(src, rank_, local), world);
}

RolloutGroup::RolloutGroup(const JobConfig& job, const model::ModelConfig& config,
                           const weight_sync::Layout& grid, std::vector<Tensor> from,
                           Communicator* world)
    : RolloutGroup(job, nullptr, world) {
  TANDEM_CHECK(grid.world() == world_, "rollout: the trainer's grid has {} ranks, the job has {}",
               grid.world(), world_);
  make_engine(config, world);
  make_publisher(job, config, grid, from, world);
  make_whole(job, config, grid, std::move(from), world);
}

void RolloutGroup::make_whole(const JobConfig& job, const model::ModelConfig& config,
                              const weight_sync::Layout& src, std::vector<Tensor> from,
                              Communicator* world) {
  if (job.placement.mode != "disaggregated" || (tp_ == 1 && dtype_ == DType::f32)) return;
  // The whole f32 weights the workers load, on rank 0 (the rank that pushes them).
  const std::vector<weight_sync::ParamSpec> specs(src.params().begin(), src.params().end());
  const weight_sync::Layout whole = weight_sync::Layout::replicated(specs, 1).placed(0, world_);
  if (rank_ == 0) whole_ = std::make_unique<model::Weights>(config, DType::f32);
  std::vector<Tensor> to(specs.size());
  if (whole_) to = weight_sync::bind(whole, rank_, params_of(*whole_));
  whole_publisher_ = std::make_unique<weight_sync::Publisher>(
      weight_sync::ReshardPlan::make(src, whole), world, std::move(from), std::move(to),
      sync_options(job.weight_sync));
  whole_publisher_->publish(0);
}

void RolloutGroup::make_engine(const model::ModelConfig& config, Communicator* world) {
  if (tp_ > 1) {
    std::vector<int> ranks;
    for (int t = 0; t < tp_; ++t) ranks.push_back(replica_ * tp_ + t);
    group_ = world->split(fmt::format("rollout{}", replica_), ranks);  // world: the store only
    engine_weights_ = std::make_unique<model::Weights>(model::tp_shard_config(config, tp_), dtype_);
  } else {
    engine_weights_ = std::make_unique<model::Weights>(config, dtype_);
  }
}

void RolloutGroup::make_publisher(const JobConfig& job, const model::ModelConfig& config,
                                  const weight_sync::Layout& src, std::vector<Tensor> from,
                                  Communicator* world) {
  // Destination: replicas of tp ranks, each rank its shard (whole tensors at tp = 1) in
  // rollout.dtype.
  const std::vector<weight_sync::ParamSpec> specs(src.params().begin(), src.params().end());
  const weight_sync::Layout dst =
      (tp_ > 1 ? weight_sync::Layout::tensor_parallel(tp_dims(config), specs, tp_, world_ / tp_)
               : weight_sync::Layout::replicated(specs, world_))
          .with_dtype(dtype_);
  std::vector<Tensor> to = weight_sync::bind(dst, rank_, params_of(weights()));
  for (size_t p = 0; p < to.size(); ++p) {
    if (src.params()[p].dtype != dtype_)
      kinds_.push_back(Kind::cast);
    else if (from[p].defined() && from[p].data() == to[p].data())
      kinds_.push_back(Kind::shared);
    else
      kinds_.push_back(Kind::copied);
  }
  publisher_ = std::make_unique<weight_sync::Publisher>(weight_sync::ReshardPlan::make(src, dst),
                                                        world, std::move(from), std::move(to),
                                                        sync_options(job.weight_sync));
  publisher_->publish(0);
}

const model::Weights& RolloutGroup::whole_policy() const {
  if (policy_ != nullptr) return *policy_;
  if (whole_) return *whole_;
  TANDEM_CHECK(tp_ == 1 && dtype_ == DType::f32,
               "rollout: rank {} holds no whole f32 weights of the policy: the trainer keeps its "
               "ZeRO-3 pieces and the engine {} in {}; rank 0 of a disaggregated job keeps a "
               "copy for its workers, and an engine of placement.rollout_tp = 1 with "
               "rollout.dtype = \"f32\" is one",
               rank_, tp_ > 1 ? "a tensor-parallel shard" : "the whole model", dtype_name(dtype_));
  return *engine_weights_;
}

int64_t RolloutGroup::added_bytes() const {
  return publisher_->added_bytes() + (whole_publisher_ ? whole_publisher_->added_bytes() : 0);
}

std::pair<size_t, size_t> RolloutGroup::replica_prompts(size_t count) const {
  const auto n = static_cast<size_t>(world_), first = static_cast<size_t>(replica_ * tp_),
             last = first + static_cast<size_t>(tp_);
  return {count * first / n, count * last / n};
}

PublishStats RolloutGroup::publish(uint64_t version) {
  const weight_sync::SyncStats s = publisher_->publish(version);
  if (whole_publisher_) whole_publisher_->publish(version);
  PublishStats st;
  st.version = version;
  for (const Kind k : kinds_) {
    st.shared += k == Kind::shared ? 1 : 0;
    st.copied += k == Kind::copied ? 1 : 0;
    st.cast += k == Kind::cast ? 1 : 0;
  }
  st.bytes_written = s.bytes_copied + s.bytes_received;
  st.bytes_sent = s.bytes_sent;
  st.seconds = s.seconds;
  return st;
}

}  // namespace tandem::trainer
