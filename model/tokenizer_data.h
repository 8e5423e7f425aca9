// TokenizerData: what a byte-level BPE tokenizer is made of, whatever file it came from
// (HF tokenizer.json or the tokenizer.ggml.* metadata of a GGUF file).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tandem::model {

// GGUF's tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

struct TokenizerData {
  std::string model = "gpt2";  // only byte-level BPE ("gpt2") is supported
  // The pre-tokenizer, by llama.cpp's names for them: "gpt2", "llama-bpe" (Llama 3), "qwen2",
  // "smollm" (GPT-2 regex after splitting digits one by one), ... .
  std::string pre = "gpt2";
  std::vector<std::string> tokens;  // id -> token string (byte-level unicode form)
  // id -> type; empty means all normal. control tokens are HF's special added tokens,
  // user_defined its non-special added tokens: both are split out of the text before the
  // pre-tokenizer runs and decode to their text as it is (no byte-level mapping).
  std::vector<TokenType> token_types;
  std::vector<std::pair<std::string, std::string>> merges;  // by rank
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t pad_id = -1;
  int32_t unk_id = -1;
  bool add_bos = false;       // prepend bos when encoding a prompt
  std::string chat_template;  // Jinja source, empty when none
  // HF BPE's ignore_merges (Llama 3): a pre-token that is itself in the vocabulary is one token.
  bool ignore_merges = false;
  int64_t model_max_length = 0;  // tokenizer_config.json's model_max_length; 0 when unknown
};

}  // namespace tandem::model
