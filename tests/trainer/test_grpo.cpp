// Unit tests of the GRPO math: advantages, step-0 identities, micro-batch invariance, finite
// differences of the loss gradient, and the errors for bad configs and inputs.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/error.h"
#include "trainer/grpo.h"

using namespace tandem::trainer;

namespace {

// A seeded random micro-batch of ragged sequences with logprobs near each other.
struct Batch {
  std::vector<int32_t> seq_lens;
  std::vector<float> advantages, logp, old_logp, ref_logp, rollout_logp, entropy;

  PolicyLossInput input() const {
    return {seq_lens, advantages, logp, old_logp, ref_logp, rollout_logp, entropy};
  }
  int64_t tokens() const { return static_cast<int64_t>(logp.size()); }
};

Batch random_batch(uint64_t seed, int B, double spread = 0.3) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> len(1, 9);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  Batch b;
  for (int i = 0; i < B; ++i) {
    b.seq_lens.push_back(len(rng));
    b.advantages.push_back(static_cast<float>(normal(rng)));
    for (int t = 0; t < b.seq_lens.back(); ++t) {
      const double old = -3.0 * unit(rng) - 0.01;
      b.old_logp.push_back(static_cast<float>(old));
      b.logp.push_back(static_cast<float>(old + spread * normal(rng)));
      b.ref_logp.push_back(static_cast<float>(old + spread * normal(rng)));
      b.rollout_logp.push_back(static_cast<float>(old + spread * normal(rng)));
      b.entropy.push_back(static_cast<float>(2.0 * unit(rng)));
    }
  }
  return b;
}

// Sequences [s0, s1) of b as their own micro-batch.
Batch slice(const Batch& b, size_t s0, size_t s1) {
  size_t t0 = 0;
  for (size_t i = 0; i < s0; ++i) t0 += b.seq_lens[i];
  size_t t1 = t0;
  for (size_t i = s0; i < s1; ++i) t1 += b.seq_lens[i];
  auto sub = [&](const std::vector<float>& v) {
    return std::vector<float>(v.begin() + t0, v.begin() + t1);
  };
  Batch out;
  out.seq_lens.assign(b.seq_lens.begin() + s0, b.seq_lens.begin() + s1);
  out.advantages.assign(b.advantages.begin() + s0, b.advantages.begin() + s1);
  out.logp = sub(b.logp);
  out.old_logp = sub(b.old_logp);
  out.ref_logp = sub(b.ref_logp);
  out.rollout_logp = sub(b.rollout_logp);
  out.entropy = sub(b.entropy);
  return out;
}

std::vector<PolicyLossConfig> variety_of_configs() {
  std::vector<PolicyLossConfig> configs;
  for (auto agg : {LossAggregation::kTokenMean, LossAggregation::kSeqMeanTokenMean,
                   LossAggregation::kSeqMeanTokenSumNorm, LossAggregation::kTokenSum}) {
    PolicyLossConfig c;
    c.aggregation = agg;
    c.seq_sum_norm = 16;
    c.eps_high = 0.28;
    c.dual_clip_c = 3;
    c.kl_beta = 0.04;
    c.entropy_coef = 0.01;
    c.is_level = ImportanceLevel::kToken;
    configs.push_back(c);
    c.ratio_level = RatioLevel::kSequence;
    c.is_level = ImportanceLevel::kSequence;
    c.is_mode = ImportanceMode::kMask;
    c.kl_estimator = KlEstimator::kK2;
    configs.push_back(c);
  }
  return configs;
}

}  // namespace

TEST_CASE("group advantages are centred and scaled by the unbiased group std", "[unit]") {
  const std::vector<float> rewards = {1, 0, 0, 1, 0.5f, 2, 2, 2, 7, 3, -1, 4};
  const std::vector<int32_t> sizes = {5, 3, 1, 3};
  const Advantages a = compute_advantages(rewards, sizes, {});
  // First group: mean 0.5, unbiased std sqrt(1.0 / 4).
  const double std0 = std::sqrt(1.0 / 4.0);
  CHECK(a.values[0] == Approx((1 - 0.5) / (std0 + 1e-6)).epsilon(1e-6));
  CHECK(a.values[1] == Approx((0 - 0.5) / (std0 + 1e-6)).epsilon(1e-6));
  // Zero-variance group and a group of one: exactly 0.
  CHECK(a.values[5] == 0.0f);
  CHECK(a.values[6] == 0.0f);
  CHECK(a.values[7] == 0.0f);
  CHECK(a.values[8] == 0.0f);
  CHECK(a.stats.groups == 4);
  CHECK(a.stats.zero_variance_groups == 2);
  CHECK(a.stats.zero_variance_fraction == 0.5);
  double sum = 0;
  for (int i = 0; i < 5; ++i) sum += a.values[i];
  CHECK(std::abs(sum) < 1e-6);
}

TEST_CASE("zero-variance groups give exactly zero advantage in every mode", "[unit]") {
  const std::vector<float> rewards = {0.1f, 0.1f, 0.1f, 0.3f, 0.3f, 0.3f, 0.3f, 0.7f};
  const std::vector<int32_t> sizes = {3, 4, 1};
  for (auto baseline : {AdvantageBaseline::kGroupMean, AdvantageBaseline::kLeaveOneOut}) {
    for (auto scale :
         {AdvantageScale::kGroupStd, AdvantageScale::kBatchStd, AdvantageScale::kNone}) {
      const Advantages a = compute_advantages(rewards, sizes, {baseline, scale, 1e-6});
      for (float v : a.values) CHECK(v == 0.0f);
      CHECK(a.stats.zero_variance_fraction == 1.0);
    }
  }
}

TEST_CASE("leave-one-out and unscaled advantages follow their definitions", "[unit]") {
  const std::vector<float> rewards = {1, 0, 0, 0.5f};
  const std::vector<int32_t> sizes = {4};
  const Advantages loo =
      compute_advantages(rewards, sizes, {AdvantageBaseline::kLeaveOneOut, AdvantageScale::kNone});
  CHECK(loo.values[0] == Approx(1 - 0.5 / 3).epsilon(1e-7));
  CHECK(loo.values[3] == Approx(0.5 - 1.0 / 3).epsilon(1e-7));
  const Advantages dr =
      compute_advantages(rewards, sizes, {AdvantageBaseline::kGroupMean, AdvantageScale::kNone});
  CHECK(dr.values[0] == Approx(1 - 0.375).epsilon(1e-7));
}

TEST_CASE("advantages reject bad group sizes and non-finite rewards", "[unit]") {
  const std::vector<float> rewards = {1, 0, 0, 1};
  CHECK_THROWS_WITH(compute_advantages(rewards, std::vector<int32_t>{2, 3}, {}),
                    Catch::Contains("group_sizes sum to 5"));
  CHECK_THROWS_WITH(compute_advantages(rewards, std::vector<int32_t>{4, 0}, {}),
                    Catch::Contains("group_sizes[1] is 0"));
  const std::vector<float> nan_rewards = {1, NAN, 0, 1};
  CHECK_THROWS_WITH(compute_advantages(nan_rewards, std::vector<int32_t>{4}, {}),
                    Catch::Contains("rewards[1] is nan"));
  AdvantageConfig zero_eps;
  zero_eps.eps = 0;
  CHECK_THROWS_WITH(compute_advantages(rewards, std::vector<int32_t>{4}, zero_eps),
                    Catch::Contains("advantage.eps"));
}

TEST_CASE("config validation names the field and rejects a group size below two", "[unit]") {
  GrpoConfig c;
  CHECK_NOTHROW(validate(c, 8));
  CHECK_THROWS_WITH(validate(c, 1), Catch::Contains("group size G is 1"));
  c.loss.dual_clip_c = 0.5;
  CHECK_THROWS_WITH(validate(c, 8), Catch::Contains("loss.dual_clip_c is 0.5"));
  c.loss.dual_clip_c = 3;
  c.loss.aggregation = LossAggregation::kSeqMeanTokenSumNorm;
  CHECK_THROWS_WITH(validate(c, 8), Catch::Contains("loss.seq_sum_norm"));
  c.loss.seq_sum_norm = 512;
  c.loss.eps_low = 1.5;
  CHECK_THROWS_WITH(validate(c, 8), Catch::Contains("loss.eps_low is 1.5"));
  c.loss.eps_low = 0.2;
  c.loss.kl_beta = -1;
  CHECK_THROWS_WITH(validate(c, 8), Catch::Contains("loss.kl_beta"));
  CHECK(parse_loss_aggregation("seq-mean-token-sum-norm") == LossAggregation::kSeqMeanTokenSumNorm);
  CHECK(parse_kl_estimator("k2") == KlEstimator::kK2);
  CHECK_THROWS_WITH(parse_kl_estimator("k4"), Catch::Contains("'k4'"));
}

TEST_CASE("at step 0 the ratio is exactly one and the KL exactly zero", "[unit]") {
  Batch b = random_batch(11, 6);
  b.logp = b.old_logp;
  b.ref_logp = b.old_logp;
  b.rollout_logp = b.old_logp;
  for (const PolicyLossConfig& c : variety_of_configs()) {
    const PolicyLoss out = compute_policy_loss(b.input(), c, {b.tokens(), 6});
    CHECK(out.metrics.ratio_min == 1.0);
    CHECK(out.metrics.ratio_max == 1.0);
    CHECK(out.metrics.kl_ref_sum == 0.0);
    CHECK(out.metrics.kl_old_k1_sum == 0.0);
    CHECK(out.metrics.kl_old_k3_sum == 0.0);
    CHECK(out.metrics.pg_clipfrac() == 0.0);
    CHECK(out.metrics.clipped_dual == 0);
    CHECK(out.metrics.is_weight_min == 1.0);
    CHECK(out.metrics.is_weight_max == 1.0);
    CHECK(out.metrics.mismatch_abs_max == 0.0);
    // d loss / d logp_t = -A_i * alpha_t exactly (alpha the aggregation weight).
    size_t t = 0;
    for (size_t i = 0; i < b.seq_lens.size(); ++i) {
      double alpha = 1;
      if (c.aggregation == LossAggregation::kTokenMean) alpha = 1.0 / b.tokens();
      if (c.aggregation == LossAggregation::kSeqMeanTokenMean) alpha = 1.0 / (b.seq_lens[i] * 6.0);
      if (c.aggregation == LossAggregation::kSeqMeanTokenSumNorm) alpha = 1.0 / (16.0 * 6.0);
      for (int32_t k = 0; k < b.seq_lens[i]; ++k, ++t) {
        CHECK(out.dlogp[t] == static_cast<float>(-b.advantages[i] * alpha));
      }
    }
  }
}

TEST_CASE("splitting the batch into micro-batches keeps loss and gradients", "[unit]") {
  const int B = 8;
  const Batch b = random_batch(7, B, 0.4);
  for (const PolicyLossConfig& c : variety_of_configs()) {
    const LossNormalisers norm{b.tokens(), B};
    const PolicyLoss whole = compute_policy_loss(b.input(), c, norm);
    for (int parts : {2, 4}) {
      double loss = 0;
      std::vector<float> dlogp, dentropy;
      PolicyLossMetrics metrics;
      for (int p = 0; p < parts; ++p) {
        const Batch mb = slice(b, p * B / parts, (p + 1) * B / parts);
        const PolicyLoss part = compute_policy_loss(mb.input(), c, norm);
        loss += part.loss;
        dlogp.insert(dlogp.end(), part.dlogp.begin(), part.dlogp.end());
        dentropy.insert(dentropy.end(), part.dentropy.begin(), part.dentropy.end());
        metrics.merge(part.metrics);
      }
      CHECK(loss == Approx(whole.loss).epsilon(1e-12));
      CHECK(dlogp == whole.dlogp);  // per-token gradients do not depend on the split at all
      CHECK(dentropy == whole.dentropy);
      CHECK(metrics.tokens == whole.metrics.tokens);
      CHECK(metrics.clipped_low == whole.metrics.clipped_low);
      CHECK(metrics.clipped_high == whole.metrics.clipped_high);
      CHECK(metrics.is_capped == whole.metrics.is_capped);
      CHECK(metrics.ratio_max == whole.metrics.ratio_max);
      CHECK(metrics.kl_ref_sum == Approx(whole.metrics.kl_ref_sum).epsilon(1e-12));
    }
  }
}

TEST_CASE("the policy loss gradient matches finite differences", "[unit]") {
  const Batch b = random_batch(3, 5, 0.25);
  for (const PolicyLossConfig& c : variety_of_configs()) {
    const LossNormalisers norm{b.tokens(), 5};
    const PolicyLoss out = compute_policy_loss(b.input(), c, norm);
    for (size_t t = 0; t < b.logp.size(); ++t) {
      // The loss is piecewise smooth: step in float-representable amounts, skip kinks.
      const float h = 1.0f / 1024;
      Batch plus = b, minus = b;
      plus.logp[t] += h;
      minus.logp[t] -= h;
      const double fd = (compute_policy_loss(plus.input(), c, norm).loss -
                         compute_policy_loss(minus.input(), c, norm).loss) /
                        (static_cast<double>(plus.logp[t]) - minus.logp[t]);
      const double scale = std::abs(out.dlogp[t]) + 1e-3 * std::abs(out.loss) + 1e-9;
      const PolicyLossMetrics& mp = compute_policy_loss(plus.input(), c, norm).metrics;
      const PolicyLossMetrics& mm = compute_policy_loss(minus.input(), c, norm).metrics;
      if (mp.clipped_low != mm.clipped_low || mp.clipped_high != mm.clipped_high ||
          mp.clipped_dual != mm.clipped_dual || mp.is_capped != mm.is_capped)
        continue;
      CHECK(std::abs(fd - out.dlogp[t]) / scale < 1e-3);
    }
  }
}

TEST_CASE("the policy loss rejects mismatched and non-finite inputs", "[unit]") {
  Batch b = random_batch(5, 3);
  PolicyLossConfig c;
  c.kl_beta = 0.1;
  const LossNormalisers norm{b.tokens(), 3};
  Batch short_logp = b;
  short_logp.logp.pop_back();
  CHECK_THROWS_WITH(compute_policy_loss(short_logp.input(), c, norm), Catch::Contains("logp has"));
  Batch no_ref = b;
  no_ref.ref_logp.clear();
  CHECK_THROWS_WITH(compute_policy_loss(no_ref.input(), c, norm), Catch::Contains("ref_logp"));
  Batch nan_old = b;
  nan_old.old_logp[2] = NAN;
  CHECK_THROWS_WITH(compute_policy_loss(nan_old.input(), c, norm),
                    Catch::Contains("old_logp[2] is nan"));
  Batch inf_adv = b;
  inf_adv.advantages[1] = INFINITY;
  CHECK_THROWS_WITH(compute_policy_loss(inf_adv.input(), c, norm),
                    Catch::Contains("advantages[1] is inf"));
  CHECK_THROWS_WITH(compute_policy_loss(b.input(), c, {b.tokens() - 1, 3}),
                    Catch::Contains("global_tokens"));
  c.aggregation = LossAggregation::kSeqMeanTokenMean;
  CHECK_THROWS_WITH(compute_policy_loss(b.input(), c, {b.tokens(), 0}),
                    Catch::Contains("global_sequences"));
  // Nothing is written when the input is rejected.
  std::vector<float> dlogp(nan_old.logp.size(), 42.0f);
  CHECK_THROWS(compute_policy_loss(nan_old.input(), c, norm, dlogp, {}));
  for (float g : dlogp) CHECK(g == 42.0f);
}

TEST_CASE("clip-higher and dual clip cut the gradient where their bounds are active", "[unit]") {
  // One token per sequence: ratios e^0.5 (above 1.28) and e^-0.5 (below 0.8), A = +-1.
  const std::vector<int32_t> lens = {1, 1, 1, 1};
  const std::vector<float> adv = {1, -1, 1, -1};
  const std::vector<float> old = {-1, -1, -1, -1};
  const std::vector<float> logp = {-0.5f, -0.5f, -1.5f, -1.5f};
  PolicyLossConfig c;
  c.eps_high = 0.28;
  c.aggregation = LossAggregation::kTokenSum;
  PolicyLossInput in{lens, adv, logp, old, {}, {}, {}};
  PolicyLoss out = compute_policy_loss(in, c, {});
  CHECK(out.dlogp[0] == 0.0f);                                   // A>0, ratio above 1.28
  CHECK(out.dlogp[1] == Approx(std::exp(0.5)).epsilon(1e-6));    // A<0, ratio high: kept
  CHECK(out.dlogp[2] == Approx(-std::exp(-0.5)).epsilon(1e-6));  // A>0, ratio low: kept
  CHECK(out.dlogp[3] == 0.0f);                                   // A<0, ratio below 0.8
  CHECK(out.metrics.clipped_high == 1);
  CHECK(out.metrics.clipped_low == 1);
  c.dual_clip_c = 1.5;  // -A*r = e^0.5 = 1.65 > 1.5: bounded, gradient cut
  out = compute_policy_loss(in, c, {});
  CHECK(out.dlogp[1] == 0.0f);
  CHECK(out.metrics.clipped_dual == 1);
  CHECK(out.loss == Approx(-1.28 + 1.5 - std::exp(-0.5) + 0.8).epsilon(1e-6));
}

TEST_CASE("the current policy's distance to the rollout's logprobs is measured per token",
          "[unit]") {
  for (const uint64_t seed : {3u, 17u, 99u}) {
    const Batch b = random_batch(seed, 5);
    double sum = 0, max = 0;
    for (size_t t = 0; t < b.logp.size(); ++t) {
      const double d =
          std::abs(static_cast<double>(b.logp[t]) - static_cast<double>(b.rollout_logp[t]));
      sum += d;
      max = std::max(max, d);
    }
    REQUIRE(max > 0);
    const PolicyLoss out = compute_policy_loss(b.input(), PolicyLossConfig{}, {b.tokens(), 5});
    CHECK(out.metrics.current_rollout_abs_max == max);
    CHECK(out.metrics.current_rollout_abs_mean() == Approx(sum / b.tokens()).epsilon(1e-12));
    // Merged over two halves of the same batch: the same.
    PolicyLossMetrics twice = out.metrics;
    twice.merge(out.metrics);
    CHECK(twice.current_rollout_abs_max == max);
    CHECK(twice.current_rollout_abs_mean() == Approx(sum / b.tokens()).epsilon(1e-12));
  }
}
