// AdamW: decay exclusions, clipping, skipping, and the per-tensor fused kernel calls; the steps'
// shared pieces (trainer/optimizer_detail.h). The sharded form is in trainer/sharded_adamw.cpp.
#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#include "trainer/optimizer_detail.h"

namespace tandem::trainer {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

namespace optimizer_detail {

StepResult decide_step(float norm, float lr, const AdamWConfig& config, AdamWCounters& counters) {
  TANDEM_CHECK(std::isfinite(lr) && lr >= 0.0f,
               "optimizer: learning rate {} must be finite and >= 0", lr);
  StepResult r;
  r.lr = lr;
  r.grad_norm = norm;
  if (!std::isfinite(norm)) {
    ++counters.skipped_total;
    ++counters.consecutive_skips;
    r.skipped = true;
    r.clip_scale = 0.0f;
    r.step = counters.step;
    r.consecutive_skips = counters.consecutive_skips;
    TANDEM_CHECK(counters.consecutive_skips < config.max_consecutive_skips,
                 "optimizer: the gradient norm was {} (not finite) in {} steps in a row "
                 "(optimizer.max_consecutive_skips = {}): training diverged; lower the learning "
                 "rate or resume from an earlier checkpoint",
                 norm, counters.consecutive_skips, config.max_consecutive_skips);
    return r;
  }
  if (config.max_grad_norm > 0.0f && norm > config.max_grad_norm)
    r.clip_scale = config.max_grad_norm / (norm + 1e-6f);
  return r;
}

ops::AdamWParams update_params(const AdamWConfig& config, const AdamWCounters& counters,
                               const StepResult& r) {
  ops::AdamWParams p;
  p.lr = r.lr;
  p.beta1 = config.beta1;
  p.beta2 = config.beta2;
  p.eps = config.eps;
  p.step = counters.step + 1;
  p.grad_scale = r.clip_scale;
  return p;
}

std::vector<double> block_sums(const float* x, int64_t n, int64_t blocks) {
  std::vector<double> sums(static_cast<size_t>(blocks), 0.0);
  parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1 && b * kNormBlock < n; ++b)
      sums[static_cast<size_t>(b)] = ops::sum_squares_f64(
          Tensor::wrap(const_cast<float*>(x) + b * kNormBlock,
                       {std::min(kNormBlock, n - b * kNormBlock)}, DType::f32));
  });
  return sums;
}

float norm_of_sums(std::span<const double> sums) {
  double total = 0;
  for (const double s : sums) total += s;
  return static_cast<float>(std::sqrt(total));
}

}  // namespace optimizer_detail

using namespace optimizer_detail;

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
  m_ = std::make_unique<model::Weights>(params.config(), params.part(), DType::f32, params.device(),
                                        ArenaClass::optimizer_states);
  v_ = std::make_unique<model::Weights>(params.config(), params.part(), DType::f32, params.device(),
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
  if (!grads.device().is_cpu()) return ops::global_norm(tensors);
  const ops::detail::OpTimer timer("global_norm");  // bench train's "gradient norm" phase
  // ShardedAdamW's blocks: each unit's from its start, in unit then block order.
  const model::ShardLayout layout(grads, 1);
  std::vector<double> sums(static_cast<size_t>(layout.total_blocks()));
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const model::FlatRange unit = layout.units()[u].flat;
    const int64_t first = layout.first_block(u);
    parallel_for(layout.blocks(u), [&](int64_t b0, int64_t b1) {
      std::vector<float> joined;  // a block that crosses tensors, copied whole
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t lo = unit.begin + b * kNormBlock, hi = std::min(unit.end, lo + kNormBlock);
        const float* x = nullptr;
        layout.for_each_piece(lo, hi, [&](size_t t, int64_t off, int64_t at, int64_t count) {
          const float* piece = tensors[t].data_as<float>() + off;
          if (count == hi - lo) {
            x = piece;
            return;
          }
          joined.resize(static_cast<size_t>(kNormBlock));
          std::copy(piece, piece + count, joined.data() + at);
          x = joined.data();
        });
        sums[static_cast<size_t>(first + b)] =
            ops::sum_squares_f64(Tensor::wrap(const_cast<float*>(x), {hi - lo}, DType::f32));
      }
    });
  }
  return norm_of_sums(sums);
}

StepResult AdamW::step(const model::Weights& grads, float lr, model::Weights* param_copy) {
  check_same_model(grads, "gradients");
  TANDEM_CHECK(grads.dtype() == DType::f32, "optimizer: gradients must be f32, got {}",
               grads.dtype());
  if (param_copy != nullptr) check_same_model(*param_copy, "the parameter copy");

  StepResult r = decide_step(grad_norm(grads), lr, config_, counters_);
  if (r.skipped) return r;

  ops::AdamWParams p = update_params(config_, counters_, r);
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

std::vector<double> gather_doubles(Communicator& comm, std::span<const double> mine) {
  static_assert(sizeof(double) == sizeof(int64_t));
  std::vector<double> in(mine.begin(), mine.end());
  std::vector<double> out(in.size() * static_cast<size_t>(comm.size()));
  const auto n = static_cast<int64_t>(in.size());
  comm.all_gather(Tensor::wrap(in.data(), {n}, DType::i64),
                  Tensor::wrap(out.data(), {n * comm.size()}, DType::i64));
  return out;
}

void AdamW::begin_step() {
  if (!grads_)
    grads_ = std::make_unique<model::Weights>(params_.config(), params_.part(), DType::f32,
                                              params_.device(), ArenaClass::gradients);
  grads_->zero();
}

model::Weights& AdamW::gradients() {
  if (!grads_) begin_step();
  return *grads_;
}

int64_t AdamW::state_bytes() const { return static_cast<int64_t>(m_->nbytes() + v_->nbytes()); }

}  // namespace tandem::trainer
