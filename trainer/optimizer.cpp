// AdamW: decay exclusions, clipping, skipping, and the per-tensor fused kernel calls; the sharded
// form's reduce-scatter, range update and all-gather.
#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"

namespace tandem::trainer {
namespace {

// What the global gradient norm decides, the same for AdamW and ShardedAdamW: a non-finite norm
// skips the step (counted; the max_consecutive_skips-th skip in a row throws), a norm above
// max_grad_norm scales the gradients by max_norm / (norm + 1e-6) (torch's clip_grad_norm_).
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

// The kernel's parameters of an update that decide_step let through (weight decay is per tensor).
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

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The global norm on the CPU, AdamW's and ShardedAdamW's alike: the gradients flattened in storage
// order, cut into blocks of kNormBlock; a block's sum of squares in f64
// (ops::sum_squares_f64), the blocks' sums added in block order, the square root rounded to
// f32. A rank holds whole blocks, so the norm of the same gradients has the same bits on any number
// of ranks.
constexpr int64_t kNormBlock = ShardedAdamW::kNormBlock;

// The sums of the blocks of x[0, n), one per block of `blocks` (those past n are 0).
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

// The flat offsets of the storage tensors, one more than there are tensors: tensor t holds the
// elements [starts[t], starts[t + 1]) of the parameters flattened in storage order, and the last
// offset is their total.
std::vector<int64_t> flat_starts(std::span<const model::NamedTensor> storage) {
  std::vector<int64_t> starts = {0};
  for (const model::NamedTensor& s : storage) starts.push_back(starts.back() + s.tensor.numel());
  return starts;
}

// Calls fn(tensor index, offset in the tensor, offset in [lo, hi), length) for each piece of
// the flat range [lo, hi) (within [0, starts.back())) that lies in one storage tensor.
template <class Fn>
void for_each_piece(std::span<const int64_t> starts, int64_t lo, int64_t hi, Fn&& fn) {
  if (lo >= hi) return;
  auto t =
      static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1);
  for (int64_t at = lo; at < hi; ++t) {
    const int64_t len = std::min(hi, starts[t + 1]) - at;
    fn(t, at - starts[t], at - lo, len);
    at += len;
  }
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
  if (!grads.device().is_cpu()) return ops::global_norm(tensors);
  const ops::detail::OpTimer timer("global_norm");  // bench train's "gradient norm" phase
  const std::vector<int64_t> starts = flat_starts(grads.storage());
  const int64_t total = starts.back();
  const int64_t blocks = (total + kNormBlock - 1) / kNormBlock;
  std::vector<double> sums(static_cast<size_t>(blocks));
  parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    std::vector<float> joined;  // a block that crosses tensors, copied whole
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kNormBlock, hi = std::min(total, lo + kNormBlock);
      const float* x = nullptr;
      for_each_piece(starts, lo, hi, [&](size_t t, int64_t off, int64_t at, int64_t count) {
        const float* piece = tensors[t].data_as<float>() + off;
        if (count == hi - lo) {
          x = piece;
          return;
        }
        joined.resize(static_cast<size_t>(kNormBlock));
        std::copy(piece, piece + count, joined.data() + at);
        x = joined.data();
      });
      sums[static_cast<size_t>(b)] =
          ops::sum_squares_f64(Tensor::wrap(const_cast<float*>(x), {hi - lo}, DType::f32));
    }
  });
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

ShardedAdamW::ShardedAdamW(model::Weights& params, Communicator* comm, const AdamWConfig& config)
    : params_(params),
      comm_(comm),
      config_(config),
      rank_(comm != nullptr ? comm->rank() : 0),
      world_(comm != nullptr ? comm->size() : 1) {
  config_.validate();
  TANDEM_CHECK(params.dtype() == DType::f32 && params.device().is_cpu(),
               "optimizer: sharded AdamW needs f32 master weights on the CPU, got {}",
               params.dtype());
  starts_ = flat_starts(params.storage());
  total_ = starts_.back();
  for (const model::NamedTensor& s : params.storage())
    decay_.push_back(AdamW::decays(config_, s.name));
  // Even ranges of whole norm blocks.
  const int64_t blocks = (total_ + kNormBlock - 1) / kNormBlock;
  shard_ = (blocks + world_ - 1) / world_ * kNormBlock;
  begin_ = std::min(total_, rank_ * shard_);
  end_ = std::min(total_, begin_ + shard_);
  m_ = Tensor::zeros({shard_}, DType::f32);
  v_ = Tensor::zeros({shard_}, DType::f32);
  grad_ = Tensor::zeros({shard_}, DType::f32);
  // 8 bytes an element: step_fixed stages int64.
  stage_ = Tensor::zeros({2 * world_ * std::min(shard_, kStageElements)}, DType::f32);
}

template <class Fn>
void ShardedAdamW::for_each_piece(int64_t lo, int64_t hi, Fn&& fn) const {
  trainer::for_each_piece(starts_, lo, std::min(hi, total_), std::forward<Fn>(fn));
}

StepResult ShardedAdamW::step(const model::Weights& grads, float lr) {
  TANDEM_CHECK(grads.dtype() == DType::f32 && grads.storage().size() + 1 == starts_.size(),
               "optimizer: the gradients belong to another model");
  const int64_t n = world_, chunk = stage_.numel() / (2 * n);
  float* stage = stage_.data_as<float>();
  float* grad = grad_.data_as<float>();

  // Gradients: chunk k of every rank's range staged side by side, summed into this rank's.
  for (int64_t k = 0; k < shard_; k += chunk) {
    const int64_t len = std::min(chunk, shard_ - k);
    std::fill(stage, stage + n * len, 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t lo = r * shard_ + k;
      for_each_piece(lo, lo + len, [&](size_t t, int64_t off, int64_t at, int64_t count) {
        std::memcpy(stage + r * len + at, grads.storage()[t].tensor.data_as<float>() + off,
                    static_cast<size_t>(count) * sizeof(float));
      });
    }
    if (comm_ != nullptr)
      comm_->reduce_scatter(Tensor::wrap(stage, {n * len}, DType::f32),
                            Tensor::wrap(grad + k, {len}, DType::f32));
    else
      std::copy(stage, stage + len, grad + k);
  }

  return update(global_norm(true), lr);
}

float ShardedAdamW::global_norm(bool finite) const {
  std::vector<double> sums = block_sums(grad_.data_as<float>(), end_ - begin_, shard_ / kNormBlock);
  if (!finite) std::fill(sums.begin(), sums.end(), std::numeric_limits<double>::quiet_NaN());
  std::vector<double> all = comm_ != nullptr ? gather_doubles(*comm_, sums) : sums;
  all.resize(static_cast<size_t>((total_ + kNormBlock - 1) / kNormBlock));  // the blocks of P
  return norm_of_sums(all);
}

StepResult ShardedAdamW::step_fixed(std::span<const int64_t> fixed, float lr) {
  TANDEM_CHECK(static_cast<int64_t>(fixed.size()) == total_,
               "optimizer: {} fixed-point gradients for {} parameters", fixed.size(), total_);
  const int64_t n = world_, chunk = stage_.numel() / (2 * n);
  auto* stage = static_cast<int64_t*>(stage_.data());
  Tensor sum = Tensor::empty({std::min(chunk, shard_)}, DType::i64);
  auto* summed = sum.data_as<int64_t>();
  float* grad = grad_.data_as<float>();
  bool finite = true;
  for (int64_t k = 0; k < shard_; k += chunk) {
    const int64_t len = std::min(chunk, shard_ - k);
    std::fill(stage, stage + n * len, int64_t{0});
    for (int64_t r = 0; r < n; ++r) {
      const int64_t lo = std::min(total_, r * shard_ + k);
      const int64_t hi = std::min(total_, lo + len);
      std::copy(fixed.begin() + lo, fixed.begin() + hi, stage + r * len);
    }
    if (comm_ != nullptr)
      comm_->reduce_scatter(Tensor::wrap(stage, {n * len}, DType::i64),
                            Tensor::wrap(summed, {len}, DType::i64));
    else
      std::copy(stage, stage + len, summed);
    // A rank's kFixedInvalid poisons the sum: any sum this far from the others' is taken for it.
    for (int64_t i = 0; i < len; ++i) {
      if (summed[i] <= INT64_MIN / 2 || summed[i] >= INT64_MAX / 2) finite = false;
      grad[k + i] = static_cast<float>(std::ldexp(static_cast<double>(summed[i]), -kFixedBits));
    }
  }
  return update(global_norm(finite), lr);
}

StepResult ShardedAdamW::update(float norm, float lr) {
  const int64_t n = world_, chunk = stage_.numel() / (2 * n);
  float* stage = stage_.data_as<float>();
  float* grad = grad_.data_as<float>();
  StepResult r = decide_step(norm, lr, config_, counters_);
  if (r.skipped) return r;

  ops::AdamWParams p = update_params(config_, counters_, r);
  for_each_piece(begin_, end_, [&](size_t t, int64_t off, int64_t at, int64_t count) {
    p.weight_decay = decay_[t] ? config_.weight_decay : 0.0f;
    const Tensor& param = params_.storage()[t].tensor;
    ops::adamw(flat(param).narrow(off, count), grad_.narrow(at, count), m_.narrow(at, count),
               v_.narrow(at, count), p);
  });

  // Every rank's updated range into every rank's parameters.
  for (int64_t k = 0; comm_ != nullptr && k < shard_; k += chunk) {
    const int64_t len = std::min(chunk, shard_ - k);
    float* mine = grad + k;  // the gradient chunk is spent: it carries this rank's parameters
    std::fill(mine, mine + len, 0.0f);
    for_each_piece(begin_ + k, begin_ + k + len,
                   [&](size_t t, int64_t off, int64_t at, int64_t count) {
                     std::memcpy(mine + at, params_.storage()[t].tensor.data_as<float>() + off,
                                 static_cast<size_t>(count) * sizeof(float));
                   });
    comm_->all_gather(Tensor::wrap(mine, {len}, DType::f32),
                      Tensor::wrap(stage, {n * len}, DType::f32));
    for (int64_t q = 0; q < n; ++q) {
      if (q == rank_) continue;
      const int64_t lo = q * shard_ + k;
      for_each_piece(lo, lo + len, [&](size_t t, int64_t off, int64_t at, int64_t count) {
        std::memcpy(params_.storage()[t].tensor.data_as<float>() + off, stage + q * len + at,
                    static_cast<size_t>(count) * sizeof(float));
      });
    }
  }
  ++counters_.step;
  counters_.consecutive_skips = 0;
  r.step = counters_.step;
  return r;
}

}  // namespace tandem::trainer
