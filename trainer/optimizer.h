// AdamW over a model's fused f32 master weights: moments in two more Weights objects, weight-decay
// exclusions per storage tensor, global-norm gradient clipping, and skipping of non-finite steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

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

  // sqrt of the sum of squares over every storage tensor of grads (ops::global_norm).
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

}  // namespace tandem::trainer
