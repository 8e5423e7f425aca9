// Sample shaping.
#include "trainer/shaping.h"

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

std::vector<int32_t> groups_with_signal(std::span<const float> rewards,
                                        std::span<const int32_t> group_sizes) {
  std::vector<int32_t> kept;
  size_t at = 0;
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    TANDEM_CHECK(group_sizes[g] >= 1, "dynamic sampling: group {} has size {}", g, group_sizes[g]);
    const size_t n = static_cast<size_t>(group_sizes[g]);
    TANDEM_CHECK(at + n <= rewards.size(),
                 "dynamic sampling: groups cover {} samples but there are {} rewards", at + n,
                 rewards.size());
    bool varies = false;
    for (size_t i = at + 1; i < at + n; ++i) varies = varies || rewards[i] != rewards[at];
    if (varies) kept.push_back(static_cast<int32_t>(g));
    at += n;
  }
  TANDEM_CHECK(at == rewards.size(),
               "dynamic sampling: groups cover {} samples but there are {} rewards", at,
               rewards.size());
  return kept;
}

std::vector<bool> loss_mask(std::span<const bool> truncated, bool mask_truncated) {
  std::vector<bool> keep(truncated.size(), true);
  if (mask_truncated)
    for (size_t i = 0; i < truncated.size(); ++i) keep[i] = !truncated[i];
  return keep;
}

}  // namespace tandem::trainer
