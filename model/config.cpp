// ModelConfig checks and names.
#include "model/config.h"

#include "core/error.h"

namespace tandem::model {

const char* architecture_name(Architecture a) {
  switch (a) {
    case Architecture::llama:
      return "llama";
    case Architecture::qwen2:
      return "qwen2";
    case Architecture::qwen3:
      return "qwen3";
  }
  return "?";
}

void ModelConfig::validate() const {
  TANDEM_CHECK(vocab_size > 0, "model config: vocab_size must be positive, got {}", vocab_size);
  TANDEM_CHECK(hidden_size > 0, "model config: hidden_size must be positive, got {}", hidden_size);
  TANDEM_CHECK(intermediate_size > 0, "model config: intermediate_size must be positive, got {}",
               intermediate_size);
  TANDEM_CHECK(num_layers > 0, "model config: num_hidden_layers must be positive, got {}",
               num_layers);
  TANDEM_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
               "model config: num_attention_heads {} must be a positive multiple of "
               "num_key_value_heads {}",
               num_heads, num_kv_heads);
  TANDEM_CHECK(head_dim > 0 && head_dim % 2 == 0, "model config: head_dim must be even, got {}",
               head_dim);
  TANDEM_CHECK(rms_norm_eps > 0, "model config: rms_norm_eps must be positive, got {}",
               rms_norm_eps);
  TANDEM_CHECK(rope.theta > 0, "model config: rope_theta must be positive, got {}", rope.theta);
}

std::string hf_layer_prefix(int64_t layer) { return fmt::format("model.layers.{}.", layer); }

}  // namespace tandem::model
