// GRPO math of the trainer: group advantages, the clipped policy loss with KL and entropy terms,
// its gradient with respect to each token's logprob, and the metrics of one micro-batch.
//
// Pure host code on small per-token arrays; everything is computed in double and only the
// per-token outputs are rounded to float. Formulas and the frameworks they mirror: docs/grpo.md.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "core/names.h"

namespace tandem::trainer {

// ---- Advantages ------------------------------------------------------------------------------

// What is subtracted from each reward.
enum class AdvantageBaseline {
  kGroupMean,    // r_i - mean(group)                       (GRPO; verl, TRL, slime)
  kLeaveOneOut,  // r_i - mean(group without i) (RLOO; NeMo-RL, OpenRLHF rloo)
};
// What the centred reward is divided by (plus eps).
enum class AdvantageScale {
  kGroupStd,  // unbiased std (ddof 1) of the group's rewards     (GRPO)
  kBatchStd,  // unbiased std of all rewards of the batch         (TRL scale_rewards="batch")
  kNone,      // no division                                      (Dr. GRPO)
};
// Their names in configs and docs.
inline constexpr NamedValue<AdvantageBaseline> kAdvantageBaselineNames[] = {
    {AdvantageBaseline::kGroupMean, "group-mean"},
    {AdvantageBaseline::kLeaveOneOut, "leave-one-out"}};
inline constexpr NamedValue<AdvantageScale> kAdvantageScaleNames[] = {
    {AdvantageScale::kGroupStd, "group-std"},
    {AdvantageScale::kBatchStd, "batch-std"},
    {AdvantageScale::kNone, "none"}};

struct AdvantageConfig {
  AdvantageBaseline baseline = AdvantageBaseline::kGroupMean;
  AdvantageScale scale = AdvantageScale::kGroupStd;
  double eps = 1e-6;  // added to the std (verl, slime); must be > 0 when dividing by a std
};

// Batch-level statistics for the step metrics.
struct AdvantageStats {
  double reward_mean = 0, reward_std = 0;  // over the batch (std unbiased; 0 for one reward)
  double advantage_mean = 0, advantage_std = 0, advantage_min = 0, advantage_max = 0;
  int64_t groups = 0;
  int64_t zero_variance_groups = 0;  // every reward of the group equal (groups of one included)
  double zero_variance_fraction = 0;
};

// The rewards of B samples laid out group after group, described for the step metrics (the
// reward part of AdvantageStats, for groups that need no advantages, e.g. those dynamic sampling
// dropped). Throws as compute_advantages does.
struct RewardStats {
  double mean = 0, std = 0;  // std unbiased; 0 for one reward
  int64_t groups = 0;
  int64_t zero_variance_groups = 0;
  double zero_variance_fraction = 0;
};
RewardStats reward_stats(std::span<const float> rewards, std::span<const int32_t> group_sizes);

struct Advantages {
  std::vector<float> values;  // (B) one per sample, in the order of the rewards
  AdvantageStats stats;
};

// Advantages of B = sum(group_sizes) samples laid out group after group. A group whose rewards
// are all equal (a group of one included) gets exactly 0. Throws tandem::Error on sizes < 1,
// sizes not summing to B, or a non-finite reward (naming its index).
Advantages compute_advantages(std::span<const float> rewards, std::span<const int32_t> group_sizes,
                              const AdvantageConfig& config);

// ---- Policy loss -----------------------------------------------------------------------------

// How the per-token losses l_t become one number. alpha_t is the weight of token t (sequence i):
enum class LossAggregation {
  kTokenMean,            // alpha = 1 / global_tokens                     (DAPO; verl default)
  kSeqMeanTokenMean,     // alpha = 1 / (len_i * global_sequences)        (GRPO paper)
  kSeqMeanTokenSumNorm,  // alpha = 1 / (seq_sum_norm * global_sequences) (Dr. GRPO, as TRL)
  kTokenSum,             // alpha = 1
};
enum class KlEstimator { kK1, kK2, kK3 };
// Importance ratio per token (PPO/GRPO) or per sequence (GSPO, verl's stop-gradient form).
enum class RatioLevel { kToken, kSequence };
// Rollout/trainer mismatch correction: weight exp(old_logp - rollout_logp) per token, or the
// product over the sequence (exp of the summed log-differences), with no gradient.
enum class ImportanceLevel { kNone, kToken, kSequence };
enum class ImportanceMode {
  kTruncate,  // w = min(w, cap)                         (TIS; verl, TRL *_truncate)
  kMask,      // w = w if w <= cap else 0 (still counted) (TRL *_mask)
};
// Their names in configs and docs.
inline constexpr NamedValue<LossAggregation> kLossAggregationNames[] = {
    {LossAggregation::kTokenMean, "token-mean"},
    {LossAggregation::kSeqMeanTokenMean, "seq-mean-token-mean"},
    {LossAggregation::kSeqMeanTokenSumNorm, "seq-mean-token-sum-norm"},
    {LossAggregation::kTokenSum, "token-sum"}};
inline constexpr NamedValue<KlEstimator> kKlEstimatorNames[] = {
    {KlEstimator::kK1, "k1"}, {KlEstimator::kK2, "k2"}, {KlEstimator::kK3, "k3"}};
inline constexpr NamedValue<RatioLevel> kRatioLevelNames[] = {{RatioLevel::kToken, "token"},
                                                              {RatioLevel::kSequence, "sequence"}};
inline constexpr NamedValue<ImportanceLevel> kImportanceLevelNames[] = {
    {ImportanceLevel::kNone, "none"},
    {ImportanceLevel::kToken, "token"},
    {ImportanceLevel::kSequence, "sequence"}};
inline constexpr NamedValue<ImportanceMode> kImportanceModeNames[] = {
    {ImportanceMode::kTruncate, "truncate"}, {ImportanceMode::kMask, "mask"}};

struct PolicyLossConfig {
  RatioLevel ratio_level = RatioLevel::kToken;
  bool clip = true;        // off: l = -A * ratio (no trust region)
  double eps_low = 0.2;    // ratio clipped to [1 - eps_low, 1 + eps_high]
  double eps_high = 0.2;   // clip-higher (DAPO) when > eps_low
  double dual_clip_c = 0;  // 0 = off; else > 1: l <= -A * c for A < 0 (verl clip_ratio_c)
  LossAggregation aggregation = LossAggregation::kTokenMean;
  double seq_sum_norm = 0;  // the constant of kSeqMeanTokenSumNorm (e.g. max response length)
  KlEstimator kl_estimator = KlEstimator::kK3;
  double kl_beta = 0;       // 0: no KL term, ref_logp not needed
  double entropy_coef = 0;  // bonus: loss -= coef * aggregated entropy
  ImportanceLevel is_level = ImportanceLevel::kNone;
  ImportanceMode is_mode = ImportanceMode::kTruncate;
  double is_cap = 2.0;  // > 0
};

struct GrpoConfig {
  AdvantageConfig advantage;
  PolicyLossConfig loss;
};

// Throws tandem::Error naming the field, what was expected and what was found: eps values, caps,
// dual clip c <= 1, seq_sum_norm <= 0 with kSeqMeanTokenSumNorm, negative beta or coefficients,
// and a group size G < 2 (GRPO needs at least two samples per prompt to have a baseline).
void validate(const GrpoConfig& config, int group_size);
void validate(const PolicyLossConfig& config);
void validate(const AdvantageConfig& config);

// The normalisers over the WHOLE batch (every micro-batch of every rank) that the aggregation
// divides by, so that per-micro-batch losses and gradients simply add up.
struct LossNormalisers {
  int64_t global_tokens = 0;     // kTokenMean
  int64_t global_sequences = 0;  // kSeqMeanTokenMean, kSeqMeanTokenSumNorm
};

// One micro-batch of B packed sequences (no padding), T = sum(seq_lens) tokens.
struct PolicyLossInput {
  std::span<const int32_t> seq_lens;    // (B) response tokens of each sequence, each >= 1
  std::span<const float> advantages;    // (B) one per sequence
  std::span<const float> logp;          // (T) current policy
  std::span<const float> old_logp;      // (T) policy that sampled (or recomputed pi_old)
  std::span<const float> ref_logp;      // (T) reference; needed only when kl_beta > 0
  std::span<const float> rollout_logp;  // (T) engine's logprobs; needed only with is_level
  std::span<const float> entropy;       // (T) optional (needed when entropy_coef > 0)
};

// Sums over the micro-batch's tokens; merge() adds another micro-batch's; the accessors divide.
struct PolicyLossMetrics {
  int64_t tokens = 0, sequences = 0;
  double pg_loss = 0, kl_loss = 0, entropy_loss = 0;  // aggregated contributions to the loss
  int64_t clipped_low = 0;   // A < 0 and ratio < 1 - eps_low (gradient cut)
  int64_t clipped_high = 0;  // A > 0 and ratio > 1 + eps_high (gradient cut)
  int64_t clipped_dual = 0;  // A < 0 and the dual clip bound -A*c is active
  double kl_old_k1_sum = 0;  // sum of old - logp   (verl's ppo_kl)
  double kl_old_k3_sum = 0;  // sum of k3(old vs current): exp(old-logp) - (old-logp) - 1
  double kl_ref_sum = 0;     // sum of the configured (clamped) estimator; 0 when beta == 0
  double entropy_sum = 0;
  double ratio_sum = 0;
  double ratio_min = std::numeric_limits<double>::infinity();
  double ratio_max = -std::numeric_limits<double>::infinity();
  double is_weight_sum = 0;  // weights after truncation/masking; 0 tokens counted when off
  double is_weight_min = std::numeric_limits<double>::infinity();
  double is_weight_max = -std::numeric_limits<double>::infinity();
  int64_t is_capped = 0;  // tokens whose raw weight exceeded the cap (truncated or masked)
  // Rollout vs trainer logprobs (old_logp vs rollout_logp), when rollout_logp is given.
  int64_t mismatch_tokens = 0;
  double mismatch_abs_sum = 0, mismatch_abs_max = 0;
  double mismatch_mult_sum = 0;  // sum of exp(|old - rollout|): NeMo-RL token_mult_prob_error
  // Current policy vs rollout logprobs (|logp - rollout_logp|), when rollout_logp is given: with
  // the rollout's as the old ones, one epoch and one minibatch, the rollout/trainer mismatch at
  // the weights the update starts from.
  double current_rollout_abs_sum = 0, current_rollout_abs_max = 0;

  void merge(const PolicyLossMetrics& other);
  double pg_clipfrac_low() const;
  double pg_clipfrac_high() const;
  double pg_clipfrac() const;    // low + high, verl's pg_clipfrac
  double approx_kl_old() const;  // k3 mean (>= 0), the "approx KL to old" of the step metrics
  double kl_ref_mean() const;
  double entropy_mean() const;
  double ratio_mean() const;
  double is_weight_mean() const;
  double mismatch_abs_mean() const;
  double token_mult_prob_error() const;
  double current_rollout_abs_mean() const;  // over mismatch_tokens
};

struct PolicyLossResult {
  double loss = 0;  // this micro-batch's share of the batch loss
  PolicyLossMetrics metrics;
};

// Loss = sum_t alpha_t * (w_t * l_t + beta * kl_t - entropy_coef * H_t) over this micro-batch,
// with l_t the clipped surrogate and w_t the IS weight. Writes d loss / d logp_t into dlogp (T)
// and d loss / d entropy_t into dentropy (T, or empty to skip). Throws tandem::Error (naming the
// array, the index and the value) on mismatched lengths, a missing needed array, a non-finite
// input, or normalisers that the aggregation needs but are < 1; nothing is written then.
PolicyLossResult compute_policy_loss(const PolicyLossInput& input, const PolicyLossConfig& config,
                                     const LossNormalisers& normalisers, std::span<float> dlogp,
                                     std::span<float> dentropy);

struct PolicyLoss {
  double loss = 0;
  std::vector<float> dlogp;     // (T)
  std::vector<float> dentropy;  // (T), all zero unless entropy_coef > 0
  PolicyLossMetrics metrics;
};
PolicyLoss compute_policy_loss(const PolicyLossInput& input, const PolicyLossConfig& config,
                               const LossNormalisers& normalisers);

// Names as used in configs and docs (the tables above), and back (throws on unknown).
std::string_view to_string(LossAggregation a);
std::string_view to_string(KlEstimator k);
LossAggregation parse_loss_aggregation(std::string_view s);
KlEstimator parse_kl_estimator(std::string_view s);

}  // namespace tandem::trainer
