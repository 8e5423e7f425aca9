// AdamW over a model's fused f32 master weights: moments in two more Weights objects, weight-decay
// exclusions per storage tensor, global-norm gradient clipping, and skipping of non-finite steps;
// and its ZeRO form over data-parallel ranks, each owning the moments of one range of parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/comm.h"
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

class AdamW {
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
  const AdamWCounters& counters() const { return counters_; }
  void set_counters(const AdamWCounters& c) { counters_ = c; }
  int64_t step_count() const { return counters_.step; }

 private:
  void check_same_model(const model::Weights& other, const char* what) const;

  model::Weights& params_;
  AdamWConfig config_;
  std::unique_ptr<model::Weights> m_, v_;
  std::vector<bool> decay_;  // per storage tensor
  AdamWCounters counters_;
};

// Every rank's `mine` (the same length on every rank), concatenated in rank order: the doubles a
// rank then sums or compares in that order, identically on every rank. Collective.
std::vector<double> gather_doubles(Communicator& comm, std::span<const double> mine);

inline constexpr int64_t kFixedInvalid = INT64_MIN;

// AdamW sharded over the ranks of `comm` (ZeRO-1/2). The parameters' elements in storage order
// (each storage tensor flattened, one after the other: P in all) are split into even ranges,
// rank r owning [r S, min((r + 1) S, P)) with S = ceil(P / (N B)) B, B = kNormBlock: the f32
// moments of that range only, and the gradients summed over the ranks into it (reduce-scatter). The
// update of the range follows (weight decay decided per storage tensor, a range may cross tensors),
// then every rank's range is all-gathered into every rank's full parameters. Clipping and the
// non-finite skip use the global norm, the same on every rank (and AdamW's on the same gradients,
// bitwise: it is summed in blocks of B). Collectives go through a staging buffer of N *
// kStageElements floats.
class ShardedAdamW {
 public:
  static constexpr int64_t kStageElements = int64_t{1} << 20;
  static constexpr int kFixedBits = 40;        // step_fixed: gradients in units of 2^-40
  static constexpr int64_t kNormBlock = 4096;  // elements per partial sum of the global norm
  // comm: null for one rank (the deterministic update's optimizer on one rank).
  ShardedAdamW(model::Weights& params, Communicator* comm, const AdamWConfig& config = {});
  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  // One update with this rank's gradients (f32, same model, read only; summed over the ranks
  // here). Collective: every rank calls it with its gradients.
  StepResult step(const model::Weights& grads, float lr);
  // The same with this rank's gradients in fixed point (P values, storage order, units of
  // 2^-kFixedBits; kFixedInvalid where not finite): summed exactly over the ranks, the norm summed
  // in blocks of kNormBlock elements in block order (ranges are whole blocks), so that the update
  // is the same bitwise whatever the number of ranks.
  StepResult step_fixed(std::span<const int64_t> fixed, float lr);

  int64_t begin() const { return begin_; }  // this rank's range of the flat parameters
  int64_t end() const { return end_; }
  int64_t total() const { return total_; }  // P
  // Bytes of this rank's optimizer state: moments and the gradient range (f32).
  int64_t state_bytes() const { return 3 * 4 * (end_ - begin_); }
  const Tensor& m() const { return m_; }  // (end - begin) first moments of the range
  const Tensor& v() const { return v_; }
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }
  const AdamWConfig& config() const { return config_; }
  model::Weights& params() { return params_; }
  const AdamWCounters& counters() const { return counters_; }
  void set_counters(const AdamWCounters& c) { counters_ = c; }
  int64_t step_count() const { return counters_.step; }
  Communicator* comm() { return comm_; }

 private:
  // Calls fn(tensor index, offset in the tensor, offset in [lo, hi), length) for each piece of
  // the flat range [lo, hi) that lies in one storage tensor.
  template <class Fn>
  void for_each_piece(int64_t lo, int64_t hi, Fn&& fn) const;

  // The global norm of the summed gradients (this rank's range in grad_): the f64 sums of squares
  // of every rank's blocks of kNormBlock, gathered and added in block order (NaN when this rank
  // saw a non-finite value: not `finite`), the same bits as AdamW::grad_norm of those gradients.
  // Collective.
  float global_norm(bool finite) const;
  // The update of the range from grad_ under the global norm, then the ranges all-gathered.
  StepResult update(float norm, float lr);

  model::Weights& params_;
  Communicator* comm_;
  AdamWConfig config_;
  int rank_ = 0, world_ = 1;
  int64_t total_ = 0, shard_ = 0, begin_ = 0, end_ = 0;
  std::vector<int64_t> starts_;  // flat offset of each storage tensor, then total_
  std::vector<bool> decay_;      // per storage tensor
  Tensor m_, v_, grad_;          // (shard_) each; the tail past end_ stays zero
  Tensor stage_;                 // (N * kStageElements)
  AdamWCounters counters_;
};

}  // namespace tandem::trainer
