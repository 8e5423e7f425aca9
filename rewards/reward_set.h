// Several reward functions combined with weights; failures become fallbacks and are counted.
#pragma once

#include <memory>
#include <optional>

#include "rewards/reward.h"

namespace tandem::rewards {

struct RewardSetOptions {
  double fallback = 0.0;  // the value of a sample a function failed on
  // Each call of a function gets this long (seconds); <= 0: no deadline, the call runs on the
  // caller's thread. A call past its deadline is abandoned: its thread stays behind until the
  // function returns (see docs/rewards.md) and later calls of that function fail at once until
  // it has.
  double timeout_s = 60.0;
  // A function whose calls fail this many times in a row stops the run (score throws); 0: never.
  // A call fails when it throws, passes its deadline, returns the wrong number of results, or
  // fails on every sample of the batch. An entry may set its own.
  int max_consecutive_failures = 3;
};

// Counters of one function over the life of the set.
struct RewardFunctionStats {
  std::string name{};
  double weight = 1.0;
  int64_t calls = 0;
  int64_t failed_calls = 0;
  int64_t consecutive_failed_calls = 0;
  int64_t samples = 0;
  int64_t failed_samples = 0;  // samples that got the fallback, for any of the reasons below
  int64_t thrown = 0;          // calls that threw
  int64_t timed_out = 0;       // calls past the deadline or refused while one still ran
  int64_t errors = 0;          // samples with ok == false (or a batch of the wrong size)
  int64_t non_finite = 0;      // samples with a NaN or infinite value
  double value_sum = 0.0;      // over the samples that did not fail
  std::string last_error{};
};

// The scores of one batch. N samples, F functions.
struct RewardBreakdown {
  std::vector<double> total;                 // (N) sum over functions of weight * value
  std::vector<std::string> names;            // (F)
  std::vector<std::vector<double>> values;   // (F, N) unweighted, the fallback where failed
  std::vector<std::vector<uint8_t>> failed;  // (F, N) 1 where the fallback was used
  std::vector<std::string> call_errors;      // (F) why the whole call failed, "" if it did not

  // {"reward/mean": .., "reward/<name>/mean": .., "reward/<name>/failed": ..,
  //  "reward/<name>/fallback_fraction": ..} for this batch (the fraction: failed / N).
  nlohmann::json metrics() const;
};

class RewardSet {
 public:
  struct Entry {
    std::shared_ptr<RewardFunction> function{};
    double weight = 1.0;
    std::optional<double> fallback{};  // overrides RewardSetOptions::fallback for this function
    // overrides RewardSetOptions::max_consecutive_failures for this function
    std::optional<int> max_consecutive_failures{};
  };
  // Throws when there is no function, a weight or fallback is not finite, a failure limit is
  // negative, or two share a name.
  RewardSet(std::vector<Entry> entries, RewardSetOptions options = {});

  // Scores the batch with every function (one after the other). Throws tandem::Error naming the
  // function when one reaches its max_consecutive_failures, and lets a FatalRewardError through;
  // otherwise always returns N totals. Logs a warning for each function that gave fallbacks in
  // this call: how many, and the first error.
  RewardBreakdown score(std::span<const RewardSample> samples);

  const std::vector<RewardFunctionStats>& stats() const { return stats_; }
  // The counters of every function: {"<name>": {"calls": .., "failed_samples": .., ...}, ...}.
  nlohmann::json stats_json() const;
  size_t size() const { return entries_.size(); }

 private:
  struct InFlight;
  std::vector<Entry> entries_;
  RewardSetOptions options_;
  std::vector<RewardFunctionStats> stats_;
  std::vector<std::shared_ptr<InFlight>> abandoned_;  // (F) a call past its deadline, or null
};

}  // namespace tandem::rewards
