// GRPO math: advantages, the clipped policy loss with KL and entropy terms and its gradient.
// Every reduction runs in double; only per-token outputs are rounded to float.
#include "trainer/grpo.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"

namespace tandem::trainer {

namespace {

constexpr double kLogRatioClamp = 20.0;    // token log-ratio and IS log-weight, as verl
constexpr double kGspoLogRatioMax = 10.0;  // verl compute_policy_loss_gspo: clamp(max=10)
constexpr double kKlInputClamp = 20.0;     // verl kl_penalty / NeMo-RL kl_input_clamp_value
constexpr double kKlOutputClamp = 10.0;    // verl kl_penalty / NeMo-RL kl_output_clamp_value

void check_finite(std::span<const float> values, const char* what) {
  for (size_t i = 0; i < values.size(); ++i) {
    TANDEM_CHECK(std::isfinite(values[i]), "{}[{}] is {}: expected a finite value", what, i,
                 values[i]);
  }
}

void check_size(size_t found, size_t expected, const char* what, const char* counted) {
  TANDEM_CHECK(found == expected, "{} has {} elements: expected {} ({})", what, found, expected,
               counted);
}

// torch.clamp passes the gradient when lo <= x <= hi (inclusive); so do we.
bool inside(double x, double lo, double hi) { return x >= lo && x <= hi; }

}  // namespace

// ---- Advantages ------------------------------------------------------------------------------

void validate(const AdvantageConfig& config) {
  TANDEM_CHECK(std::isfinite(config.eps) && config.eps >= 0,
               "advantage.eps is {}: expected a finite value >= 0", config.eps);
  TANDEM_CHECK(config.scale == AdvantageScale::kNone || config.eps > 0,
               "advantage.eps is {}: expected > 0 when dividing by a reward std (a zero std would "
               "divide by zero)",
               config.eps);
}

RewardStats reward_stats(std::span<const float> rewards, std::span<const int32_t> group_sizes) {
  int64_t total = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    TANDEM_CHECK(group_sizes[g] >= 1, "group_sizes[{}] is {}: expected >= 1", g, group_sizes[g]);
    total += group_sizes[g];
  }
  TANDEM_CHECK(total == static_cast<int64_t>(rewards.size()),
               "group_sizes sum to {}: expected the number of rewards, {}", total, rewards.size());
  check_finite(rewards, "rewards");

  RewardStats s;
  const size_t n = rewards.size();
  s.groups = static_cast<int64_t>(group_sizes.size());
  double sum = 0;
  for (float r : rewards) sum += r;
  s.mean = n > 0 ? sum / static_cast<double>(n) : 0.0;
  double ss = 0;
  for (float r : rewards) ss += (r - s.mean) * (r - s.mean);
  s.std = n > 1 ? std::sqrt(ss / static_cast<double>(n - 1)) : 0.0;
  size_t begin = 0;
  for (int32_t size : group_sizes) {
    const auto group = rewards.subspan(begin, static_cast<size_t>(size));
    if (std::all_of(group.begin(), group.end(), [&](float r) { return r == group[0]; }))
      ++s.zero_variance_groups;
    begin += static_cast<size_t>(size);
  }
  s.zero_variance_fraction =
      s.groups > 0 ? static_cast<double>(s.zero_variance_groups) / static_cast<double>(s.groups)
                   : 0.0;
  return s;
}

Advantages compute_advantages(std::span<const float> rewards, std::span<const int32_t> group_sizes,
                              const AdvantageConfig& config) {
  validate(config);
  const RewardStats described = reward_stats(rewards, group_sizes);
  const size_t n = rewards.size();
  Advantages out;
  out.values.assign(n, 0.0f);
  AdvantageStats& s = out.stats;
  s.groups = described.groups;
  s.reward_mean = described.mean;
  s.reward_std = described.std;
  s.zero_variance_groups = described.zero_variance_groups;
  s.zero_variance_fraction = described.zero_variance_fraction;

  size_t begin = 0;
  for (int32_t size : group_sizes) {
    const auto group = rewards.subspan(begin, static_cast<size_t>(size));
    const bool constant =
        std::all_of(group.begin(), group.end(), [&](float r) { return r == group[0]; });
    if (constant) {
      // Zero variance (a group of one included): exactly 0, whatever the rounding of the mean.
      begin += static_cast<size_t>(size);
      continue;
    }
    double gsum = 0;
    for (float r : group) gsum += r;
    const double mean = gsum / size;
    double scale = 1.0;
    if (config.scale == AdvantageScale::kGroupStd) {
      double gss = 0;
      for (float r : group) gss += (r - mean) * (r - mean);
      scale = std::sqrt(gss / (size - 1)) + config.eps;
    } else if (config.scale == AdvantageScale::kBatchStd) {
      scale = s.reward_std + config.eps;
    }
    for (int32_t i = 0; i < size; ++i) {
      const double r = group[i];
      const double baseline =
          config.baseline == AdvantageBaseline::kLeaveOneOut ? (gsum - r) / (size - 1) : mean;
      out.values[begin + i] = static_cast<float>((r - baseline) / scale);
    }
    begin += static_cast<size_t>(size);
  }

  if (n > 0) {
    double asum = 0;
    s.advantage_min = out.values[0];
    s.advantage_max = out.values[0];
    for (float a : out.values) {
      asum += a;
      s.advantage_min = std::min<double>(s.advantage_min, a);
      s.advantage_max = std::max<double>(s.advantage_max, a);
    }
    s.advantage_mean = asum / static_cast<double>(n);
    double ass = 0;
    for (float a : out.values) ass += (a - s.advantage_mean) * (a - s.advantage_mean);
    s.advantage_std = n > 1 ? std::sqrt(ass / static_cast<double>(n - 1)) : 0.0;
  }
  return out;
}

// ---- Configuration -----------------------------------------------------------------------------

void validate(const PolicyLossConfig& c) {
  TANDEM_CHECK(std::isfinite(c.eps_low) && c.eps_low >= 0 && c.eps_low < 1,
               "loss.eps_low is {}: expected 0 <= eps_low < 1", c.eps_low);
  TANDEM_CHECK(std::isfinite(c.eps_high) && c.eps_high >= 0,
               "loss.eps_high is {}: expected a finite value >= 0", c.eps_high);
  TANDEM_CHECK(c.dual_clip_c == 0 || (std::isfinite(c.dual_clip_c) && c.dual_clip_c > 1),
               "loss.dual_clip_c is {}: expected 0 (off) or a value > 1", c.dual_clip_c);
  TANDEM_CHECK(c.aggregation != LossAggregation::kSeqMeanTokenSumNorm ||
                   (std::isfinite(c.seq_sum_norm) && c.seq_sum_norm > 0),
               "loss.seq_sum_norm is {}: expected > 0 (e.g. the max response length) with "
               "aggregation seq-mean-token-sum-norm",
               c.seq_sum_norm);
  TANDEM_CHECK(std::isfinite(c.kl_beta) && c.kl_beta >= 0,
               "loss.kl_beta is {}: expected a finite value >= 0", c.kl_beta);
  TANDEM_CHECK(std::isfinite(c.entropy_coef) && c.entropy_coef >= 0,
               "loss.entropy_coef is {}: expected a finite value >= 0", c.entropy_coef);
  TANDEM_CHECK(c.is_level == ImportanceLevel::kNone || (std::isfinite(c.is_cap) && c.is_cap > 0),
               "loss.is_cap is {}: expected a finite value > 0", c.is_cap);
}

void validate(const GrpoConfig& config, int group_size) {
  validate(config.advantage);
  validate(config.loss);
  TANDEM_CHECK(group_size >= 2,
               "group size G is {}: expected >= 2 samples per prompt (a group of one has no "
               "baseline, its advantage would always be 0)",
               group_size);
}

// ---- Policy loss -------------------------------------------------------------------------------

PolicyLossResult compute_policy_loss(const PolicyLossInput& in, const PolicyLossConfig& config,
                                     const LossNormalisers& norm, std::span<float> dlogp,
                                     std::span<float> dentropy) {
  validate(config);
  // Validate everything before writing anything.
  const size_t B = in.seq_lens.size();
  size_t T = 0;
  for (size_t i = 0; i < B; ++i) {
    TANDEM_CHECK(in.seq_lens[i] >= 1, "seq_lens[{}] is {}: expected >= 1 token", i, in.seq_lens[i]);
    T += static_cast<size_t>(in.seq_lens[i]);
  }
  check_size(in.advantages.size(), B, "advantages", "one per sequence");
  check_size(in.logp.size(), T, "logp", "sum of seq_lens");
  check_size(in.old_logp.size(), T, "old_logp", "sum of seq_lens");
  check_size(dlogp.size(), T, "dlogp", "sum of seq_lens");
  const bool use_kl = config.kl_beta > 0;
  const bool use_is = config.is_level != ImportanceLevel::kNone;
  TANDEM_CHECK(!use_kl || !in.ref_logp.empty(),
               "ref_logp is empty: kl_beta is {} so the "
               "reference logprobs are needed",
               config.kl_beta);
  TANDEM_CHECK(!use_is || !in.rollout_logp.empty(),
               "rollout_logp is empty: the importance-sampling correction needs them");
  TANDEM_CHECK(config.entropy_coef == 0 || !in.entropy.empty(),
               "entropy is empty: entropy_coef is {} so per-token entropies are needed",
               config.entropy_coef);
  if (!in.ref_logp.empty()) check_size(in.ref_logp.size(), T, "ref_logp", "sum of seq_lens");
  if (!in.rollout_logp.empty())
    check_size(in.rollout_logp.size(), T, "rollout_logp", "sum of seq_lens");
  if (!in.entropy.empty()) check_size(in.entropy.size(), T, "entropy", "sum of seq_lens");
  if (!dentropy.empty()) check_size(dentropy.size(), T, "dentropy", "sum of seq_lens");
  check_finite(in.advantages, "advantages");
  check_finite(in.logp, "logp");
  check_finite(in.old_logp, "old_logp");
  check_finite(in.ref_logp, "ref_logp");
  check_finite(in.rollout_logp, "rollout_logp");
  check_finite(in.entropy, "entropy");
  if (config.aggregation == LossAggregation::kTokenMean) {
    TANDEM_CHECK(norm.global_tokens >= static_cast<int64_t>(std::max<size_t>(T, 1)),
                 "normalisers.global_tokens is {}: expected the token count of the whole batch, "
                 ">= this micro-batch's {} and >= 1",
                 norm.global_tokens, T);
  }
  if (config.aggregation == LossAggregation::kSeqMeanTokenMean ||
      config.aggregation == LossAggregation::kSeqMeanTokenSumNorm) {
    TANDEM_CHECK(norm.global_sequences >= static_cast<int64_t>(std::max<size_t>(B, 1)),
                 "normalisers.global_sequences is {}: expected the sequence count of the whole "
                 "batch, >= this micro-batch's {} and >= 1",
                 norm.global_sequences, B);
  }

  PolicyLossResult result;
  PolicyLossMetrics& m = result.metrics;
  m.tokens = static_cast<int64_t>(T);
  m.sequences = static_cast<int64_t>(B);
  const double lo = 1.0 - config.eps_low;
  const double hi = 1.0 + config.eps_high;
  const double c = config.dual_clip_c;
  double loss = 0;

  size_t t0 = 0;
  for (size_t i = 0; i < B; ++i) {
    const size_t len = static_cast<size_t>(in.seq_lens[i]);
    const double A = in.advantages[i];
    double alpha = 1.0;
    switch (config.aggregation) {
      case LossAggregation::kTokenMean:
        alpha = 1.0 / static_cast<double>(norm.global_tokens);
        break;
      case LossAggregation::kSeqMeanTokenMean:
        alpha = 1.0 / (static_cast<double>(len) * static_cast<double>(norm.global_sequences));
        break;
      case LossAggregation::kSeqMeanTokenSumNorm:
        alpha = 1.0 / (config.seq_sum_norm * static_cast<double>(norm.global_sequences));
        break;
      case LossAggregation::kTokenSum:
        alpha = 1.0;
        break;
    }

    // GSPO: s_i = exp(min(mean_t(logp - old), 10)); verl's stop-gradient form
    // s_i,t = sg[s_i] * pi_t / sg[pi_t] has value s_i and d s_i,t / d logp_t = s_i.
    double seq_ratio = 1.0, seq_ratio_grad = 1.0;
    if (config.ratio_level == RatioLevel::kSequence) {
      double lsum = 0;
      for (size_t t = t0; t < t0 + len; ++t)
        lsum += static_cast<double>(in.logp[t]) - in.old_logp[t];
      const double lmean = lsum / static_cast<double>(len);
      seq_ratio = std::exp(std::min(lmean, kGspoLogRatioMax));
      seq_ratio_grad = lmean <= kGspoLogRatioMax ? seq_ratio : 0.0;
    }
    // Sequence-level IS weight: the product of the token weights, exp(sum(old - rollout)).
    double seq_log_w = 0;
    if (config.is_level == ImportanceLevel::kSequence) {
      for (size_t t = t0; t < t0 + len; ++t)
        seq_log_w += static_cast<double>(in.old_logp[t]) - in.rollout_logp[t];
    }

    for (size_t t = t0; t < t0 + len; ++t) {
      const double logp = in.logp[t];
      const double old = in.old_logp[t];
      // Ratio and d ratio / d logp.
      double r, dr;
      if (config.ratio_level == RatioLevel::kSequence) {
        r = seq_ratio;
        dr = seq_ratio_grad;
      } else {
        const double lr = logp - old;
        r = std::exp(std::clamp(lr, -kLogRatioClamp, kLogRatioClamp));
        dr = inside(lr, -kLogRatioClamp, kLogRatioClamp) ? r : 0.0;
      }
      // Clipped surrogate l = max(-A r, -A clip(r)), then min(l, -A c) for A < 0; dl/dr.
      double pg = -A * r;
      double dpg = -A;
      if (config.clip) {
        const double pg2 = -A * std::clamp(r, lo, hi);
        if (!inside(r, lo, hi)) {
          if (pg2 > pg) {
            pg = pg2;
            dpg = 0;
          }
          if (A > 0 && r > hi) ++m.clipped_high;
          if (A < 0 && r < lo) ++m.clipped_low;
        }
      }
      if (c > 0 && A < 0) {
        const double pg3 = -A * c;
        if (pg > pg3) {
          pg = pg3;
          dpg = 0;
          ++m.clipped_dual;
        } else if (pg == pg3) {
          dpg *= 0.5;  // torch.minimum splits the gradient of a tie
        }
      }
      // Importance-sampling weight (no gradient).
      double w = 1.0;
      if (use_is) {
        const double lw = config.is_level == ImportanceLevel::kToken
                              ? static_cast<double>(old) - in.rollout_logp[t]
                              : seq_log_w;
        w = std::exp(std::clamp(lw, -kLogRatioClamp, kLogRatioClamp));
        if (w > config.is_cap) {
          ++m.is_capped;
          w = config.is_mode == ImportanceMode::kTruncate ? config.is_cap : 0.0;
        }
        m.is_weight_sum += w;
        m.is_weight_min = std::min(m.is_weight_min, w);
        m.is_weight_max = std::max(m.is_weight_max, w);
      }
      // KL to the reference: x = clamp(ref - logp, +-20); k clamped to +-10.
      double kl = 0, dkl = 0;
      if (use_kl) {
        const double x_raw = static_cast<double>(in.ref_logp[t]) - logp;
        const double x = std::clamp(x_raw, -kKlInputClamp, kKlInputClamp);
        double k, dk_dx;
        switch (config.kl_estimator) {
          case KlEstimator::kK1:
            k = -x;
            dk_dx = -1;
            break;
          case KlEstimator::kK2:
            k = 0.5 * x * x;
            dk_dx = x;
            break;
          default:
            k = std::exp(x) - x - 1.0;
            dk_dx = std::exp(x) - 1.0;
            break;
        }
        kl = std::clamp(k, -kKlOutputClamp, kKlOutputClamp);
        const bool pass = inside(x_raw, -kKlInputClamp, kKlInputClamp) &&
                          inside(k, -kKlOutputClamp, kKlOutputClamp);
        dkl = pass ? -dk_dx : 0.0;  // dx / dlogp = -1
        m.kl_ref_sum += kl;
      }
      const double H = in.entropy.empty() ? 0.0 : in.entropy[t];

      const double pg_term = alpha * w * pg;
      const double kl_term = alpha * config.kl_beta * kl;
      const double ent_term = -alpha * config.entropy_coef * H;
      m.pg_loss += pg_term;
      m.kl_loss += kl_term;
      m.entropy_loss += ent_term;
      loss += pg_term + kl_term + ent_term;
      dlogp[t] = static_cast<float>(alpha * (w * dpg * dr + config.kl_beta * dkl));
      if (!dentropy.empty()) dentropy[t] = static_cast<float>(-alpha * config.entropy_coef);

      // Metrics.
      const double d_old = old - logp;
      m.kl_old_k1_sum += d_old;
      m.kl_old_k3_sum += std::exp(std::clamp(d_old, -kKlInputClamp, kKlInputClamp)) - d_old - 1.0;
      m.entropy_sum += H;
      m.ratio_sum += r;
      m.ratio_min = std::min(m.ratio_min, r);
      m.ratio_max = std::max(m.ratio_max, r);
      if (!in.rollout_logp.empty()) {
        const double d = std::abs(old - static_cast<double>(in.rollout_logp[t]));
        ++m.mismatch_tokens;
        m.mismatch_abs_sum += d;
        m.mismatch_abs_max = std::max(m.mismatch_abs_max, d);
        m.mismatch_mult_sum += std::exp(std::min(d, kLogRatioClamp));
        const double c = std::abs(logp - static_cast<double>(in.rollout_logp[t]));
        m.current_rollout_abs_sum += c;
        m.current_rollout_abs_max = std::max(m.current_rollout_abs_max, c);
      }
    }
    t0 += len;
  }
  result.loss = loss;
  return result;
}

PolicyLoss compute_policy_loss(const PolicyLossInput& input, const PolicyLossConfig& config,
                               const LossNormalisers& normalisers) {
  PolicyLoss out;
  out.dlogp.assign(input.logp.size(), 0.0f);
  out.dentropy.assign(input.logp.size(), 0.0f);
  // Sizes of dlogp/dentropy follow logp; compute_policy_loss checks logp against seq_lens.
  PolicyLossResult r = compute_policy_loss(input, config, normalisers, out.dlogp, out.dentropy);
  out.loss = r.loss;
  out.metrics = r.metrics;
  return out;
}

// ---- Metrics -----------------------------------------------------------------------------------

void PolicyLossMetrics::merge(const PolicyLossMetrics& o) {
  tokens += o.tokens;
  sequences += o.sequences;
  pg_loss += o.pg_loss;
  kl_loss += o.kl_loss;
  entropy_loss += o.entropy_loss;
  clipped_low += o.clipped_low;
  clipped_high += o.clipped_high;
  clipped_dual += o.clipped_dual;
  kl_old_k1_sum += o.kl_old_k1_sum;
  kl_old_k3_sum += o.kl_old_k3_sum;
  kl_ref_sum += o.kl_ref_sum;
  entropy_sum += o.entropy_sum;
  ratio_sum += o.ratio_sum;
  ratio_min = std::min(ratio_min, o.ratio_min);
  ratio_max = std::max(ratio_max, o.ratio_max);
  is_weight_sum += o.is_weight_sum;
  is_weight_min = std::min(is_weight_min, o.is_weight_min);
  is_weight_max = std::max(is_weight_max, o.is_weight_max);
  is_capped += o.is_capped;
  mismatch_tokens += o.mismatch_tokens;
  mismatch_abs_sum += o.mismatch_abs_sum;
  mismatch_abs_max = std::max(mismatch_abs_max, o.mismatch_abs_max);
  mismatch_mult_sum += o.mismatch_mult_sum;
  current_rollout_abs_sum += o.current_rollout_abs_sum;
  current_rollout_abs_max = std::max(current_rollout_abs_max, o.current_rollout_abs_max);
}

namespace {
double per(double sum, int64_t count) { return count > 0 ? sum / static_cast<double>(count) : 0.0; }
}  // namespace

double PolicyLossMetrics::pg_clipfrac_low() const {
  return per(static_cast<double>(clipped_low), tokens);
}
double PolicyLossMetrics::pg_clipfrac_high() const {
  return per(static_cast<double>(clipped_high), tokens);
}
double PolicyLossMetrics::pg_clipfrac() const {
  return per(static_cast<double>(clipped_low + clipped_high), tokens);
}
double PolicyLossMetrics::approx_kl_old() const { return per(kl_old_k3_sum, tokens); }
double PolicyLossMetrics::kl_ref_mean() const { return per(kl_ref_sum, tokens); }
double PolicyLossMetrics::entropy_mean() const { return per(entropy_sum, tokens); }
double PolicyLossMetrics::ratio_mean() const { return per(ratio_sum, tokens); }
double PolicyLossMetrics::is_weight_mean() const { return per(is_weight_sum, tokens); }
double PolicyLossMetrics::mismatch_abs_mean() const {
  return per(mismatch_abs_sum, mismatch_tokens);
}
double PolicyLossMetrics::current_rollout_abs_mean() const {
  return per(current_rollout_abs_sum, mismatch_tokens);
}
double PolicyLossMetrics::token_mult_prob_error() const {
  return per(mismatch_mult_sum, mismatch_tokens);
}

// ---- Names -------------------------------------------------------------------------------------

std::string_view to_string(LossAggregation a) { return name_of(kLossAggregationNames, a); }

std::string_view to_string(KlEstimator k) { return name_of(kKlEstimatorNames, k); }

LossAggregation parse_loss_aggregation(std::string_view s) {
  const auto a = value_of(kLossAggregationNames, s);
  TANDEM_CHECK(a.has_value(), "loss aggregation '{}': expected {}", s,
               names_list(kLossAggregationNames));
  return *a;
}

KlEstimator parse_kl_estimator(std::string_view s) {
  const auto k = value_of(kKlEstimatorNames, s);
  TANDEM_CHECK(k.has_value(), "KL estimator '{}': expected {}", s, names_list(kKlEstimatorNames));
  return *k;
}

}  // namespace tandem::trainer
