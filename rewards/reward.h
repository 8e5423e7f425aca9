// The reward interface: samples in, one score per sample out, scored in batches.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace tandem::rewards {

// A failure that neither a fallback nor a retry can cure (a remote reward's token is refused):
// RewardSet lets it through, so the run stops at the first call instead of training on
// fallbacks.
struct FatalRewardError : Error {
  using Error::Error;
};

// One completion to score, with what a reward function may need to judge it.
struct RewardSample {
  std::string prompt{};      // the prompt text as the model saw it (chat template applied)
  std::string completion{};  // the generated text
  std::string answer{};      // the reference answer from the dataset ("" when there is none)
  nlohmann::json extra{};    // further dataset fields, passed through untouched
  int64_t completion_tokens = 0;
  bool truncated = false;  // generation stopped at the token limit, not at an end token
};

// The score of one sample. ok == false: the function could not judge this sample (error says
// why); the caller gives the sample its fallback value and counts it.
struct RewardResult {
  double value = 0.0;
  bool ok = true;
  std::string error{};

  static RewardResult success(double v) { return {v, true, {}}; }
  static RewardResult failure(std::string why) { return {0.0, false, std::move(why)}; }
};

// A reward function scores a batch at a time (a remote or plugin function pays its call
// overhead once per batch). score returns exactly one result per sample, in order. It may throw
// for a failure of the whole batch. RewardSet calls one function from one thread at a time.
class RewardFunction {
 public:
  virtual ~RewardFunction() = default;
  virtual std::vector<RewardResult> score(std::span<const RewardSample> samples) = 0;
  // The name in metrics and error messages (the config's name for this function).
  virtual const std::string& name() const = 0;
};

}  // namespace tandem::rewards
