// Byte-level BPE tokenizer: HF tokenizer.json reading and writing, pre-tokenizer regexes through
// PCRE2 (UTF + UCP), the GPT-2 byte map and BPE by merge rank.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "core/error.h"
#include "core/utf8.h"

namespace tandem::model {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The regexes of HF's tokenizer.json files (ByteLevel's built-in one for GPT-2; the Split
// patterns of Llama 3 and Qwen2), by llama.cpp's pre-tokenizer names.
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for U+0100 onwards.
std::array<uint32_t, 256> make_byte_to_codepoint() {
  std::array<uint32_t, 256> map{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    map[b] = printable ? b : next++;
  }
  return map;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

uint32_t decode_utf8(std::string_view s, size_t i, size_t n) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (n == 1) return c;
  uint32_t cp = c & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// A compiled PCRE2 pattern (UTF + UCP), JIT-compiled where the library can.
class Regex {
 public:
  explicit Regex(const std::string& pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      TANDEM_FAIL("pre-tokenizer regex '{}' does not compile at offset {}: {}", pattern, offset,
                  reinterpret_cast<const char*>(message.data()));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // an interpreter fallback when unsupported
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Splits valid UTF-8 `text` into the matches and the text between them (HF Split, Isolated).
  void split(std::string_view text, std::vector<std::string_view>& out) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    TANDEM_CHECK(md != nullptr, "out of memory for a regex match");
    size_t pos = 0;
    size_t last = 0;
    while (pos < text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                                 PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t begin = ov[0];
      const size_t end = ov[1];
      if (end == begin) {  // an empty match: step over one character
        pos = begin + std::max<size_t>(1, utf8_length(text, begin));
        continue;
      }
      if (begin > last) out.push_back(text.substr(last, begin - last));
      out.push_back(text.substr(begin, end - begin));
      pos = last = end;
    }
    if (last < text.size()) out.push_back(text.substr(last));
    pcre2_match_data_free(md);
  }

  bool full_match(std::string_view text) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    TANDEM_CHECK(md != nullptr, "out of memory for a regex match");
    const int rc =
        pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0,
                    PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED | PCRE2_ENDANCHORED, md, nullptr);
    pcre2_match_data_free(md);
    return rc >= 0;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// Whether one UTF-8 character is numeric: HF Digits uses Rust's char::is_numeric (Unicode Nd,
// Nl, No), the set PCRE2's \p{N} matches.
bool is_numeric_char(std::string_view c) {
  if (c.size() == 1) return c[0] >= '0' && c[0] <= '9';
  static const Regex numeric(R"(\p{N})");
  return numeric.full_match(c);
}

// ---- tokenizer.json -------------------------------------------------------------------------

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), "cannot open tokenizer file '{}'", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json_file(const fs::path& path) {
  const std::string text = read_text_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    TANDEM_FAIL("'{}' is not valid JSON: {}", path.string(), e.what());
  }
}

std::string dump_short(const json& j) {
  std::string s = j.dump();
  if (s.size() > 300) s = s.substr(0, 300) + "...";
  return s;
}

// j[key] of the expected JSON type, or an error naming the file and the field.
const json& field(const json& j, const char* key, json::value_t type, const fs::path& file,
                  const std::string& where) {
  TANDEM_CHECK(j.is_object() && j.contains(key), "'{}': field '{}{}' is missing", file.string(),
               where, key);
  const json& v = j.at(key);
  const bool ok =
      v.type() == type ||
      (type == json::value_t::number_integer && v.type() == json::value_t::number_unsigned) ||
      (type == json::value_t::number_unsigned && v.type() == json::value_t::number_integer);
  TANDEM_CHECK(ok, "'{}': field '{}{}' should be a {} but is a {} ({})", file.string(), where, key,
               json(type).type_name(), v.type_name(), dump_short(v));
  return v;
}

bool bool_or(const json& j, const char* key, bool fallback, const fs::path& file,
             const std::string& where) {
  if (!j.is_object() || !j.contains(key) || j.at(key).is_null()) return fallback;
  return field(j, key, json::value_t::boolean, file, where).get<bool>();
}

std::string type_of(const json& j, const fs::path& file, const std::string& where) {
  return field(j, "type", json::value_t::string, file, where).get<std::string>();
}

bool is_byte_level(const json& j, bool use_regex, const fs::path& file, const std::string& where) {
  return j.is_object() && type_of(j, file, where) == "ByteLevel" &&
         !bool_or(j, "add_prefix_space", false, file, where) &&
         bool_or(j, "use_regex", true, file, where) == use_regex;
}

// Which of our pre-tokenizers an HF pre_tokenizer object is, or an error naming it.
std::string detect_pre_tokenizer(const json& pre, const fs::path& file) {
  const std::string w = "pre_tokenizer.";
  auto unknown = [&]() -> std::string {
    TANDEM_FAIL(
        "'{}': pre_tokenizer {} is none of the known ones (GPT-2 ByteLevel, Llama-3 or Qwen2 Split "
        "regex + ByteLevel, SmolLM2 Digits(individual_digits) + ByteLevel)",
        file.string(), dump_short(pre));
  };
  if (!pre.is_object()) return unknown();
  if (is_byte_level(pre, true, file, w)) return "gpt2";
  if (type_of(pre, file, w) != "Sequence") return unknown();
  const json& seq = field(pre, "pretokenizers", json::value_t::array, file, w);
  if (seq.size() != 2 || !seq[0].is_object()) return unknown();
  const std::string w0 = w + "pretokenizers[0].";
  const std::string w1 = w + "pretokenizers[1].";
  const std::string t0 = type_of(seq[0], file, w0);
  if (t0 == "Digits" && bool_or(seq[0], "individual_digits", false, file, w0) &&
      is_byte_level(seq[1], true, file, w1))
    return "smollm";
  if (t0 == "Split" && is_byte_level(seq[1], false, file, w1)) {
    const json& pattern = field(seq[0], "pattern", json::value_t::object, file, w0);
    if (!pattern.contains("Regex") || !pattern.at("Regex").is_string()) return unknown();
    const std::string regex = pattern.at("Regex").get<std::string>();
    const json behavior = seq[0].value("behavior", json("Isolated"));
    if (behavior != "Isolated" || bool_or(seq[0], "invert", false, file, w0)) return unknown();
    for (const auto& [name, known] : known_pre_tokenizers())
      if (regex == known && name != "gpt2" && name != "smollm") return name;
  }
  return unknown();
}

// An added token in tokenizer_config.json: a string or {"content": ...}.
std::string token_text(const json& v, const fs::path& file, const std::string& key) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v.at("content").is_string())
    return v.at("content").get<std::string>();
  TANDEM_FAIL("'{}': field '{}' should be a token string or {{\"content\": ...}} but is {}",
              file.string(), key, dump_short(v));
}

}  // namespace

std::string canonical_pre_tokenizer(const std::string& name) {
  // Other spellings llama.cpp's GGUF files use for the same pre-tokenizers.
  if (name == "gpt-2") return "gpt2";
  if (name == "llama3" || name == "llama-v3") return "llama-bpe";
  return name;
}

const std::vector<std::pair<std::string, std::string>>& known_pre_tokenizers() {
  static const std::vector<std::pair<std::string, std::string>> known = {
      {"gpt2", kGpt2Regex},
      {"smollm", kGpt2Regex},
      {"llama-bpe", kLlama3Regex},
      {"qwen2", kQwen2Regex},
  };
  return known;
}

namespace {

TokenizerData read_hf_files(const fs::path& path) {
  const json root = parse_json_file(path);
  TANDEM_CHECK(root.is_object(), "'{}': the top level should be an object but is {}", path.string(),
               root.type_name());

  TokenizerData data;
  const json& model = field(root, "model", json::value_t::object, path, "");
  const std::string model_type = model.value("type", std::string("BPE"));
  TANDEM_CHECK(model_type == "BPE", "'{}': model.type is '{}', only byte-level 'BPE' is supported",
               path.string(), model_type);
  TANDEM_CHECK(!bool_or(model, "byte_fallback", false, path, "model."),
               "'{}': model.byte_fallback is true (SentencePiece-style BPE is not supported)",
               path.string());
  data.ignore_merges = bool_or(model, "ignore_merges", false, path, "model.");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json v = model.value(key, json());
    TANDEM_CHECK(v.is_null() || v == "", "'{}': model.{} is {} (only none is supported)",
                 path.string(), key, dump_short(v));
  }

  const json& normalizer = root.contains("normalizer") ? root.at("normalizer") : json();
  TANDEM_CHECK(
      normalizer.is_null() || (normalizer.is_object() && normalizer.value("type", "") == "NFC"),
      "'{}': normalizer {} is not supported (only none or NFC)", path.string(),
      dump_short(normalizer));
  data.pre = detect_pre_tokenizer(
      root.contains("pre_tokenizer") ? root.at("pre_tokenizer") : json(), path);

  // Vocabulary: token -> id; the ids must be 0..n-1 together with the added tokens.
  const json& vocab = field(model, "vocab", json::value_t::object, path, "model.");
  std::vector<std::string> tokens;
  std::vector<bool> filled;
  const json* added_list = root.contains("added_tokens") && !root.at("added_tokens").is_null()
                               ? &field(root, "added_tokens", json::value_t::array, path, "")
                               : nullptr;
  // Ids are 0..n-1 over the vocabulary and the added tokens together.
  const auto id_limit = static_cast<int64_t>(vocab.size() + (added_list ? added_list->size() : 0));
  auto put = [&](int64_t id, const std::string& text, const std::string& where) {
    TANDEM_CHECK(id >= 0 && id < id_limit, "'{}': {} has id {}, out of range 0..{}", path.string(),
                 where, id, id_limit - 1);
    if (static_cast<size_t>(id) >= tokens.size()) {
      tokens.resize(id + 1);
      filled.resize(id + 1, false);
    }
    TANDEM_CHECK(!filled[id] || tokens[id] == text, "'{}': {}: id {} is both '{}' and '{}'",
                 path.string(), where, id, tokens[id], text);
    tokens[id] = text;
    filled[id] = true;
  };
  for (const auto& [text, id] : vocab.items()) {
    TANDEM_CHECK(id.is_number_integer(),
                 "'{}': model.vocab['{}'] should be an integer id but is {}", path.string(), text,
                 dump_short(id));
    put(id.get<int64_t>(), text, fmt::format("model.vocab['{}']", text));
  }
  std::vector<TokenType> types;
  bool any_added = false;
  if (added_list != nullptr) {
    const json& added = *added_list;
    for (size_t i = 0; i < added.size(); ++i) {
      const std::string w = fmt::format("added_tokens[{}].", i);
      const json& a = added[i];
      const auto id = field(a, "id", json::value_t::number_integer, path, w).get<int64_t>();
      const auto content = field(a, "content", json::value_t::string, path, w).get<std::string>();
      put(id, content, w + "content");
      if (types.size() < tokens.size()) types.resize(tokens.size(), TokenType::normal);
      types[id] =
          bool_or(a, "special", false, path, w) ? TokenType::control : TokenType::user_defined;
      any_added = true;
    }
  }
  for (size_t id = 0; id < tokens.size(); ++id)
    TANDEM_CHECK(filled[id], "'{}': model.vocab has no token with id {} (ids must be 0..{})",
                 path.string(), id, tokens.size() - 1);
  TANDEM_CHECK(!tokens.empty(), "'{}': model.vocab is empty", path.string());
  if (any_added) types.resize(tokens.size(), TokenType::normal);
  data.tokens = std::move(tokens);
  data.token_types = std::move(types);

  const json& merges = field(model, "merges", json::value_t::array, path, "model.");
  data.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      TANDEM_CHECK(space != std::string::npos && space > 0 && space + 1 < s.size() &&
                       s.find(' ', space + 1) == std::string::npos,
                   "'{}': model.merges[{}] should be \"a b\" but is '{}'", path.string(), i, s);
      data.merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else {
      TANDEM_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                   "'{}': model.merges[{}] should be \"a b\" or [\"a\", \"b\"] but is {}",
                   path.string(), i, dump_short(m));
      data.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    }
  }

  std::unordered_map<std::string, int32_t> ids;
  for (size_t i = 0; i < data.tokens.size(); ++i) ids.emplace(data.tokens[i], int32_t(i));
  auto id_of = [&](const std::string& text, const fs::path& file, const std::string& key) {
    auto it = ids.find(text);
    TANDEM_CHECK(it != ids.end(), "'{}': {} '{}' is not in the vocabulary", file.string(), key,
                 text);
    return it->second;
  };
  if (model.contains("unk_token") && model.at("unk_token").is_string())
    data.unk_id = id_of(model.at("unk_token").get<std::string>(), path, "model.unk_token");

  const fs::path config_path = path.parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config_path)) {
    const json config = parse_json_file(config_path);
    TANDEM_CHECK(config.is_object(), "'{}': the top level should be an object but is {}",
                 config_path.string(), config.type_name());
    if (config.contains("chat_template") && !config.at("chat_template").is_null()) {
      const json& t = config.at("chat_template");
      if (t.is_string()) {
        data.chat_template = t.get<std::string>();
      } else {  // a list of {"name", "template"}: take "default"
        TANDEM_CHECK(t.is_array(),
                     "'{}': field 'chat_template' should be a string or a list but is {}",
                     config_path.string(), t.type_name());
        for (const json& named : t)
          if (named.is_object() && named.value("name", "") == "default" &&
              named.contains("template") && named.at("template").is_string())
            data.chat_template = named.at("template").get<std::string>();
      }
    }
    auto special = [&](const char* key, int32_t& out) {
      if (!config.contains(key) || config.at(key).is_null()) return;
      out = id_of(token_text(config.at(key), config_path, key), config_path, key);
    };
    special("bos_token", data.bos_id);
    special("eos_token", data.eos_id);
    special("pad_token", data.pad_id);
    special("unk_token", data.unk_id);
    data.add_bos = bool_or(config, "add_bos_token", false, config_path, "");
    if (config.contains("model_max_length") && config.at("model_max_length").is_number()) {
      const double n = config.at("model_max_length").get<double>();
      data.model_max_length = n > 0 && n < 1e15 ? static_cast<int64_t>(n) : 0;
    }
  }
  // Newer transformers save the template beside the config, as chat_template.jinja.
  const fs::path jinja_path = path.parent_path() / "chat_template.jinja";
  if (data.chat_template.empty() && fs::is_regular_file(jinja_path))
    data.chat_template = read_text_file(jinja_path);
  return data;
}

}  // namespace

TokenizerData tokenizer_data_from_hf(const std::string& dir_or_tokenizer_json) {
  fs::path path(dir_or_tokenizer_json);
  if (fs::is_directory(path)) path /= "tokenizer.json";
  TANDEM_CHECK(fs::is_regular_file(path), "tokenizer file '{}' does not exist", path.string());
  try {
    return read_hf_files(path);
  } catch (const json::exception& e) {  // a shape the checks above did not foresee
    TANDEM_FAIL("'{}' (or tokenizer_config.json beside it) is malformed: {}", path.string(),
                e.what());
  }
}

// ---- writing HF files ------------------------------------------------------------------------

std::map<std::string, std::string> hf_tokenizer_files(const TokenizerData& data) {
  TANDEM_CHECK(data.model == "gpt2", "tokenizer model '{}' cannot be written as HF byte-level BPE",
               data.model);
  auto token_type = [&](size_t id) {
    return id < data.token_types.size() ? data.token_types[id] : TokenType::normal;
  };
  auto added_token = [](const std::string& content) {
    return json{{"content", content}, {"single_word", false}, {"lstrip", false},
                {"rstrip", false},    {"normalized", false},  {"special", true}};
  };
  json added = json::array();
  json vocab = json::object();
  for (size_t id = 0; id < data.tokens.size(); ++id) {
    vocab[data.tokens[id]] = id;
    const TokenType t = token_type(id);
    if (t == TokenType::control || t == TokenType::user_defined) {
      json a = added_token(data.tokens[id]);
      a["special"] = t == TokenType::control;
      a["normalized"] = t != TokenType::control;
      a["id"] = id;
      added.push_back(a);
    }
  }
  json merges = json::array();
  for (const auto& [a, b] : data.merges) merges.push_back(a + " " + b);

  auto byte_level = [](bool use_regex) {
    return json{{"type", "ByteLevel"},
                {"add_prefix_space", false},
                {"trim_offsets", true},
                {"use_regex", use_regex}};
  };
  json pre;
  const std::string pre_name = canonical_pre_tokenizer(data.pre);
  if (pre_name == "gpt2") {
    pre = byte_level(true);
  } else if (pre_name == "smollm") {
    pre = {{"type", "Sequence"},
           {"pretokenizers", json::array({json{{"type", "Digits"}, {"individual_digits", true}},
                                          byte_level(true)})}};
  } else {
    std::string regex;
    for (const auto& [name, known] : known_pre_tokenizers())
      if (name == pre_name) regex = known;
    TANDEM_CHECK(!regex.empty(), "pre-tokenizer '{}' is not one of the known ones", data.pre);
    json split = {{"type", "Split"},
                  {"pattern", {{"Regex", regex}}},
                  {"behavior", "Isolated"},
                  {"invert", false}};
    pre = {{"type", "Sequence"}, {"pretokenizers", json::array({split, byte_level(false)})}};
  }
  json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre},
      {"post_processor",
       {{"type", "ByteLevel"},
        {"add_prefix_space", true},
        {"trim_offsets", false},
        {"use_regex", true}}},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", true},
        {"trim_offsets", true},
        {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", data.unk_id >= 0 ? json(data.tokens.at(data.unk_id)) : json(nullptr)},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", data.ignore_merges},
        {"vocab", vocab},
        {"merges", merges}}},
  };

  json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"clean_up_tokenization_spaces", false},
                 {"add_bos_token", data.add_bos},
                 {"add_eos_token", false}};
  json special_map = json::object();
  auto special = [&](const char* key, int32_t id) {
    if (id < 0) return;
    TANDEM_CHECK(static_cast<size_t>(id) < data.tokens.size(),
                 "{} id {} is out of range (vocab {})", key, id, data.tokens.size());
    config[key] = data.tokens[id];
    special_map[key] = added_token(data.tokens[id]);
    special_map[key].erase("special");
  };
  special("bos_token", data.bos_id);
  special("eos_token", data.eos_id);
  special("pad_token", data.pad_id);
  special("unk_token", data.unk_id);
  if (!data.chat_template.empty()) config["chat_template"] = data.chat_template;
  config["model_max_length"] = data.model_max_length > 0 ? data.model_max_length : int64_t{1} << 30;

  return {{"tokenizer.json", tokenizer.dump(2)},
          {"tokenizer_config.json", config.dump(2)},
          {"special_tokens_map.json", special_map.dump(2)}};
}

void write_hf_tokenizer_files(const TokenizerData& data, const std::string& dir) {
  const auto files = hf_tokenizer_files(data);
  std::error_code ec;
  fs::create_directories(dir, ec);
  TANDEM_CHECK(!ec, "cannot create directory '{}': {}", dir, ec.message());
  for (const auto& [name, contents] : files) {
    const fs::path path = fs::path(dir) / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << contents;
    out.close();
    TANDEM_CHECK(out.good(), "cannot write '{}'", path.string());
  }
}

// ---- Tokenizer -------------------------------------------------------------------------------

struct Tokenizer::Impl {
  TokenizerData data;
  std::unique_ptr<Regex> regex;
  bool split_digits = false;
  std::unordered_map<std::string, int32_t> ids;  // vocabulary form -> id
  std::vector<std::string> pieces;               // id -> decoded bytes
  std::array<std::string, 256> byte_chars;       // byte -> its byte-level character (UTF-8)
  std::array<int32_t, 256> byte_ids{};           // byte -> id of its one-character token, or -1
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id, right id) -> rank and merged id
  // Added tokens by first byte, longest first: (text, id, special).
  struct Added {
    std::string text;
    int32_t id;
    bool special;
  };
  std::array<std::vector<Added>, 256> added;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;  // pre-token -> ids

  TokenType type(size_t id) const {
    return id < data.token_types.size() ? data.token_types[id] : TokenType::normal;
  }

  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
};

Tokenizer::Tokenizer(TokenizerData data) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.data = std::move(data);
  m.data.pre = canonical_pre_tokenizer(m.data.pre);
  const TokenizerData& d = m.data;
  TANDEM_CHECK(d.model == "gpt2",
               "tokenizer model '{}' is not supported (only byte-level BPE, 'gpt2')", d.model);
  TANDEM_CHECK(!d.tokens.empty(), "tokenizer has no tokens");
  TANDEM_CHECK(d.token_types.empty() || d.token_types.size() == d.tokens.size(),
               "tokenizer has {} token types for {} tokens", d.token_types.size(), d.tokens.size());
  std::string pattern;
  for (const auto& [name, known] : known_pre_tokenizers())
    if (name == d.pre) pattern = known;
  TANDEM_CHECK(!pattern.empty(),
               "pre-tokenizer '{}' is not supported (known: gpt2, llama-bpe, qwen2, smollm)",
               d.pre);
  m.regex = std::make_unique<Regex>(pattern);
  m.split_digits = d.pre == "smollm";
  const auto n = static_cast<int32_t>(d.tokens.size());
  for (int32_t id : {d.bos_id, d.eos_id, d.pad_id, d.unk_id})
    TANDEM_CHECK(id >= -1 && id < n, "special token id {} is out of range (vocab {})", id, n);

  const auto byte_to_cp = make_byte_to_codepoint();
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  for (int b = 0; b < 256; ++b) {
    append_utf8(m.byte_chars[b], byte_to_cp[b]);
    cp_to_byte[byte_to_cp[b]] = static_cast<uint8_t>(b);
  }
  m.ids.reserve(d.tokens.size());
  m.pieces.resize(d.tokens.size());
  for (int32_t id = 0; id < n; ++id) {
    const std::string& tok = d.tokens[id];
    m.ids.emplace(tok, id);  // the first id wins for duplicates
    const TokenType t = m.type(id);
    if (t == TokenType::control || t == TokenType::user_defined) {
      m.pieces[id] = tok;
      if (!tok.empty())
        m.added[static_cast<unsigned char>(tok[0])].push_back({tok, id, t == TokenType::control});
      continue;
    }
    // Byte-level characters back to bytes; a character outside the map stays as it is.
    std::string& piece = m.pieces[id];
    for (size_t i = 0; i < tok.size();) {
      size_t len = utf8_length(tok, i);
      if (len == 0) {
        piece += tok[i++];
        continue;
      }
      auto it = cp_to_byte.find(decode_utf8(tok, i, len));
      if (it != cp_to_byte.end())
        piece += static_cast<char>(it->second);
      else
        piece.append(tok, i, len);
      i += len;
    }
  }
  for (auto& list : m.added)
    std::stable_sort(list.begin(), list.end(), [](const Impl::Added& a, const Impl::Added& b) {
      return a.text.size() > b.text.size();
    });
  std::string missing;
  for (int b = 0; b < 256; ++b) {
    auto it = m.ids.find(m.byte_chars[b]);
    m.byte_ids[b] = it == m.ids.end() ? -1 : it->second;
    if (it == m.ids.end()) missing += fmt::format(" {:02x}", b);
  }
  if (!missing.empty())
    spdlog::debug(
        "tokenizer: bytes{} have no token in the vocabulary; encode drops them (as Hugging Face "
        "and llama.cpp do), so text holding them does not decode back whole",
        missing);
  m.merges.reserve(d.merges.size());
  for (size_t rank = 0; rank < d.merges.size(); ++rank) {
    const auto& [a, b] = d.merges[rank];
    auto ia = m.ids.find(a);
    auto ib = m.ids.find(b);
    auto iab = m.ids.find(a + b);
    TANDEM_CHECK(ia != m.ids.end() && ib != m.ids.end() && iab != m.ids.end(),
                 "tokenizer merge {} ('{}' '{}'): '{}' is not in the vocabulary", rank, a, b,
                 ia == m.ids.end()   ? a
                 : ib == m.ids.end() ? b
                                     : a + b);
    const uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    m.merges.emplace(key, Impl::Merge{static_cast<int32_t>(rank), iab->second});  // first rank wins
  }
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

// BPE of one pre-token (raw bytes): start from one symbol per byte, merge the lowest-ranked
// adjacent pair (leftmost on ties) until no pair merges, as HF's BPE and llama.cpp do.
void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (data.ignore_merges) {
    std::string mapped;
    for (char c : word) mapped += byte_chars[static_cast<unsigned char>(c)];
    if (auto it = ids.find(mapped); it != ids.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> sym(word.size());
  for (size_t i = 0; i < word.size(); ++i)
    sym[i] = {byte_ids[static_cast<unsigned char>(word[i])], int(i) - 1,
              i + 1 < word.size() ? int(i) + 1 : -1, true};
  struct Candidate {
    int32_t rank;
    int left;
    int32_t left_id, right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push = [&](int left) {
    if (left < 0) return;
    const int right = sym[left].next;
    if (right < 0 || sym[left].id < 0 || sym[right].id < 0) return;
    const uint64_t key = (uint64_t(uint32_t(sym[left].id)) << 32) | uint32_t(sym[right].id);
    auto it = merges.find(key);
    if (it != merges.end()) queue.push({it->second.rank, left, sym[left].id, sym[right].id});
  };
  for (size_t i = 0; i + 1 < word.size(); ++i) push(int(i));
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = sym[c.left];
    if (!left.alive || left.id != c.left_id || left.next < 0) continue;
    Symbol& right = sym[left.next];
    if (right.id != c.right_id) continue;  // stale: one side has merged since
    const uint64_t key = (uint64_t(uint32_t(left.id)) << 32) | uint32_t(right.id);
    left.id = merges.at(key).id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.left;
    push(left.prev);
    push(c.left);
  }
  // A byte without a token in the vocabulary is dropped, as HF's BPE without an unk token and
  // llama.cpp do (the constructor logs which bytes those are).
  for (int i = 0; i >= 0 && i < int(sym.size()); i = sym[i].next)
    if (sym[i].id >= 0) out.push_back(sym[i].id);
}

// Pre-tokenizes text that holds no added tokens and BPE-encodes every pre-token.
void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  // Valid UTF-8 runs go through the regex; every invalid byte is a pre-token of its own.
  // With "smollm", every numeric character is isolated first (HF Digits(individual_digits)).
  std::vector<std::string_view> segments;
  std::vector<bool> regex_segment;
  size_t run = 0;
  auto close_run = [&](size_t end) {
    if (end > run) {
      segments.push_back(text.substr(run, end - run));
      regex_segment.push_back(true);
    }
  };
  for (size_t i = 0; i < text.size();) {
    const size_t len = utf8_length(text, i);
    if (len == 0) {
      close_run(i);
      segments.push_back(text.substr(i, 1));
      regex_segment.push_back(false);
      run = ++i;
      continue;
    }
    if (split_digits && is_numeric_char(text.substr(i, len))) {
      close_run(i);
      segments.push_back(text.substr(i, len));
      regex_segment.push_back(false);
      run = i += len;
      continue;
    }
    i += len;
  }
  close_run(text.size());

  std::vector<std::string_view> words;
  for (size_t s = 0; s < segments.size(); ++s) {
    if (regex_segment[s])
      regex->split(segments[s], words);
    else
      words.push_back(segments[s]);
  }
  std::lock_guard lock(cache_mutex);
  for (std::string_view w : words) {
    auto it = cache.find(std::string(w));
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      continue;
    }
    std::vector<int32_t> ids_of_word;
    bpe(w, ids_of_word);
    out.insert(out.end(), ids_of_word.begin(), ids_of_word.end());
    if (cache.size() > 200000) cache.clear();
    if (w.size() <= 256) cache.emplace(std::string(w), std::move(ids_of_word));
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  const Impl& m = *impl_;
  std::vector<int32_t> out;
  size_t start = 0;  // start of the text not yet encoded
  for (size_t i = 0; i < text.size();) {
    const Impl::Added* hit = nullptr;
    for (const Impl::Added& a : m.added[static_cast<unsigned char>(text[i])]) {
      if ((parse_special || !a.special) && text.substr(i, a.text.size()) == a.text) {
        hit = &a;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    m.encode_text(text.substr(start, i - start), out);
    out.push_back(hit->id);
    i += hit->text.size();
    start = i;
  }
  m.encode_text(text.substr(start), out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_to_piece(id);
  return out;
}

const std::string& Tokenizer::token_to_piece(int32_t id) const {
  TANDEM_CHECK(id >= 0 && id < vocab_size(), "token id {} is out of range (vocab {})", id,
               vocab_size());
  return impl_->pieces[id];
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->ids.find(std::string(token));
  return it == impl_->ids.end() ? -1 : it->second;
}

int32_t Tokenizer::bos_id() const { return impl_->data.bos_id; }
int32_t Tokenizer::eos_id() const { return impl_->data.eos_id; }
int32_t Tokenizer::pad_id() const { return impl_->data.pad_id; }
bool Tokenizer::add_bos() const { return impl_->data.add_bos; }
int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->data.tokens.size()); }
bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->type(id) == TokenType::control;
}
const TokenizerData& Tokenizer::data() const { return impl_->data; }

}  // namespace tandem::model
