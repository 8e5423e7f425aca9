// Random GRPO training samples for the train-step tests: G completions of each of a few random
// prompts, of different lengths, with rollout logprobs and advantages of either sign.
#pragma once

#include <cstdint>
#include <vector>

#include "tests/testutil.h"
#include "trainer/train_step.h"

namespace tandem::test {

// G samples of each of `groups` random prompts of 5 tokens: random completions of 2..7 tokens,
// rollout logprobs near rollout_logp, advantages of either sign; sample i of group g has group g.
inline std::vector<trainer::TrainSample> random_train_batch(int groups, int G, int64_t V,
                                                            uint64_t seed,
                                                            float rollout_logp = -2.0f) {
  std::vector<trainer::TrainSample> out;
  for (int g = 0; g < groups; ++g) {
    const Tensor p = random_ints({5}, DType::i32, seed + 100 * g, 0, V);
    std::vector<int32_t> prompt(p.data_as<int32_t>(), p.data_as<int32_t>() + 5);
    for (int i = 0; i < G; ++i) {
      const int n = 2 + (g * 3 + i) % 6;
      const Tensor c = random_ints({n}, DType::i32, seed + 100 * g + i + 1, 0, V);
      trainer::TrainSample s;
      s.prompt = prompt;
      s.completion.assign(c.data_as<int32_t>(), c.data_as<int32_t>() + n);
      s.rollout_logp.assign(static_cast<size_t>(n), rollout_logp - 0.01f * static_cast<float>(i));
      s.advantage = static_cast<float>((i % 3) - 1) * 0.7f + 0.1f * static_cast<float>(g);
      s.group = g;
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace tandem::test
