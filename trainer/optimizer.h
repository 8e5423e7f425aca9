// AdamW over a model's fused f32 master weights: moments in two more Weights objects, weight-decay
// exclusions per storage tensor, global-norm gradient clipping, and skipping of non-finite steps;
// and its ZeRO form over data-parallel ranks, each owning the moments of one range of parameters.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/comm.h"
#include "core/names.h"
#include "model/decoder.h"
#include "model/shard_layout.h"
#include "model/weights.h"

namespace tandem::trainer {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  // Weight decay exclusions, decided per storage tensor (a fused tensor never mixes kinds).
  bool decay_norms = false;       // every *norm* weight: input/post-attention, model.norm, q/k norm
  bool decay_biases = false;      // every *.bias (the fused qkv bias)
  bool decay_embeddings = true;   // model.embed_tokens.weight and an untied lm_head.weight
  float max_grad_norm = 1.0f;     // global-norm clipping threshold; <= 0 turns clipping off
  int max_consecutive_skips = 8;  // this many non-finite gradient norms in a row is an error
  // Throws tandem::Error naming the field when a value is out of range.
  void validate() const;
};

struct StepResult {
  bool skipped = false;     // the gradient norm was NaN/Inf: nothing was updated
  float grad_norm = 0.0f;   // global norm before clipping
  float clip_scale = 1.0f;  // the factor applied to the gradients (1 when not clipped)
  float lr = 0.0f;          // the learning rate given
  int64_t step = 0;         // optimizer steps taken so far, this one included if not skipped
  int64_t consecutive_skips = 0;
};

// The optimizer's counters: what a checkpoint saves beside the moments.
struct AdamWCounters {
  int64_t step = 0;               // updates applied (drives bias correction)
  int64_t skipped_total = 0;      // non-finite steps skipped since the start
  int64_t consecutive_skips = 0;  // non-finite steps skipped since the last update
};

// How much of the training state ShardedAdamW splits over the ranks (trainer.shard):
//   optimizer: the AdamW moments (ZeRO-1); every rank keeps whole f32 weights and gradients, the
//     gradients are reduce-scattered after the backward pass, the updated ranges all-gathered;
//   gradients: and the gradients (ZeRO-2): each unit's gradients are reduce-scattered as the
//     backward pass finishes it, so a rank holds its range plus the units in flight;
//   parameters: and the f32 master weights (ZeRO-3, FSDP): a unit's weights are all-gathered
//     before the decoder uses it (the next unit's gather prefetched) and freed after.
enum class ShardLevel { optimizer, gradients, parameters };
const char* shard_level_name(ShardLevel level);
inline constexpr NamedValue<ShardLevel> kShardLevelNames[] = {
    {ShardLevel::optimizer, "optimizer"},
    {ShardLevel::gradients, "gradients"},
    {ShardLevel::parameters, "parameters"}};

struct ShardOptions {
  ShardLevel level = ShardLevel::optimizer;
  // Collectives on a communication thread of their own, running while the decoder computes;
  // false: each one waited for as it is issued (every second of it exposed).
  bool overlap = true;
  // A collective carries at most this many bytes of f32 (a unit's larger ones go in pieces).
  int64_t bucket_bytes = int64_t{32} << 20;
  // The gradients summed in 2^-kFixedBits fixed point (TrainStepConfig::deterministic).
  bool deterministic = false;
  // A test hook (JobHooks::before_gather; null: none; it outlives the optimizer): called on the
  // communication thread before each all-gather of a unit's f32 weights at
  // ShardLevel::parameters, with this rank and the unit's index.
  const std::function<void(int rank, size_t unit)>* before_gather = nullptr;

  // A trainer laid out as DP x TP x PP (trainer/parallel/grid.h): the optimizer's ranks (comm) are
  // one data-parallel group, and the ranks of `model_parallel` (this data-parallel index's ranks,
  // one per tensor-parallel rank and pipeline stage, in the grid's rank order) hold the other
  // parts of the model. The global norm then adds every part's blocks, rank after rank (a
  // pipeline's stages in layer order: the same sum as one rank's). Null: the weights are the whole
  // model.
  Communicator* model_parallel = nullptr;
  // Storage tensors (model::Weights::storage() names) this rank leaves out of the global norm
  // because another rank of model_parallel counts the same values: the norms a tensor-parallel
  // rank other than 0 holds as replicas, the last stage's copy of a tied embedding.
  std::vector<std::string> norm_excluded;
  // A parameter several ranks of the grid hold as copies (a tied embedding on the first and the
  // last stage): after the data-parallel sum, this rank's piece of its gradient is summed over
  // `group` (an all-reduce of the piece's f32), so every copy takes the same update. The tensor
  // must be a unit of its own (model::ShardLayout), the same size on every member.
  struct SharedGradient {
    std::string tensor;
    Communicator* group = nullptr;
  };
  std::vector<SharedGradient> shared;
};

// Communication of a ShardedAdamW since the last take_comm_stats(): time its collectives ran
// (comm_s) and the part the training thread waited for them (exposed_s).
struct CommStats {
  double comm_s = 0, exposed_s = 0;
  int64_t collectives = 0;
};

// The optimizer a PolicyTrainer drives, chosen once at start: AdamW (one rank, the whole state,
// any device) or ShardedAdamW (any number of ranks, a ShardLevel, the CPU or CUDA). One optimizer
// step's gradients flow through it: begin_step() zeroes them; each micro-batch's backward
// accumulates into gradients() (the decoder calling unit_hooks() as it goes) and end_micro_batch()
// follows; step() applies the update. The decoders compute with compute_weights() and unit_hooks().
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual const model::Weights& compute_weights() = 0;
  // Null when the decoder needs none (the weights and gradients are whole).
  virtual model::UnitHooks* unit_hooks() = 0;
  // Before a decoder pass (model::UnitPass: a forward, a forward and its backward, or a pipeline
  // stage's backward) on compute_weights().
  virtual void begin_pass(model::UnitPass pass) = 0;
  // A pass this rank has no micro-batch for while others do: its part of their collectives.
  virtual void idle_pass(model::UnitPass pass) = 0;
  // Whether ranks must run the same number of passes (idle_pass for the ones they lack).
  virtual bool lockstep(model::UnitPass pass) const = 0;
  virtual void begin_step() = 0;
  virtual model::Weights& gradients() = 0;
  virtual void end_micro_batch() = 0;
  virtual StepResult step(float lr) = 0;
  virtual Communicator* comm() = 0;  // null: one rank
  virtual const AdamWCounters& counters() const = 0;
  virtual void set_counters(const AdamWCounters& c) = 0;
  // Bytes of this rank's optimizer state (moments, and gradient ranges for sharded ones).
  virtual int64_t state_bytes() const = 0;
  virtual CommStats take_comm_stats() { return {}; }
};

class AdamW final : public Optimizer {
 public:
  // params: the f32 master weights (the trainer's Weights, ArenaClass::parameters), updated in
  // place by step(); it must outlive the optimizer. m and v are allocated zeroed, same layout,
  // ArenaClass::optimizer_states, on params' device.
  AdamW(model::Weights& params, const AdamWConfig& config = {});
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update with these gradients (f32, same model; read only): the global norm, clipping
  // (torch.nn.utils.clip_grad_norm_'s max_norm / (norm + 1e-6)), then ops::adamw per storage
  // tensor. param_copy (optional, e.g. the bf16 rollout weights, same model) receives the new
  // parameters in the same pass. A NaN/Inf norm skips the step and counts it; the
  // max_consecutive_skips-th skip in a row throws tandem::Error.
  StepResult step(const model::Weights& grads, float lr, model::Weights* param_copy = nullptr);

  // Optimizer: whole weights and gradients (the gradients allocated by the first begin_step()).
  const model::Weights& compute_weights() override { return params_; }
  model::UnitHooks* unit_hooks() override { return nullptr; }
  void begin_pass(model::UnitPass) override {}
  void idle_pass(model::UnitPass) override {}
  bool lockstep(model::UnitPass) const override { return false; }
  void begin_step() override;
  model::Weights& gradients() override;
  void end_micro_batch() override {}
  StepResult step(float lr) override { return step(gradients(), lr); }
  Communicator* comm() override { return nullptr; }
  int64_t state_bytes() const override;

  // sqrt of the sum of squares over every storage tensor of grads. On the CPU in blocks of
  // ShardedAdamW::kNormBlock of the flattened gradients, as ShardedAdamW sums it, so that the
  // same gradients have the same norm bitwise on one rank and on several; elsewhere
  // ops::global_norm.
  static float grad_norm(const model::Weights& grads);
  // Whether the storage tensor of this name gets weight decay under this config.
  static bool decays(const AdamWConfig& config, std::string_view storage_name);
  bool decays(std::string_view storage_name) const { return decays(config_, storage_name); }

  const AdamWConfig& config() const { return config_; }
  model::Weights& params() { return params_; }
  const model::Weights& params() const { return params_; }
  model::Weights& m() { return *m_; }  // first moments (f32, optimizer_states)
  const model::Weights& m() const { return *m_; }
  model::Weights& v() { return *v_; }  // second moments
  const model::Weights& v() const { return *v_; }
  const AdamWCounters& counters() const override { return counters_; }
  void set_counters(const AdamWCounters& c) override { counters_ = c; }
  int64_t step_count() const { return counters_.step; }

 private:
  void check_same_model(const model::Weights& other, const char* what) const;

  model::Weights& params_;
  AdamWConfig config_;
  std::unique_ptr<model::Weights> m_, v_, grads_;
  std::vector<bool> decay_;  // per storage tensor
  AdamWCounters counters_;
};

// Every rank's `mine` (the same length on every rank), concatenated in rank order: the doubles a
// rank then sums or compares in that order, identically on every rank. Collective.
std::vector<double> gather_doubles(Communicator& comm, std::span<const double> mine);

inline constexpr int64_t kFixedInvalid = INT64_MIN;

// ShardedAdamW: AdamW sharded over the ranks of `comm` at a ShardLevel, over model::ShardLayout's
// units (every rank owns whole norm blocks of every unit). Clipping and the non-finite skip use
// the global norm, the same bits on every rank, at every level and on any number of ranks (and
// AdamW's on the same gradients: it sums the same blocks). With ShardOptions::deterministic the
// gradients are summed in fixed point, so the update has the same bits on any number of ranks.
class ShardedAdamW final : public Optimizer {
 public:
  static constexpr int kFixedBits = 40;  // gradients in units of 2^-40
  static constexpr int64_t kNormBlock = model::ShardLayout::kBlock;
  // params: the whole f32 master weights, as loaded, on the CPU or a CUDA device (every buffer of
  // the optimizer lives there; comm then carries CUDA tensors over NCCL, and
  // ShardOptions::deterministic is refused). At ShardLevel::parameters the optimizer copies this
  // rank's pieces out of them at construction; the caller may then free them (params() is not
  // valid any more). comm: null for one rank.
  ShardedAdamW(model::Weights& params, Communicator* comm, const AdamWConfig& config = {},
               const ShardOptions& options = {});
  ~ShardedAdamW() override;
  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  // Optimizer.
  const model::Weights& compute_weights() override;
  model::UnitHooks* unit_hooks() override;
  void begin_pass(model::UnitPass pass) override;
  void idle_pass(model::UnitPass pass) override;
  bool lockstep(model::UnitPass pass) const override;
  void begin_step() override;
  model::Weights& gradients() override;
  void end_micro_batch() override;
  StepResult step(float lr) override;
  Communicator* comm() override { return comm_; }
  const AdamWCounters& counters() const override { return counters_; }
  void set_counters(const AdamWCounters& c) override { counters_ = c; }
  int64_t state_bytes() const override;
  CommStats take_comm_stats() override;

  // Level optimizer, for tests: one update with this rank's whole gradients (f32), or with them
  // in fixed point (P values in storage order, units of 2^-kFixedBits; kFixedInvalid where not
  // finite). Collective.
  StepResult step(const model::Weights& grads, float lr);
  StepResult step_fixed(std::span<const int64_t> fixed, float lr);

  const model::ShardLayout& layout() const;
  const ShardOptions& options() const;
  const AdamWConfig& config() const;
  int64_t total() const;  // P
  // This rank's pieces (model::ShardLayout's local buffer: local_size() f32, unit u's piece at
  // units()[u].local, past its real elements zeros): the moments, and at ShardLevel::parameters
  // the f32 master weights.
  const Tensor& m() const;
  const Tensor& v() const;
  Tensor& m();
  Tensor& v();
  Tensor& local_params();  // undefined below ShardLevel::parameters
  // The whole f32 master weights below ShardLevel::parameters (every rank's, the same after each
  // step); throws at ShardLevel::parameters.
  model::Weights& params();
  // ShardLevel::parameters: unit u's f32 master weights (its flat elements) into out (on the CPU
  // or the optimizer's device) on every rank. Collective.
  void gather_unit(size_t unit, const Tensor& out);
  // The whole moments of the weights this optimizer updates (tables of params()' layout, f32 on
  // the CPU), gathered from every rank's pieces on every rank: what a checkpoint of a
  // model-parallel trainer reassembles the model's moments from. Collective.
  void gather_moments(model::Weights& m, model::Weights& v);
  // The reverse, not collective: this rank's pieces of the moments taken from whole ones.
  void set_moments(const model::Weights& m, const model::Weights& v);
  // ShardLevel::parameters, not collective: this rank's pieces of the f32 master weights taken
  // from whole ones (a table of the optimizer's weights, f32 on the CPU), as a checkpoint of a
  // model-parallel trainer is restored.
  void set_local_params(const model::Weights& params);
  int64_t step_count() const { return counters_.step; }
  // The training state this rank held at most (bytes) since the last reset: f32 weights (whole or
  // its pieces, and the units gathered), gradients (whole, or its pieces and the buckets in
  // flight, and the staging), optimizer moments.
  struct Memory {
    int64_t weights = 0, gradients = 0, optimizer = 0;
    int64_t total() const { return weights + gradients + optimizer; }
  };
  Memory memory(bool reset_peaks = false);
  // CUDA: the marks (events on the compute stream) the communication thread waited for before its
  // collectives so far; 0 on the CPU.
  int64_t device_marks() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Communicator* comm_;
  AdamWCounters counters_;
};

}  // namespace tandem::trainer
