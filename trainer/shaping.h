// Sample shaping before the update: DAPO's soft overlong penalty, masking of truncated samples,
// and the dynamic-sampling filter that drops groups whose rewards carry no signal.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tandem::trainer {

// DAPO's soft overlong punishment for a response of `length` tokens: 0 up to
// max_length - buffer, then falling linearly to -factor at max_length, and -factor beyond.
// buffer 0 gives the hard form (0 or -factor).
float overlong_penalty(int64_t length, int64_t max_length, int64_t buffer, float factor);

// Dynamic sampling (DAPO): the groups (of group_sizes, laid out in order over rewards) whose
// rewards are not all equal — the others have zero advantage and teach nothing. Returns the
// indices of the kept groups.
std::vector<int32_t> groups_with_signal(std::span<const float> rewards,
                                        std::span<const int32_t> group_sizes);

// Overlong filtering: per sample, whether it enters the loss. A truncated sample (finished by
// the length limit) is left out when mask_truncated is set, so an unfinished answer is never
// scored as if it were complete.
std::vector<bool> loss_mask(std::span<const bool> truncated, bool mask_truncated);

}  // namespace tandem::trainer
