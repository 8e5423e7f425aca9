// Sample shaping before the update: DAPO's soft overlong penalty, masking of truncated samples,
// and the dynamic-sampling filter that drops groups whose rewards carry no signal.
#pragma once

#include <cstdint>
#include <span>

namespace tandem::trainer {

// DAPO's soft overlong punishment for a response of `length` tokens: 0 up to
// max_length - buffer, then falling linearly to -factor at max_length, and -factor beyond.
// buffer 0 gives the hard form (0 or -factor).
float overlong_penalty(int64_t length, int64_t max_length, int64_t buffer, float factor);

// Dynamic sampling (DAPO): whether a group's rewards are not all equal. A group whose rewards are
// all equal (a group of one included) has zero advantage and teaches nothing.
bool has_signal(std::span<const float> group_rewards);

// Overlong filtering: whether a sample enters the loss. A truncated sample (finished by the
// length limit) is left out when mask_truncated is set, so an unfinished answer is never scored
// as if it were complete.
bool enters_loss(bool truncated, bool mask_truncated);

}  // namespace tandem::trainer
