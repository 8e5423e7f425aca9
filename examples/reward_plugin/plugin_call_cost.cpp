// What isolating a reward plugin costs per call: the same plugin scored in this process and in a
// child process (rewards/plugin_process.h), batch after batch, as JSON lines in the bench format.
//
//   build/bin/tandem_plugin_call_cost build/lib/libkeyword_reward.so answer
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "rewards/plugin.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PLUGIN.so [CONFIG]\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1], config = argc > 2 ? argv[2] : "";
  using tandem::rewards::PluginReward;
  try {
    PluginReward local("local", path, config, {.isolate = false});
    PluginReward isolated("isolated", path, config, {.isolate = true});
    for (size_t batch : {1, 64, 1024}) {
      std::vector<tandem::rewards::RewardSample> samples(batch);
      for (size_t i = 0; i < batch; ++i) {
        samples[i].prompt = std::string(400, 'p');
        samples[i].completion = fmt::format("{} so the answer is {}", std::string(600, 'c'), i);
        samples[i].answer = std::to_string(i);
        samples[i].completion_tokens = 150;
      }
      auto us_per_call = [&](PluginReward& r) {
        const int calls = batch >= 1024 ? 50 : 500;
        for (int i = 0; i < 5; ++i) r.score(samples);  // warm up
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) r.score(samples);
        return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                   .count() /
               calls;
      };
      const double in_process = us_per_call(local), in_child = us_per_call(isolated);
      std::printf(
          "{\"bench\": \"service\", \"case\": \"plugin %zu samples of ~1 KB\", \"metric\": "
          "\"us_per_call\", \"unit\": \"us\", \"value\": %.1f, \"peer\": \"in-process\", "
          "\"peer_value\": %.1f, \"ratio\": %.3f}\n",
          batch, in_child, in_process, in_process / in_child);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem_plugin_call_cost: %s\n", e.what());
    return 1;
  }
  return 0;
}
