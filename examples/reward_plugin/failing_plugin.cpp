// A deliberately failing tandem reward plugin for the tests. The config string picks the failure:
// "init" (init returns 7), "score" (score returns 5 with a message), "nan" (scores are NaN),
// "segv" (a segmentation fault when a completion is "segv"), "hang" (sleeps 60 s when a
// completion is "hang"), "fields" (a sum over every field of the sample, to check they arrive),
// anything else scores 0.5. Built with -DFAILING_PLUGIN_ABI=N it reports ABI version N; built
// with -DFAILING_PLUGIN_NO_FREE it lacks tandem_reward_v1_free.
#include <chrono>
#include <cmath>
#include <csignal>
#include <string>
#include <thread>

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

int tandem_reward_v1_score(void* state, const tandem_reward_sample_v1* samples, size_t n,
                           double* out_scores) {
  auto* s = static_cast<State*>(state);
  if (s->mode == "score") {
    s->error = "failing on purpose in score";
    return 5;
  }
  for (size_t i = 0; i < n; ++i) {
    const std::string completion(samples[i].completion, samples[i].completion_len);
    if (s->mode == "segv" && completion == "segv") std::raise(SIGSEGV);
    if (s->mode == "hang" && completion == "hang")
      std::this_thread::sleep_for(std::chrono::seconds(60));
    const tandem_reward_sample_v1& x = samples[i];
    out_scores[i] = s->mode == "nan" ? std::nan("")
                    : s->mode == "fields"
                        ? static_cast<double>(x.prompt_len + 2 * x.completion_len +
                                              3 * x.answer_len + 5 * x.extra_json_len) +
                              7.0 * static_cast<double>(x.completion_tokens) + 11.0 * x.truncated
                        : 0.5;
  }
  return 0;
}

const char* tandem_reward_v1_last_error(void* state) {
  return state == nullptr ? init_error.c_str() : static_cast<State*>(state)->error.c_str();
}

#ifndef FAILING_PLUGIN_NO_FREE
void tandem_reward_v1_free(void* state) { delete static_cast<State*>(state); }
#endif

}  // extern "C"
