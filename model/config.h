// ModelConfig: the shape and conventions of a decoder (Llama, Qwen2, Qwen3 families), read from an
// HF config.json or GGUF metadata.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace tandem::model {

enum class Architecture : uint8_t { llama, qwen2, qwen3 };
const char* architecture_name(Architecture a);

struct ModelConfig {
  Architecture arch = Architecture::llama;
  int64_t vocab_size = 0;         // V
  int64_t hidden_size = 0;        // C
  int64_t intermediate_size = 0;  // F
  int64_t num_layers = 0;         // L
  int64_t num_heads = 0;          // H
  int64_t num_kv_heads = 0;       // Hkv
  int64_t head_dim = 0;           // D (hidden_size / num_heads unless the config says otherwise)
  int64_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-5f;
  ops::RopeParams rope;  // theta and Llama-3 scaling
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections have biases (Qwen2)
  bool qk_norm = false;         // RMSNorm on q and k per head (Qwen3)
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;

  // Throws tandem::Error naming the field when the numbers do not describe a valid decoder.
  void validate() const;
};

// Hugging Face parameter names, the names every loader and saver uses.
std::string hf_layer_prefix(int64_t layer);  // "model.layers.<layer>."

}  // namespace tandem::model
