// load_model: a decoder's weights, config and tokenizer from whatever the user points at — a
// GGUF file, a Hugging Face model directory, or a .safetensors file with config.json beside it.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/chat_template.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace tandem::model {

struct LoadedModel {
  std::string path;
  std::string format;  // "gguf" or "hf"
  std::unique_ptr<Weights> weights;
  std::unique_ptr<Tokenizer> tokenizer;  // null when an HF directory has no tokenizer.json
  double load_seconds = 0;

  const ModelConfig& config() const { return weights->config(); }
  // The tokenizer; throws naming the path when the model came without one.
  const Tokenizer& tok() const;
  // The token ids that end a generation: the config's eos ids and the tokenizer's, sorted, once.
  std::vector<int32_t> stop_ids() const;
};

// Loads weights in dtype (f32, bf16 or f16) on the CPU. Errors name the path and what is wrong.
LoadedModel load_model(const std::string& path, DType dtype = DType::f32);

// The model's chat format and default system prompt, from its template string.
struct ChatStyle {
  ChatFormat format = ChatFormat::plain;
  std::string default_system;
};
ChatStyle chat_style(const TokenizerData& data);

// The token ids of a prompt: text as it is (chat = false) or as one user message rendered with
// the model's chat template and the assistant's generation prompt (chat = true); bos first when
// the tokenizer asks for it and the rendered text does not already start with it.
std::vector<int32_t> encode_prompt(const Tokenizer& tok, const std::string& text, bool chat);

}  // namespace tandem::model
