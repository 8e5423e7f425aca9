// Generator: the simple one-sequence generation loop behind `tandem generate` and
// `tandem bench generate` — prefill the prompt into a KV cache of consecutive blocks, then
// decode and sample one token at a time. The rollout engine (rollout/) replaces it for batches;
// both run the same Decoder and the same sampling op.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "model/decoder.h"

namespace tandem::model {

struct GenerateOptions {
  int64_t max_tokens = 128;
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;  // generation ends after one of these (it is kept)
};

struct GenerateResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;  // of each token under the temperature-scaled distribution
  bool stopped = false;         // ended on a stop id (else on max_tokens)
  double prefill_seconds = 0;
  double decode_seconds = 0;  // the decode steps after the first token
  double decode_tokens_per_second() const;
};

class Generator {
 public:
  // A KV cache for up to max_context tokens (prompt + generated), f32, in blocks of 16.
  Generator(const Weights& weights, int64_t max_context);
  ~Generator();

  // on_token, when given, sees each token as it is sampled (for streaming output).
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                          const std::function<void(int32_t)>& on_token = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::model
