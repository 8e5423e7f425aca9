// Sample shaping before the update: DAPO's soft overlong penalty, masking of truncated samples,
// the dynamic-sampling filter that drops groups whose rewards carry no signal, and PODS's
// max-variance down-sampling of a group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

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

// PODS's max-variance down-sampling (Xu et al. 2025, "Not All Rollouts are Useful: Down-Sampling
// Rollouts in LLM Reinforcement Learning"): the m of a group's samples whose rewards have the
// largest variance, as indices into `group_rewards` in increasing order. The largest variance is
// reached by the i lowest and the m - i highest rewards for some i (the paper's lemma), so every
// i is tried; of equal variances the i nearest m / 2 (then the smaller) wins, and of equal
// rewards the earlier sample, so every rank chooses alike. m >= the group's size: all of them.
std::vector<size_t> max_variance_subset(std::span<const float> group_rewards, size_t m);

}  // namespace tandem::trainer
