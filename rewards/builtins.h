// The built-in reward functions: math answer match, exact match, regex format, length penalty.
#pragma once

#include <memory>

#include "rewards/math_answer.h"
#include "rewards/regex.h"
#include "rewards/reward.h"

namespace tandem::rewards {

// 1 when the completion's answer equals the reference answer (sample.answer), else 0.
// Reference: the GSM8K "#### n" line if present, else \boxed{...}, else the whole answer field.
// Completion: the last \boxed{...}, else the last "#### n", else (last_number_fallback) its last
// number. A sample without a reference answer is an error (ok == false).
class MathAnswerReward : public RewardFunction {
 public:
  struct Options {
    bool last_number_fallback = true;
    bool allow_percent = true;
    double correct = 1.0;
    double wrong = 0.0;  // also when no answer is found in the completion
  };
  MathAnswerReward(std::string name, Options options);
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }
  // What the completion answers, by the rules above; nullopt when it answers nothing.
  std::optional<std::string> completion_answer(std::string_view completion) const;
  static std::string reference_answer(std::string_view answer);

 private:
  std::string name_;
  Options options_;
};

// 1 when the trimmed completion equals the trimmed answer field (optionally ignoring case).
class ExactMatchReward : public RewardFunction {
 public:
  struct Options {
    bool case_insensitive = false;
    double match = 1.0;
    double mismatch = 0.0;
  };
  ExactMatchReward(std::string name, Options options);
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }

 private:
  std::string name_;
  Options options_;
};

// 1 when the completion matches a PCRE2 pattern (the whole completion, or anywhere in it), else 0.
class RegexFormatReward : public RewardFunction {
 public:
  struct Options {
    std::string pattern{};
    bool full_match = true;  // false: search anywhere
    bool dotall = true;
    bool multiline = false;
    bool case_insensitive = false;
    double match = 1.0;
    double mismatch = 0.0;
  };
  RegexFormatReward(std::string name,
                    Options options);  // throws on a pattern that does not compile
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }

 private:
  std::string name_;
  Options options_;
  std::unique_ptr<Regex> regex_;
};

// -min(max_penalty, per_token * max(0, completion_tokens - target_tokens)): zero up to the
// target, then linear in the tokens beyond it, capped at max_penalty (<= 0: no cap).
// A truncated sample gets -truncated_penalty instead when truncated_penalty is set (>= 0).
class LengthPenaltyReward : public RewardFunction {
 public:
  struct Options {
    int64_t target_tokens = 0;
    double per_token = 0.001;
    double max_penalty = 0.0;
    double truncated_penalty = -1.0;
  };
  LengthPenaltyReward(std::string name, Options options);
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }

 private:
  std::string name_;
  Options options_;
};

}  // namespace tandem::rewards
