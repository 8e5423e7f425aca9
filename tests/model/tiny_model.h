// Tiny random decoders for tests: the four families' configs (C=64, 2 layers, V=101) and seeded
// weights that keep activations O(1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace tandem::test {

enum class TinyKind { llama_tied, llama_untied_rope3, qwen2, qwen3 };
const char* tiny_kind_name(TinyKind k);
model::ModelConfig tiny_model_config(TinyKind kind);
// Smaller still (C=16, V=37, F=24, H=2, Hkv=1, D=8): Qwen3 (q/k norms, untied) or Qwen2
// (biases, tied), for optimizer and checkpoint tests.
model::ModelConfig micro_model_config(bool qwen3);
// Norm weights near 1, biases small, matrices scaled by 1.7/sqrt(fan-in), embeddings in [-1, 1).
void fill_random_weights(model::Weights& w, uint64_t seed);
// Random token sequences of these lengths, ids in [0, V), sequence i from seed + i.
std::vector<std::vector<int32_t>> random_sequences(const std::vector<int>& lengths, int64_t V,
                                                   uint64_t seed);
// Every storage tensor uniform in [-1, 1), tensor i from seed + 1 + i: values for optimizer and
// checkpoint tests, where no forward needs them well scaled.
void fill_uniform(model::Weights& w, uint64_t seed);
// A tiny random Llama (C=64, 2 layers, tied embeddings, weights of `seed`) with SmolLM2's
// tokenizer and chat template (its vocabulary), as a Hugging Face directory `dir` that `tandem
// train` loads; returns the bytes its parameters take in bf16. `layers` and `tied` change those.
int64_t write_tiny_smollm2_hf(const std::string& dir, uint64_t seed = 17, int64_t layers = 2,
                              bool tied = true);

}  // namespace tandem::test
