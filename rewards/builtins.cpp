// The built-in reward functions.
#include "rewards/builtins.h"

#include <algorithm>
#include <cctype>

#include "core/error.h"

namespace tandem::rewards {
namespace {

bool iequal(std::string_view a, std::string_view b) {
  return std::ranges::equal(a, b, [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) ==
           std::tolower(static_cast<unsigned char>(y));
  });
}

}  // namespace

MathAnswerReward::MathAnswerReward(std::string name, Options options)
    : name_(std::move(name)), options_(options) {}

std::string MathAnswerReward::reference_answer(std::string_view answer) {
  if (auto gsm8k = extract_gsm8k_answer(answer)) return *gsm8k;
  if (auto boxed = extract_boxed(answer)) return *boxed;
  return std::string(trim(answer));
}

std::optional<std::string> MathAnswerReward::completion_answer(std::string_view completion) const {
  if (auto boxed = extract_boxed(completion)) return boxed;
  if (auto gsm8k = extract_gsm8k_answer(completion)) return gsm8k;
  if (options_.last_number_fallback) return extract_last_number(completion);
  return std::nullopt;
}

std::vector<RewardResult> MathAnswerReward::score(std::span<const RewardSample> samples) {
  std::vector<RewardResult> out;
  out.reserve(samples.size());
  const NumberFormat format{.allow_percent = options_.allow_percent};
  for (const RewardSample& s : samples) {
    const std::string reference = reference_answer(s.answer);
    if (reference.empty()) {
      out.push_back(RewardResult::failure("the sample has no reference answer (field 'answer')"));
      continue;
    }
    const auto predicted = completion_answer(s.completion);
    const bool right = predicted && answers_match(*predicted, reference, format);
    out.push_back(RewardResult::success(right ? options_.correct : options_.wrong));
  }
  return out;
}

ExactMatchReward::ExactMatchReward(std::string name, Options options)
    : name_(std::move(name)), options_(options) {}

std::vector<RewardResult> ExactMatchReward::score(std::span<const RewardSample> samples) {
  std::vector<RewardResult> out;
  out.reserve(samples.size());
  for (const RewardSample& s : samples) {
    const std::string_view a = trim(s.completion);
    const std::string_view b = trim(s.answer);
    const bool same = options_.case_insensitive ? iequal(a, b) : a == b;
    out.push_back(RewardResult::success(same ? options_.match : options_.mismatch));
  }
  return out;
}

RegexFormatReward::RegexFormatReward(std::string name, Options options)
    : name_(std::move(name)), options_(std::move(options)) {
  regex_ = std::make_unique<Regex>(options_.pattern,
                                   Regex::Options{.dotall = options_.dotall,
                                                  .multiline = options_.multiline,
                                                  .caseless = options_.case_insensitive},
                                   fmt::format("reward '{}' option 'pattern'", name_));
}

std::vector<RewardResult> RegexFormatReward::score(std::span<const RewardSample> samples) {
  std::vector<RewardResult> out;
  out.reserve(samples.size());
  for (const RewardSample& s : samples) {
    const bool hit =
        options_.full_match ? regex_->full_match(s.completion) : regex_->search(s.completion);
    out.push_back(RewardResult::success(hit ? options_.match : options_.mismatch));
  }
  return out;
}

LengthPenaltyReward::LengthPenaltyReward(std::string name, Options options)
    : name_(std::move(name)), options_(options) {
  TANDEM_CHECK(options_.target_tokens >= 0,
               "reward '{}' option 'target_tokens': expected >= 0, got {}", name_,
               options_.target_tokens);
  TANDEM_CHECK(options_.per_token >= 0, "reward '{}' option 'per_token': expected >= 0, got {}",
               name_, options_.per_token);
}

std::vector<RewardResult> LengthPenaltyReward::score(std::span<const RewardSample> samples) {
  std::vector<RewardResult> out;
  out.reserve(samples.size());
  for (const RewardSample& s : samples) {
    if (s.completion_tokens < 0) {
      out.push_back(RewardResult::failure(
          fmt::format("completion_tokens is {}, expected >= 0", s.completion_tokens)));
      continue;
    }
    if (s.truncated && options_.truncated_penalty >= 0) {
      out.push_back(RewardResult::success(-options_.truncated_penalty));
      continue;
    }
    const int64_t over = std::max<int64_t>(0, s.completion_tokens - options_.target_tokens);
    double penalty = options_.per_token * static_cast<double>(over);
    if (options_.max_penalty > 0) penalty = std::min(penalty, options_.max_penalty);
    out.push_back(RewardResult::success(-penalty));
  }
  return out;
}

}  // namespace tandem::rewards
