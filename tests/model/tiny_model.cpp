// Tiny random decoders for tests.
#include "tests/model/tiny_model.h"

#include <cmath>
#include <string>

#include "tests/testutil.h"

namespace tandem::test {

const char* tiny_kind_name(TinyKind k) {
  switch (k) {
    case TinyKind::llama_tied:
      return "llama tied";
    case TinyKind::llama_untied_rope3:
      return "llama untied llama3-rope";
    case TinyKind::qwen2:
      return "qwen2 bias";
    case TinyKind::qwen3:
      return "qwen3 qk-norm";
  }
  return "?";
}

model::ModelConfig tiny_model_config(TinyKind kind) {
  model::ModelConfig c;
  c.vocab_size = 101;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5f;
  switch (kind) {
    case TinyKind::llama_tied:
      c.tie_word_embeddings = true;
      break;
    case TinyKind::llama_untied_rope3:
      c.rope.theta = 500000.0f;
      c.rope.factor = 8.0f;
      c.rope.low_freq_factor = 1.0f;
      c.rope.high_freq_factor = 4.0f;
      c.rope.original_max_position = 64;  // several bands of the 8 frequencies rescaled
      break;
    case TinyKind::qwen2:
      c.arch = model::Architecture::qwen2;
      c.attention_bias = true;
      c.rope.theta = 1000000.0f;
      c.tie_word_embeddings = true;
      break;
    case TinyKind::qwen3:
      c.arch = model::Architecture::qwen3;
      c.qk_norm = true;
      c.rope.theta = 1000000.0f;
      c.rms_norm_eps = 1e-6f;
      break;
  }
  return c;
}

model::ModelConfig micro_model_config(bool qwen3) {
  model::ModelConfig c;
  c.arch = qwen3 ? model::Architecture::qwen3 : model::Architecture::qwen2;
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.max_position_embeddings = 64;
  c.attention_bias = !qwen3;
  c.qk_norm = qwen3;
  c.tie_word_embeddings = !qwen3;
  return c;
}

void fill_random_weights(model::Weights& w, uint64_t seed) {
  for (const model::NamedTensor& s : w.storage()) {
    ++seed;
    double lo = -1.0, hi = 1.0;
    if (s.name.find("norm") != std::string::npos) {
      lo = 0.7, hi = 1.3;
    } else if (s.name.find("bias") != std::string::npos) {
      lo = -0.3, hi = 0.3;
    } else if (s.name.find("embed") == std::string::npos) {
      const double a = 1.7 / std::sqrt(static_cast<double>(s.tensor.size(1)));
      lo = -a, hi = a;
    }
    Tensor t = s.tensor;
    t.copy_from(random_tensor(s.tensor.shape(), s.tensor.dtype(), seed, lo, hi));
  }
}

}  // namespace tandem::test
