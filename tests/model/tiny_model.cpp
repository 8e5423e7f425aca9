// Tiny random decoders for tests.
#include "tests/model/tiny_model.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "model/hf.h"

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

std::vector<std::vector<int32_t>> random_sequences(const std::vector<int>& lengths, int64_t V,
                                                   uint64_t seed) {
  std::vector<std::vector<int32_t>> out;
  for (int n : lengths) {
    const Tensor ids = random_ints({n}, DType::i32, seed++, 0, V);
    const int32_t* p = ids.data_as<int32_t>();
    out.emplace_back(p, p + n);
  }
  return out;
}

void fill_uniform(model::Weights& w, uint64_t seed) {
  for (const model::NamedTensor& s : w.storage()) {
    Tensor t = s.tensor;
    t.copy_from(random_tensor(t.shape(), t.dtype(), ++seed, -1.0, 1.0));
  }
}

void fill_random_weights(model::Weights& w, uint64_t seed) {
  for (const model::NamedTensor& s : w.storage()) {
    ++seed;
    const model::InitRange r =
        model::init_range(s.name, s.tensor.ndim() > 1 ? s.tensor.size(1) : 1);
    Tensor t = s.tensor;
    t.copy_from(random_tensor(s.tensor.shape(), s.tensor.dtype(), seed, r.lo, r.hi));
  }
}

int64_t write_tiny_smollm2_hf(const std::string& dir, uint64_t seed, int64_t layers, bool tied) {
  model::ModelConfig c = tiny_model_config(TinyKind::llama_tied);
  c.vocab_size = 49152;
  c.num_layers = layers;
  c.tie_word_embeddings = tied;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  model::Weights w(c, DType::f32);
  fill_random_weights(w, seed);
  model::SaveOptions o;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    std::ifstream in(std::filesystem::path(TANDEM_SOURCE_DIR) / "tests/golden/smollm2" / f,
                     std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    o.extra_files[f] = ss.str();
  }
  model::save_hf(w, dir, o);
  int64_t bf16_bytes = 0;
  for (const auto& t : w.storage()) bf16_bytes += t.tensor.numel() * 2;
  return bf16_bytes;
}

}  // namespace tandem::test
