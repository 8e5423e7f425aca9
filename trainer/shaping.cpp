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

bool has_signal(std::span<const float> group_rewards) {
  for (float r : group_rewards)
    if (r != group_rewards[0]) return true;
  return false;
}

bool enters_loss(bool truncated, bool mask_truncated) { return !(mask_truncated && truncated); }

}  // namespace tandem::trainer
