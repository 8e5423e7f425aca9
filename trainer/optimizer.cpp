// AdamW: decay exclusions, clipping, skipping, and the per-tensor fused kernel calls.
#include "trainer/optimizer.h"

#include <cmath>
#include <string>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::trainer {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// ops::adamw works on flat (N) tensors.
Tensor flat(const Tensor& t) { return t.view({t.numel()}); }

}  // namespace

void AdamWConfig::validate() const {
  TANDEM_CHECK(beta1 >= 0.0f && beta1 < 1.0f, "optimizer.beta1 must lie in [0, 1), got {}", beta1);
  TANDEM_CHECK(beta2 >= 0.0f && beta2 < 1.0f, "optimizer.beta2 must lie in [0, 1), got {}", beta2);
  TANDEM_CHECK(eps > 0.0f && std::isfinite(eps), "optimizer.eps must be positive, got {}", eps);
  TANDEM_CHECK(weight_decay >= 0.0f && std::isfinite(weight_decay),
               "optimizer.weight_decay must be 0 or more, got {}", weight_decay);
  TANDEM_CHECK(std::isfinite(max_grad_norm),
               "optimizer.max_grad_norm must be finite (<= 0 turns clipping off), got {}",
               max_grad_norm);
  TANDEM_CHECK(max_consecutive_skips >= 1,
               "optimizer.max_consecutive_skips must be 1 or more, got {}", max_consecutive_skips);
}

bool AdamW::decays(const AdamWConfig& config, std::string_view name) {
  if (name.find("norm") != std::string_view::npos) return config.decay_norms;
  if (ends_with(name, ".bias")) return config.decay_biases;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
    return config.decay_embeddings;
  }
  return true;
}

AdamW::AdamW(model::Weights& params, const AdamWConfig& config) : params_(params), config_(config) {
  config_.validate();
  TANDEM_CHECK(params.dtype() == DType::f32,
               "optimizer: the master weights must be f32, got {} (load the policy as f32)",
               params.dtype());
  m_ = std::make_unique<model::Weights>(params.config(), DType::f32, params.device(),
                                        ArenaClass::optimizer_states);
  v_ = std::make_unique<model::Weights>(params.config(), DType::f32, params.device(),
                                        ArenaClass::optimizer_states);
  m_->zero();
  v_->zero();
  for (const model::NamedTensor& s : params.storage()) decay_.push_back(decays(config_, s.name));
}

void AdamW::check_same_model(const model::Weights& other, const char* what) const {
  const auto mine = params_.storage();
  const auto theirs = other.storage();
  TANDEM_CHECK(mine.size() == theirs.size(),
               "optimizer: {} belong to another model ({} storage tensors, the parameters have {})",
               what, theirs.size(), mine.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    TANDEM_CHECK(
        mine[i].name == theirs[i].name && mine[i].tensor.shape() == theirs[i].tensor.shape(),
        "optimizer: {} tensor {} {} does not match the parameter {} {}", what, theirs[i].name,
        theirs[i].tensor.shape(), mine[i].name, mine[i].tensor.shape());
  }
}

float AdamW::grad_norm(const model::Weights& grads) {
  std::vector<Tensor> tensors;
  tensors.reserve(grads.storage().size());
  for (const model::NamedTensor& s : grads.storage()) tensors.push_back(s.tensor);
  return ops::global_norm(tensors);
}

StepResult AdamW::step(const model::Weights& grads, float lr, model::Weights* param_copy) {
  check_same_model(grads, "gradients");
  TANDEM_CHECK(grads.dtype() == DType::f32, "optimizer: gradients must be f32, got {}",
               grads.dtype());
  if (param_copy != nullptr) check_same_model(*param_copy, "the parameter copy");
  TANDEM_CHECK(std::isfinite(lr) && lr >= 0.0f,
               "optimizer: learning rate {} must be finite and >= 0", lr);

  StepResult r;
  r.lr = lr;
  r.grad_norm = grad_norm(grads);
  if (!std::isfinite(r.grad_norm)) {
    ++counters_.skipped_total;
    ++counters_.consecutive_skips;
    r.skipped = true;
    r.clip_scale = 0.0f;
    r.step = counters_.step;
    r.consecutive_skips = counters_.consecutive_skips;
    TANDEM_CHECK(counters_.consecutive_skips < config_.max_consecutive_skips,
                 "optimizer: the gradient norm was {} (not finite) in {} steps in a row "
                 "(optimizer.max_consecutive_skips = {}): training diverged; lower the learning "
                 "rate or resume from an earlier checkpoint",
                 r.grad_norm, counters_.consecutive_skips, config_.max_consecutive_skips);
    return r;
  }
  if (config_.max_grad_norm > 0.0f && r.grad_norm > config_.max_grad_norm) {
    r.clip_scale = config_.max_grad_norm / (r.grad_norm + 1e-6f);
  }

  ops::AdamWParams p;
  p.lr = lr;
  p.beta1 = config_.beta1;
  p.beta2 = config_.beta2;
  p.eps = config_.eps;
  p.step = counters_.step + 1;
  p.grad_scale = r.clip_scale;
  const auto params = params_.storage();
  const auto g = grads.storage();
  const auto m = m_->storage();
  const auto v = v_->storage();
  for (size_t i = 0; i < params.size(); ++i) {
    p.weight_decay = decay_[i] ? config_.weight_decay : 0.0f;
    Tensor copy = param_copy != nullptr ? flat(param_copy->storage()[i].tensor) : Tensor{};
    ops::adamw(flat(params[i].tensor), flat(g[i].tensor), flat(m[i].tensor), flat(v[i].tensor), p,
               copy);
  }
  ++counters_.step;
  counters_.consecutive_skips = 0;
  r.step = counters_.step;
  return r;
}

}  // namespace tandem::trainer
