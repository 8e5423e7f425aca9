// Held-out pass@1 with its 95% interval: a Wilson score interval over the evaluated prompts.
#pragma once

#include <cstdint>
#include <span>

namespace tandem::trainer {

struct PassInterval {
  double pass1 = 0;          // mean over prompts of the fraction of a prompt's samples correct
  double low = 0, high = 0;  // the 95% interval around pass1
  int64_t prompts = 0;
};

// Wilson score interval (z = 1.96) of `successes` out of `trials`, with successes in [0, trials]
// (not necessarily whole). Returns {0, 1} when trials is 0.
void wilson_interval(double successes, double trials, double& low, double& high);

// pass@1 and its interval from each prompt's fraction of correct samples (values in [0, 1]).
// The prompts are the independent draws, so the interval is Wilson's with n = the number of
// prompts: exact in form with one sample per prompt (greedy eval), and conservative with k
// samples per prompt, since a prompt's mean in [0, 1] varies at most as one Bernoulli trial
// does (p(1 - p)) and the k samples of one prompt are not independent of each other.
PassInterval pass_at_1(std::span<const double> correct_fraction_per_prompt);

}  // namespace tandem::trainer
