// Building reward functions from a kind, a name and JSON options, as a config layer holds them.
#pragma once

#include <memory>

#include "rewards/reward.h"
#include "rewards/reward_set.h"

namespace tandem::rewards {

// kind: "math_answer", "exact_match", "regex_format", "length_penalty" (options as the fields of
// the built-in's Options, see docs/rewards.md), "plugin" (options {"path": "...so", "config":
// "string passed to init"}) or "remote" (options as the fields of RemoteReward::Options). Throws
// tandem::Error naming the reward and the kind or option for an unknown kind, an unknown option, an
// option of the wrong type or a missing required one.
std::unique_ptr<RewardFunction> make_reward(const std::string& kind, const std::string& name,
                                            const nlohmann::json& options);

// A RewardSet from a list of entries as a config layer holds them:
//   [{"kind": "math_answer", "name": "math", "weight": 1.0, "fallback": 0.0, "options": {..}}, ..]
// "name" defaults to the kind, "weight" to 1, "fallback" to options.fallback, "options" to {}.
// Errors name the entry by its index and name.
RewardSet make_reward_set(const nlohmann::json& entries, const RewardSetOptions& options = {});

// The kinds make_reward knows.
std::vector<std::string> reward_kinds();

}  // namespace tandem::rewards
