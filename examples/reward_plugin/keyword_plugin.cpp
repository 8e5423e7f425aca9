// An example tandem reward plugin (C ABI tandem_reward_v1): 1 when the completion contains the
// keyword given as the config string, else 0.
//
// Build it with CMake (this folder's CMakeLists.txt) or by hand:
//   g++ -std=c++20 -shared -fPIC -I<tandem> keyword_plugin.cpp -o libkeyword_reward.so
// and name it in a job config: [[rewards]] kind = "plugin", path = ".../libkeyword_reward.so",
// config = "answer".
#include <new>
#include <string>
#include <string_view>

#include "rewards/reward_plugin.h"

namespace {

struct State {
  std::string keyword;
  std::string error;
};

// The error of a failed init, when there is no state to keep it in.
thread_local std::string init_error;

}  // namespace

extern "C" {

uint32_t tandem_reward_abi_version(void) { return TANDEM_REWARD_ABI_VERSION; }

int tandem_reward_v1_init(const char* config, void** state) {
  *state = nullptr;
  if (config == nullptr || *config == '\0') {
    init_error = "the config string must be the keyword to look for; it is empty";
    return 1;
  }
  auto* s = new (std::nothrow) State;
  if (s == nullptr) {
    init_error = "out of memory";
    return 2;
  }
  try {
    s->keyword = config;
  } catch (...) {  // no exception may cross the C ABI
    delete s;
    init_error = "out of memory";
    return 2;
  }
  *state = s;
  return 0;
}

int tandem_reward_v1_score(void* state, const tandem_reward_sample_v1* samples, size_t n,
                           double* out_scores) {
  auto* s = static_cast<State*>(state);
  if (s == nullptr) return 3;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view completion(samples[i].completion, samples[i].completion_len);
    out_scores[i] = completion.find(s->keyword) != std::string_view::npos ? 1.0 : 0.0;
  }
  return 0;
}

const char* tandem_reward_v1_last_error(void* state) {
  if (state == nullptr) return init_error.c_str();
  return static_cast<State*>(state)->error.c_str();
}

void tandem_reward_v1_free(void* state) { delete static_cast<State*>(state); }

}  // extern "C"
