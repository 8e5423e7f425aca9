// make_reward: the built-ins and plugins by kind, with their options checked.
#include "rewards/factory.h"

#include <set>

#include "core/error.h"
#include "rewards/builtins.h"
#include "rewards/plugin.h"
#include "rewards/remote.h"

namespace tandem::rewards {
namespace {

// Reads options of one reward, checking names and types; unknown keys are an error.
class OptionReader {
 public:
  OptionReader(const std::string& name, const std::string& kind, const nlohmann::json& options)
      : name_(name), kind_(kind), options_(options) {
    TANDEM_CHECK(options_.is_null() || options_.is_object(),
                 "reward '{}' ({}): options must be an object, got {}", name_, kind_,
                 options_.type_name());
  }

  template <typename T>
  void read(const char* key, T& value, bool required = false) {
    known_.insert(key);
    if (options_.is_null() || !options_.contains(key)) {
      TANDEM_CHECK(!required, "reward '{}' ({}): option '{}' is required", name_, kind_, key);
      return;
    }
    const nlohmann::json& v = options_.at(key);
    bool type_ok = false;
    const char* expected = "";
    if constexpr (std::is_same_v<T, bool>) {
      type_ok = v.is_boolean();
      expected = "a boolean";
    } else if constexpr (std::is_integral_v<T>) {
      type_ok = v.is_number_integer();
      expected = "an integer";
    } else if constexpr (std::is_floating_point_v<T>) {
      type_ok = v.is_number();
      expected = "a number";
    } else {
      type_ok = v.is_string();
      expected = "a string";
    }
    TANDEM_CHECK(type_ok, "reward '{}' ({}): option '{}' must be {}, got {} ({})", name_, kind_,
                 key, expected, v.type_name(), v.dump());
    value = v.get<T>();
  }

  void finish() const {
    if (options_.is_null()) return;
    for (const auto& [key, value] : options_.items()) {
      if (known_.contains(key)) continue;
      std::string list;
      for (const auto& k : known_) list += (list.empty() ? "" : ", ") + k;
      TANDEM_FAIL("reward '{}' ({}): unknown option '{}' (known: {})", name_, kind_, key, list);
    }
  }

 private:
  const std::string& name_;
  const std::string& kind_;
  const nlohmann::json& options_;
  std::set<std::string> known_;
};

}  // namespace

std::vector<std::string> reward_kinds() {
  return {"math_answer", "exact_match", "regex_format", "length_penalty", "plugin", "remote"};
}

std::unique_ptr<RewardFunction> make_reward(const std::string& kind, const std::string& name,
                                            const nlohmann::json& options) {
  TANDEM_CHECK(!name.empty(), "a reward of kind '{}' has an empty name", kind);
  OptionReader r(name, kind, options);
  if (kind == "math_answer") {
    MathAnswerReward::Options o;
    r.read("last_number_fallback", o.last_number_fallback);
    r.read("allow_percent", o.allow_percent);
    r.read("correct", o.correct);
    r.read("wrong", o.wrong);
    r.finish();
    return std::make_unique<MathAnswerReward>(name, o);
  }
  if (kind == "exact_match") {
    ExactMatchReward::Options o;
    r.read("case_insensitive", o.case_insensitive);
    r.read("match", o.match);
    r.read("mismatch", o.mismatch);
    r.finish();
    return std::make_unique<ExactMatchReward>(name, o);
  }
  if (kind == "regex_format") {
    RegexFormatReward::Options o;
    r.read("pattern", o.pattern, /*required=*/true);
    r.read("full_match", o.full_match);
    r.read("dotall", o.dotall);
    r.read("multiline", o.multiline);
    r.read("case_insensitive", o.case_insensitive);
    r.read("match", o.match);
    r.read("mismatch", o.mismatch);
    r.finish();
    return std::make_unique<RegexFormatReward>(name, o);
  }
  if (kind == "length_penalty") {
    LengthPenaltyReward::Options o;
    r.read("target_tokens", o.target_tokens, /*required=*/true);
    r.read("per_token", o.per_token);
    r.read("max_penalty", o.max_penalty);
    r.read("truncated_penalty", o.truncated_penalty);
    r.finish();
    return std::make_unique<LengthPenaltyReward>(name, o);
  }
  if (kind == "plugin") {
    std::string path;
    std::string config;
    PluginReward::Options o;
    r.read("path", path, /*required=*/true);
    r.read("config", config);
    r.read("isolate", o.isolate);
    r.finish();
    return std::make_unique<PluginReward>(name, path, config, o);
  }
  if (kind == "remote") {
    RemoteReward::Options o;
    r.read("address", o.address, /*required=*/true);
    r.read("timeout_ms", o.timeout_ms);
    r.read("connect_timeout_ms", o.connect_timeout_ms);
    r.read("retries", o.retries);
    r.read("backoff_ms", o.backoff_ms);
    r.read("max_concurrency", o.max_concurrency);
    r.read("batch_size", o.batch_size);
    r.read("token", o.token);
    r.read("check_on_start", o.check_on_start);
    r.finish();
    return std::make_unique<RemoteReward>(name, o);
  }
  std::string list;
  for (const auto& k : reward_kinds()) list += (list.empty() ? "" : ", ") + k;
  TANDEM_FAIL("reward '{}': unknown kind '{}' (known: {})", name, kind, list);
}

RewardSet make_reward_set(const nlohmann::json& entries, const RewardSetOptions& options) {
  TANDEM_CHECK(entries.is_array() && !entries.empty(),
               "rewards: expected a non-empty list of reward functions, got {}", entries.dump());
  std::vector<RewardSet::Entry> set;
  for (size_t i = 0; i < entries.size(); ++i) {
    const nlohmann::json& e = entries[i];
    TANDEM_CHECK(e.is_object(), "rewards[{}]: expected an object, got {}", i, e.dump());
    TANDEM_CHECK(e.contains("kind") && e["kind"].is_string(),
                 "rewards[{}]: 'kind' must be a string (one of the reward kinds), got {}", i,
                 e.contains("kind") ? e["kind"].dump() : std::string("nothing"));
    const std::string kind = e["kind"].get<std::string>();
    std::string name = kind;
    RewardSet::Entry entry;
    nlohmann::json fn_options = nlohmann::json::object();
    for (const auto& [key, value] : e.items()) {
      if (key == "kind") continue;
      const bool type_ok = key == "name"                          ? value.is_string()
                           : key == "options"                     ? value.is_object()
                           : key == "weight" || key == "fallback" ? value.is_number()
                           : key == "max_consecutive_failures"    ? value.is_number_integer()
                                                                  : true;
      TANDEM_CHECK(key == "name" || key == "options" || key == "weight" || key == "fallback" ||
                       key == "max_consecutive_failures",
                   "rewards[{}] ({}): unknown key '{}' (known: kind, name, weight, fallback, "
                   "max_consecutive_failures, options)",
                   i, kind, key);
      TANDEM_CHECK(type_ok, "rewards[{}] ({}): '{}' has the wrong type: {}", i, kind, key,
                   value.dump());
      if (key == "name") name = value.get<std::string>();
      if (key == "options") fn_options = value;
      if (key == "weight") entry.weight = value.get<double>();
      if (key == "fallback") entry.fallback = value.get<double>();
      if (key == "max_consecutive_failures") entry.max_consecutive_failures = value.get<int>();
    }
    entry.function = make_reward(kind, name, fn_options);
    set.push_back(std::move(entry));
  }
  return RewardSet(std::move(set), options);
}

}  // namespace tandem::rewards
