// Loading and calling a tandem_reward_v1 plugin.
#include "rewards/plugin.h"

#include <dlfcn.h>

#include "core/error.h"
#include "rewards/plugin_process.h"
#include "rewards/reward_plugin.h"

namespace tandem::rewards {

struct PluginReward::Api {
  decltype(&tandem_reward_abi_version) abi_version = nullptr;
  decltype(&tandem_reward_v1_init) init = nullptr;
  decltype(&tandem_reward_v1_score) score = nullptr;
  decltype(&tandem_reward_v1_last_error) last_error = nullptr;
  decltype(&tandem_reward_v1_free) free = nullptr;
};

namespace {

std::string last_error_of(const auto& api, void* state) {
  const char* text = api.last_error(state);
  return text != nullptr && *text != '\0' ? std::string(text) : std::string("(no message)");
}

}  // namespace

PluginReward::PluginReward(std::string name, const std::string& path, const std::string& config,
                           Options options)
    : name_(std::move(name)), path_(path), api_(std::make_unique<Api>()) {
  if (options.isolate) {
    process_ = std::make_unique<PluginProcess>(name_, path_, config);
    return;
  }
  dlerror();
  handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) {
    const char* why = dlerror();
    TANDEM_FAIL("reward '{}': cannot load plugin '{}': {}", name_, path,
                why != nullptr ? why : "unknown dlopen error");
  }
  // From here on a failure must close the library again.
  try {
    const auto resolve = [&](auto& fn, const char* symbol) {
      dlerror();
      void* address = dlsym(handle_, symbol);
      const char* why = dlerror();
      TANDEM_CHECK(why == nullptr && address != nullptr,
                   "reward '{}': plugin '{}' does not export '{}' (the tandem_reward_v1 ABI of "
                   "rewards/reward_plugin.h): {}",
                   name_, path, symbol, why != nullptr ? why : "null symbol");
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(address);
    };
    resolve(api_->abi_version, "tandem_reward_abi_version");
    const uint32_t version = api_->abi_version();
    TANDEM_CHECK(version == TANDEM_REWARD_ABI_VERSION,
                 "reward '{}': plugin '{}' has reward ABI version {}, expected {}: rebuild it "
                 "against this tandem's rewards/reward_plugin.h",
                 name_, path, version, TANDEM_REWARD_ABI_VERSION);
    resolve(api_->init, "tandem_reward_v1_init");
    resolve(api_->score, "tandem_reward_v1_score");
    resolve(api_->last_error, "tandem_reward_v1_last_error");
    resolve(api_->free, "tandem_reward_v1_free");
    void* state = nullptr;
    const int rc = api_->init(config.c_str(), &state);
    if (rc != 0) {
      const std::string why = last_error_of(*api_, state);
      if (state != nullptr) api_->free(state);
      TANDEM_FAIL("reward '{}': plugin '{}' init with config '{}' returned {}: {}", name_, path,
                  config, rc, why);
    }
    state_ = state;
  } catch (...) {
    dlclose(handle_);
    handle_ = nullptr;
    throw;
  }
}

PluginReward::~PluginReward() {
  if (state_ != nullptr) api_->free(state_);
  if (handle_ != nullptr) dlclose(handle_);
}

int64_t PluginReward::crashes() const { return process_ ? process_->crashes() : 0; }

std::vector<RewardResult> PluginReward::score(std::span<const RewardSample> samples) {
  if (process_) return process_->score(samples);
  std::vector<std::string> extras(samples.size());
  std::vector<tandem_reward_sample_v1> c_samples(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const RewardSample& s = samples[i];
    extras[i] = s.extra.is_null() ? std::string("{}") : s.extra.dump();
    c_samples[i] = {.prompt = s.prompt.data(),
                    .prompt_len = s.prompt.size(),
                    .completion = s.completion.data(),
                    .completion_len = s.completion.size(),
                    .answer = s.answer.data(),
                    .answer_len = s.answer.size(),
                    .extra_json = extras[i].data(),
                    .extra_json_len = extras[i].size(),
                    .completion_tokens = s.completion_tokens,
                    .truncated = s.truncated ? 1 : 0};
  }
  std::vector<double> scores(samples.size(), 0.0);
  const int rc = api_->score(state_, c_samples.data(), c_samples.size(), scores.data());
  std::vector<RewardResult> out;
  out.reserve(samples.size());
  if (rc != 0) {
    const std::string why =
        fmt::format("plugin '{}' score returned {}: {}", path_, rc, last_error_of(*api_, state_));
    for (size_t i = 0; i < samples.size(); ++i) out.push_back(RewardResult::failure(why));
    return out;
  }
  for (double v : scores) out.push_back(RewardResult::success(v));
  return out;
}

}  // namespace tandem::rewards
