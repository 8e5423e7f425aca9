// A deliberately failing tandem reward plugin for the tests. The config string picks the failure:
// "init" (init returns 7), "score" (score returns 5 with a message), "nan" (scores are NaN),
// anything else scores 0.5. Built with -DFAILING_PLUGIN_ABI=N it reports ABI version N; built
// with -DFAILING_PLUGIN_NO_FREE it lacks tandem_reward_v1_free.
#include <cmath>
#include <string>

#include "rewards/reward_plugin.h"

#ifndef FAILING_PLUGIN_ABI
#define FAILING_PLUGIN_ABI TANDEM_REWARD_ABI_VERSION
#endif

namespace {
struct State {
  std::string mode;
  std::string error;
};
thread_local std::string init_error;
}  // namespace

extern "C" {

uint32_t tandem_reward_abi_version(void) { return FAILING_PLUGIN_ABI; }

int tandem_reward_v1_init(const char* config, void** state) {
  *state = nullptr;
  if (std::string(config) == "init") {
    init_error = "failing on purpose in init";
    return 7;
  }
  *state = new State{config, ""};
  return 0;
}

int tandem_reward_v1_score(void* state, const tandem_reward_sample_v1*, size_t n,
                           double* out_scores) {
  auto* s = static_cast<State*>(state);
  if (s->mode == "score") {
    s->error = "failing on purpose in score";
    return 5;
  }
  for (size_t i = 0; i < n; ++i) out_scores[i] = s->mode == "nan" ? std::nan("") : 0.5;
  return 0;
}

const char* tandem_reward_v1_last_error(void* state) {
  return state == nullptr ? init_error.c_str() : static_cast<State*>(state)->error.c_str();
}

#ifndef FAILING_PLUGIN_NO_FREE
void tandem_reward_v1_free(void* state) { delete static_cast<State*>(state); }
#endif

}  // extern "C"
