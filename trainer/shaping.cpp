// Sample shaping.
#include "trainer/shaping.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace tandem::trainer {

float overlong_penalty(int64_t length, int64_t max_length, int64_t buffer, float factor) {
  TANDEM_CHECK(max_length > 0 && buffer >= 0 && buffer <= max_length && factor >= 0,
               "overlong penalty: need 0 <= buffer ({}) <= max_length ({}) and factor ({}) >= 0",
               buffer, max_length, factor);
  const int64_t free = max_length - buffer;
  if (length <= free) return 0.0f;
  if (length > max_length || buffer == 0) return -factor;
  return static_cast<float>(static_cast<double>(free - length) / static_cast<double>(buffer) *
                            factor);
}

bool has_signal(std::span<const float> group_rewards) {
  for (float r : group_rewards)
    if (r != group_rewards[0]) return true;
  return false;
}

bool enters_loss(bool truncated, bool mask_truncated) { return !(mask_truncated && truncated); }

std::vector<size_t> max_variance_subset(std::span<const float> group_rewards, size_t m) {
  const size_t n = group_rewards.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  if (m >= n) return order;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return group_rewards[a] < group_rewards[b]; });
  // Prefix sums of the sorted rewards and their squares: the variance of the i lowest and the
  // m - i highest in O(1) each.
  std::vector<double> sum(n + 1, 0), sq(n + 1, 0);
  for (size_t k = 0; k < n; ++k) {
    const double r = group_rewards[order[k]];
    sum[k + 1] = sum[k] + r;
    sq[k + 1] = sq[k] + r * r;
  }
  size_t best = 0;
  double best_var = -1, best_off = 0;
  for (size_t i = 0; i <= m; ++i) {
    const double s = sum[i] + (sum[n] - sum[n - (m - i)]);
    const double q = sq[i] + (sq[n] - sq[n - (m - i)]);
    const double mean = s / static_cast<double>(m);
    const double var = q / static_cast<double>(m) - mean * mean;
    const double off = std::abs(static_cast<double>(i) - static_cast<double>(m) / 2);
    // Variances equal but for rounding count as equal.
    const double tol = 1e-9 * std::max(1.0, std::abs(best_var));
    if (var > best_var + tol || (std::abs(var - best_var) <= tol && off < best_off)) {
      best = i;
      best_var = var;
      best_off = off;
    }
  }
  std::vector<size_t> chosen(order.begin(), order.begin() + static_cast<ptrdiff_t>(best));
  chosen.insert(chosen.end(), order.end() - static_cast<ptrdiff_t>(m - best), order.end());
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

}  // namespace tandem::trainer
