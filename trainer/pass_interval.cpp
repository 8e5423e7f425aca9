// Held-out pass@1 with its 95% interval (trainer/pass_interval.h).
#include "trainer/pass_interval.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tandem::trainer {

void wilson_interval(double successes, double trials, double& low, double& high) {
  TANDEM_CHECK(trials >= 0 && successes >= 0 && successes <= trials,
               "wilson_interval: {} successes out of {} trials", successes, trials);
  if (trials == 0) {
    low = 0, high = 1;
    return;
  }
  constexpr double z = 1.959963984540054;  // the 97.5% quantile of the standard normal
  const double n = trials, p = successes / trials, z2 = z * z;
  const double center = (p + z2 / (2 * n)) / (1 + z2 / n);
  const double half = z / (1 + z2 / n) * std::sqrt(p * (1 - p) / n + z2 / (4 * n * n));
  low = std::max(0.0, center - half);
  high = std::min(1.0, center + half);
}

PassInterval pass_at_1(std::span<const double> correct_fraction_per_prompt) {
  PassInterval r;
  r.prompts = static_cast<int64_t>(correct_fraction_per_prompt.size());
  double sum = 0;
  for (double f : correct_fraction_per_prompt) {
    TANDEM_CHECK(f >= 0 && f <= 1, "pass_at_1: a prompt's fraction correct is {}, not in [0, 1]",
                 f);
    sum += f;
  }
  r.pass1 = r.prompts > 0 ? sum / static_cast<double>(r.prompts) : 0;
  wilson_interval(sum, static_cast<double>(r.prompts), r.low, r.high);
  return r;
}

}  // namespace tandem::trainer
