// Byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, SmolLM2 families): HF tokenizer.json in and
// out, encode and decode with the same ids as Hugging Face tokenizers.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/tokenizer_data.h"

namespace tandem::model {

// Reads an HF tokenizer: `dir_or_tokenizer_json` is a directory holding tokenizer.json (and
// optionally tokenizer_config.json), or the path of a tokenizer.json (tokenizer_config.json is
// then looked for beside it). Only byte-level BPE with one of the known pre-tokenizers (see
// known_pre_tokenizers()) is accepted; anything else, malformed JSON or a missing field throws
// one tandem::Error naming the file and the field.
TokenizerData tokenizer_data_from_hf(const std::string& dir_or_tokenizer_json);

// The HF files that describe `data`: tokenizer.json, tokenizer_config.json and
// special_tokens_map.json (file name -> contents), loadable by AutoTokenizer.from_pretrained.
std::map<std::string, std::string> hf_tokenizer_files(const TokenizerData& data);
// Writes hf_tokenizer_files(data) into `dir` (created when missing).
void write_hf_tokenizer_files(const TokenizerData& data, const std::string& dir);

// The pre-tokenizer names Tokenizer knows ("gpt2", "llama-bpe", "qwen2", "smollm") and the regex
// each one splits text with (HF's Split/ByteLevel pattern; "smollm" first isolates every digit).
const std::vector<std::pair<std::string, std::string>>& known_pre_tokenizers();
// Our name for a pre-tokenizer name a GGUF file may spell otherwise ("gpt-2" -> "gpt2",
// "llama3"/"llama-v3" -> "llama-bpe"); other names are returned as they are.
std::string canonical_pre_tokenizer(const std::string& name);

class Tokenizer {
 public:
  // Checks the data (a known pre-tokenizer, every merge made of vocabulary tokens, ids in range).
  explicit Tokenizer(TokenizerData data);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Token ids of `text`; adds no bos/eos (see add_bos()). Added tokens are split out first
  // (longest match), special (control) ones only when parse_special; then the pre-tokenizer
  // regex, byte-level mapping and BPE by merge rank. Bytes that are not valid UTF-8 become
  // pre-tokens of their own, one byte each, so decode(encode(s)) == s for any bytes s, provided
  // every byte has a token in the vocabulary: a byte without one is dropped, as HF and
  // llama.cpp drop it (SmolLM2 lacks 21 of them, e.g. 0x04 and the lead byte 0xF2).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // The bytes of the ids laid end to end (special tokens as their text). Throws on an id out of
  // range.
  std::string decode(std::span<const int32_t> ids) const;
  // The bytes one token decodes to.
  const std::string& token_to_piece(int32_t id) const;
  // The id of a token given in its vocabulary form (e.g. "<|im_end|>", "Ġthe"); -1 if none.
  int32_t token_to_id(std::string_view token) const;

  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  bool add_bos() const;  // whether prompts should start with bos
  int32_t vocab_size() const;
  bool is_special(int32_t id) const;  // control tokens (HF: added tokens with special=true)
  const TokenizerData& data() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::model
