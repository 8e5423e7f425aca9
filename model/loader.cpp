// load_model: dispatch on what the path is; chat prompts.
#include "model/loader.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "core/error.h"
#include "model/gguf.h"
#include "model/hf.h"

namespace tandem::model {

namespace fs = std::filesystem;

const Tokenizer& LoadedModel::tok() const {
  TANDEM_CHECK(tokenizer != nullptr,
               "{}: the model has no tokenizer (an HF directory needs tokenizer.json)", path);
  return *tokenizer;
}

std::vector<int32_t> LoadedModel::stop_ids() const {
  std::vector<int32_t> ids = config().eos_token_ids;
  if (tokenizer != nullptr && tokenizer->eos_id() >= 0) ids.push_back(tokenizer->eos_id());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

LoadedModel load_model(const std::string& path, DType dtype) {
  const auto t0 = std::chrono::steady_clock::now();
  std::error_code ec;
  TANDEM_CHECK(fs::exists(path, ec), "{}: no such file or directory", path);
  LoadedModel m;
  m.path = path;
  if (fs::is_regular_file(path) && path.ends_with(".gguf")) {
    GgufModel g = load_gguf_model(path, dtype);
    m.format = "gguf";
    m.weights = std::move(g.weights);
    m.tokenizer = std::make_unique<Tokenizer>(std::move(g.tokenizer));
  } else {
    const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
    TANDEM_CHECK(fs::is_directory(path) || path.ends_with(".safetensors"),
                 "{}: not a model: expected a .gguf file, a Hugging Face model directory or a "
                 ".safetensors file",
                 path);
    m.format = "hf";
    m.weights = load_hf(path, dtype);
    if (fs::exists(dir / "tokenizer.json")) {
      m.tokenizer = std::make_unique<Tokenizer>(tokenizer_data_from_hf(dir.string()));
    }
  }
  m.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

ChatStyle chat_style(const TokenizerData& data) {
  ChatStyle s;
  s.format = detect_chat_format(data.chat_template);
  s.default_system = default_system_prompt(data.chat_template);
  return s;
}

std::vector<int32_t> encode_prompt(const Tokenizer& tok, const std::string& text, bool chat) {
  std::string rendered = text;
  if (chat) {
    const ChatStyle style = chat_style(tok.data());
    const ChatMessage msg{"user", text};
    rendered = apply_chat_template(style.format, std::span<const ChatMessage>(&msg, 1), true,
                                   style.default_system);
  }
  std::vector<int32_t> ids = tok.encode(rendered, /*parse_special=*/chat);
  if (tok.add_bos() && tok.bos_id() >= 0 && (ids.empty() || ids.front() != tok.bos_id())) {
    ids.insert(ids.begin(), tok.bos_id());
  }
  return ids;
}

}  // namespace tandem::model
