// Tokenizer: BPE on a tiny hand-made vocabulary, errors on bad tokenizer.json files, and parity
// with Hugging Face on the SmolLM2-135M-Instruct goldens (tests/golden/smollm2).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "model/tokenizer.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::model;
namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;

namespace {

fs::path golden_dir() { return fs::path(TANDEM_SOURCE_DIR) / "tests/golden/smollm2"; }

using tandem::test::TempDir;

std::string byte_char(int b) { return tandem::test::gpt2_byte_char(b); }

// Ids 0..255 are the bytes; then the merges' results; then added tokens.
TokenizerData tiny_data(const std::vector<std::pair<std::string, std::string>>& merges,
                        const std::string& pre = "gpt2") {
  TokenizerData d;
  d.pre = pre;
  for (int b = 0; b < 256; ++b) d.tokens.push_back(byte_char(b));
  for (const auto& [a, b] : merges) {
    d.merges.emplace_back(a, b);
    if (std::find(d.tokens.begin(), d.tokens.end(), a + b) == d.tokens.end())
      d.tokens.push_back(a + b);
  }
  d.token_types.assign(d.tokens.size(), TokenType::normal);
  auto add = [&](const std::string& text, TokenType type) {
    d.tokens.push_back(text);
    d.token_types.push_back(type);
    return int32_t(d.tokens.size() - 1);
  };
  d.eos_id = add("<|s|>", TokenType::control);
  add("<|s|>x", TokenType::control);
  add("[U]", TokenType::user_defined);
  return d;
}

Ids bytes_of(std::string_view s) {
  Ids ids;
  for (char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("bpe merges by rank with the leftmost pair first on ties", "[unit]") {
  Tokenizer ab_first(tiny_data({{"a", "b"}, {"b", "c"}}));
  const int32_t ab = ab_first.token_to_id("ab");
  CHECK(ab_first.encode("abc") == Ids{ab, 'c'});
  Tokenizer bc_first(tiny_data({{"b", "c"}, {"a", "b"}}));
  CHECK(bc_first.encode("abc") == Ids{'a', bc_first.token_to_id("bc")});

  Tokenizer aa(tiny_data({{"a", "a"}}));
  const int32_t id_aa = aa.token_to_id("aa");
  CHECK(aa.encode("aaa") == Ids{id_aa, 'a'});
  CHECK(aa.encode("aaaa") == Ids{id_aa, id_aa});

  // A chain of merges; the space is Ġ in byte-level form and starts the next pre-token.
  Tokenizer hello(tiny_data({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}}));
  const int32_t id_hello = hello.token_to_id("hello");
  REQUIRE(id_hello >= 256);
  CHECK(hello.encode("hello world") == Ids{id_hello, hello.token_to_id("Ġw"), 'o', 'r', 'l', 'd'});
  CHECK(hello.decode(hello.encode("hello world")) == "hello world");
  CHECK(hello.token_to_piece(hello.token_to_id("Ġw")) == " w");
  // Merges never cross pre-tokens: "he" + "llo" split by the regex at the apostrophe.
  CHECK(hello.encode("he'llo") == Ids{hello.token_to_id("he"), '\'', hello.token_to_id("ll"), 'o'});
}

TEST_CASE("added tokens split out first by longest match and special only when asked", "[unit]") {
  Tokenizer tok(tiny_data({{"x", "y"}}));
  const int32_t s = tok.token_to_id("<|s|>");
  const int32_t sx = tok.token_to_id("<|s|>x");
  const int32_t u = tok.token_to_id("[U]");
  const int32_t xy = tok.token_to_id("xy");
  CHECK(tok.is_special(s));
  CHECK_FALSE(tok.is_special(u));
  CHECK_FALSE(tok.is_special(xy));
  CHECK(tok.eos_id() == s);
  CHECK(tok.encode("xy<|s|>xy") == Ids{xy, sx, 'y'});
  CHECK(tok.encode("xy<|s|>y[U]") == Ids{xy, s, 'y', u});
  CHECK(tok.encode("<|s|><|s|>") == Ids{s, s});
  CHECK(tok.encode("<|s|") == bytes_of("<|s|"));
  // Without parse_special the special tokens are text; user-defined ones still split out.
  Ids plain = bytes_of("<|s|>");
  plain.push_back(u);
  CHECK(tok.encode("<|s|>[U]", false) == plain);
  CHECK(tok.decode(Ids{xy, s, u, 'z'}) == "xy<|s|>[U]z");
  CHECK_THROWS_AS(tok.decode(Ids{tok.vocab_size()}), Error);
  CHECK_THROWS_AS(tok.token_to_piece(-1), Error);
  CHECK(tok.token_to_id("no such token") == -1);
}

TEST_CASE("every byte encodes to its own token and decodes back", "[unit]") {
  Tokenizer tok(tiny_data({}));
  for (int b = 0; b < 256; ++b) {
    const std::string s(1, static_cast<char>(b));
    INFO("byte " << b);
    CHECK(tok.encode(s) == Ids{b});
    CHECK(tok.decode(Ids{b}) == s);
  }
}

TEST_CASE("decode of encode gives back any bytes including invalid utf8", "[unit]") {
  Tokenizer tok(tiny_data({{"a", "b"}, {"Ġ", "a"}, {"c", "d"}, {"Ã", "©"}}));
  const std::vector<std::string> cases = {
      "ab\xff\xfe cd\xc3",         // stray bytes and a truncated 2-byte sequence at the end
      "\xe2\x82 ab \xf0\x9f\x98",  // truncated 3- and 4-byte sequences
      "\xc0\xaf \xed\xa0\x80 caf\xc3\xa9",  // overlong and surrogate forms, then valid é
      std::string("a\0b", 3),
      "",
  };
  for (const auto& s : cases) CHECK(tok.decode(tok.encode(s)) == s);
  // An invalid byte is a pre-token of its own: it never merges with its neighbours.
  CHECK(tok.encode("ab\xff"
                   "ab") == Ids{tok.token_to_id("ab"), 0xff, tok.token_to_id("ab")});

  std::mt19937 rng(1234);
  for (int round = 0; round < 200; ++round) {
    std::string s(rng() % 40, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 6 == 0 ? rng() % 256 : "ab cd\n"[rng() % 6]);
    INFO("round " << round);
    CHECK(tok.decode(tok.encode(s)) == s);
  }
}

TEST_CASE("pre-tokenizers group digits as gpt2 llama3 qwen2 and smollm do", "[unit]") {
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"1", "2"}, {"12", "3"}, {"123", "4"}, {"Ġ", "1"}, {"a", "1"}};
  auto encode = [&](const std::string& pre, const std::string& text) {
    Tokenizer tok(tiny_data(merges, pre));
    std::vector<std::string> pieces;
    for (int32_t id : tok.encode(text)) pieces.push_back(tok.token_to_piece(id));
    return pieces;
  };
  using P = std::vector<std::string>;
  CHECK(encode("gpt2", "1234 a1") == P{"1234", " ", "a", "1"});
  CHECK(encode("gpt2", " 1") == P{" 1"});
  CHECK(encode("llama-bpe", "1234") == P{"123", "4"});
  CHECK(encode("qwen2", "1234") == P{"1", "2", "3", "4"});
  CHECK(encode("smollm", "1234 a1") == P{"1", "2", "3", "4", " ", "a", "1"});
  CHECK(encode("smollm", " 1") == P{" ", "1"});
  // Llama 3's contractions ignore case; GPT-2's do not.
  Tokenizer gpt2(tiny_data({{"'", "S"}}, "gpt2"));
  Tokenizer llama(tiny_data({{"'", "S"}}, "llama-bpe"));
  CHECK(gpt2.encode("IT'S").size() == 4);
  CHECK(llama.encode("IT'S").size() == 3);
  CHECK_THROWS_AS(Tokenizer(tiny_data({}, "bert")), Error);
  CHECK(Tokenizer(tiny_data({}, "gpt-2")).data().pre == "gpt2");  // GGUF spellings
  CHECK(Tokenizer(tiny_data({}, "llama3")).data().pre == "llama-bpe");
}

TEST_CASE("tokenizer data from bad tokenizer json names the file and the field", "[unit]") {
  TempDir dir("tok-bad");
  const std::string good_pre = R"({"type": "ByteLevel", "add_prefix_space": false})";
  auto file = [&](const std::string& model, const std::string& pre = "") {
    return dir.write("tokenizer.json", R"({"added_tokens": [], "pre_tokenizer": )" +
                                           (pre.empty() ? good_pre : pre) + R"(, "model": )" +
                                           model + "}");
  };
  const std::string vocab = R"("vocab": {"a": 0, "b": 1, "ab": 2})";
  const std::string dir_name = dir.path.string();

  file(R"({"type": "BPE", )" + vocab + R"(, "merges": ["a b"]})");
  const TokenizerData ok = tokenizer_data_from_hf(dir_name);
  CHECK(ok.tokens == std::vector<std::string>{"a", "b", "ab"});
  CHECK(ok.merges.size() == 1);
  CHECK(ok.pre == "gpt2");
  CHECK(ok.chat_template.empty());
  dir.write("chat_template.jinja", "{{ '<|im_start|>' }}");  // newer transformers' layout
  CHECK(tokenizer_data_from_hf(dir_name).chat_template == "{{ '<|im_start|>' }}");
  fs::remove(dir.path / "chat_template.jinja");

  struct Case {
    std::function<void()> write;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[&] { dir.write("tokenizer.json", "{\"model\": {"); }, "not valid JSON"},
      {[&] { file(R"({"type": "BPE", "merges": []})"); }, "model.vocab"},
      {[&] { file(R"({"type": "BPE", )" + vocab + "}"); }, "model.merges"},
      {[&] { file(R"({"type": "BPE", )" + vocab + R"(, "merges": ["ab"]})"); }, "model.merges[0]"},
      {[&] { file(R"({"type": "BPE", )" + vocab + R"(, "merges": [1]})"); }, "model.merges[0]"},
      {[&] { file(R"({"type": "Unigram", )" + vocab + R"(, "merges": []})"); }, "model.type"},
      {[&] { file(R"({"type": "BPE", "vocab": {"a": 0, "b": 2}, "merges": []})"); }, "has id 2"},
      {[&] {
         dir.write("tokenizer.json",
                   R"({"added_tokens": [{"id": 1, "special": true}], "pre_tokenizer": )" +
                       good_pre + R"(, "model": {"type": "BPE", "vocab": {"a": 0, "b": 2},
                       "merges": []}})");
       },
       "added_tokens[0].content"},
      {[&] { file(R"({"type": "BPE", "vocab": {"a": "x"}, "merges": []})"); }, "model.vocab['a']"},
      {[&] { file(R"({"type": "BPE", "vocab": {"a": 2000000000}, "merges": []})"); },
       "out of range"},
      {[&] {
         file(R"({"type": "BPE", "continuing_subword_prefix": "##", )" + vocab +
              R"(, "merges": []})");
       },
       "model.continuing_subword_prefix"},
      {[&] {
         file(R"({"type": "BPE", )" + vocab + R"(, "merges": []})",
              R"({"type": "Metaspace", "replacement": "_"})");
       },
       "pre_tokenizer"},
      {[&] {
         file(R"({"type": "BPE", )" + vocab + R"(, "merges": []})",
              R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "x"},
                  "behavior": "Isolated"}, {"type": "ByteLevel", "use_regex": false}]})");
       },
       "pre_tokenizer"},
      {[&] {
         file(R"({"type": "BPE", )" + vocab + R"(, "merges": []})");
         dir.write("tokenizer_config.json", R"({"eos_token": "</s>"})");
       },
       "eos_token"},
      {[&] {
         file(R"({"type": "BPE", )" + vocab + R"(, "merges": []})");
         dir.write("tokenizer_config.json", R"({"add_bos_token": "yes"})");
       },
       "add_bos_token"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    fs::remove(dir.path / "tokenizer_config.json");
    cases[i].write();
    const std::string message = error_of([&] { tokenizer_data_from_hf(dir_name); });
    INFO("case " << i << ": " << message);
    CHECK(message.find(cases[i].expect) != std::string::npos);
    CHECK(message.find(dir_name) != std::string::npos);
  }
  CHECK(error_of([&] {
          tokenizer_data_from_hf((dir.path / "missing").string());
        }).find("does not exist") != std::string::npos);
  // A merge of tokens that are not in the vocabulary is refused by the Tokenizer.
  TokenizerData bad = tiny_data({});
  bad.merges.emplace_back("a", "zz");
  CHECK(error_of([&] { Tokenizer t(bad); }).find("'zz' is not in the vocabulary") !=
        std::string::npos);
}

TEST_CASE("hf tokenizer files written by tandem read back the same", "[unit]") {
  TempDir dir("tok-write");
  for (const std::string pre : {"gpt2", "smollm", "llama-bpe", "qwen2"}) {
    TokenizerData d = tiny_data({{"a", "b"}, {"ab", "c"}}, pre);
    d.bos_id = 'a';
    d.add_bos = true;
    d.chat_template = "{{ '<|im_start|>' }}";
    d.model_max_length = 4096;
    d.ignore_merges = pre == "llama-bpe";
    write_hf_tokenizer_files(d, dir.path.string());
    const TokenizerData back = tokenizer_data_from_hf(dir.path.string());
    INFO(pre);
    CHECK(back.pre == pre);
    CHECK(back.tokens == d.tokens);
    CHECK(back.token_types == d.token_types);
    CHECK(back.merges == d.merges);
    CHECK(back.bos_id == d.bos_id);
    CHECK(back.eos_id == d.eos_id);
    CHECK(back.add_bos);
    CHECK(back.ignore_merges == d.ignore_merges);
    CHECK(back.chat_template == d.chat_template);
    CHECK(back.model_max_length == 4096);
    const auto special_map = json::parse(std::ifstream(dir.path / "special_tokens_map.json"));
    CHECK(special_map.at("eos_token").at("content") == "<|s|>");
  }
}

TEST_CASE("bytes without a token in the vocabulary are dropped as hugging face does", "[unit]") {
  TokenizerData d = tiny_data({});
  d.tokens[0xff] = "unused-0xff";  // no token for byte 0xff any more
  Tokenizer tok(d);
  CHECK(tok.encode("a\xff"
                   "b") == Ids{'a', 'b'});
  CHECK(tok.encode("\xff").empty());
}

TEST_CASE("token ids from tokenizer data without an added tokens list follow token types",
          "[unit]") {
  // GGUF files carry no added_tokens: control and user_defined types mark them.
  TokenizerData d = tiny_data({{"a", "b"}});
  Tokenizer typed(d);
  d.token_types.clear();  // all normal: "<|s|>" is text now
  Tokenizer untyped(d);
  CHECK(typed.encode("ab<|s|>").size() == 2);
  CHECK(untyped.encode("ab<|s|>") == Ids{untyped.token_to_id("ab"), '<', '|', 's', '|', '>'});
  CHECK_FALSE(untyped.is_special(d.eos_id));
}

TEST_CASE("smollm2 encodings match hugging face for 250 strings and four pre-tokenizers",
          "[interop]") {
  const TokenizerData data = tokenizer_data_from_hf(golden_dir().string());
  const json golden = json::parse(std::ifstream(golden_dir() / "encodings.json"));
  const auto& encodings = golden.at("encodings");
  REQUIRE(encodings.size() == 50);
  CHECK(data.pre == "gpt2");  // transformers' GGUF conversion writes a plain ByteLevel
  CHECK(data.tokens.size() == 49152);
  Tokenizer tok(data);
  CHECK(tok.bos_id() == tok.token_to_id("<|im_start|>"));
  CHECK(tok.eos_id() == tok.token_to_id("<|im_end|>"));
  CHECK(tok.is_special(tok.eos_id()));
  CHECK_FALSE(data.chat_template.empty());
  TokenizerData smollm_data = data;
  smollm_data.pre = "smollm";  // the hub's Digits(individual_digits) + ByteLevel
  Tokenizer smollm(smollm_data);
  // The same vocabulary behind the Llama 3 and Qwen2 regexes (HF Split + ByteLevel goldens).
  smollm_data.pre = "llama-bpe";
  Tokenizer llama3(smollm_data);
  smollm_data.pre = "qwen2";
  Tokenizer qwen2(smollm_data);
  // The 50 chosen strings, then 200 seeded random ones that mix Unicode whitespace, digits of
  // other scripts, combining marks and contractions (where PCRE2 and Oniguruma could differ).
  json all = encodings;
  for (const auto& e : golden.at("random")) all.push_back(e);
  REQUIRE(all.size() == 250);
  for (const auto& e : all) {
    const std::string text = e.at("text");
    INFO("text: " << json(text).dump());
    const Ids ids = tok.encode(text);
    CHECK(ids == e.at("ids").get<Ids>());
    CHECK(tok.decode(ids) == text);
    CHECK(smollm.encode(text) == e.at("ids_smollm").get<Ids>());
    CHECK(llama3.encode(text) == e.at("ids_llama3_regex").get<Ids>());
    CHECK(qwen2.encode(text) == e.at("ids_qwen2_regex").get<Ids>());
  }
}

TEST_CASE("smollm2 decode of encode gives back random unicode text", "[interop]") {
  Tokenizer tok(tokenizer_data_from_hf(golden_dir().string()));
  // SmolLM2 has no token for 21 bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1,
  // 0xf2, 0xf5..0xff): HF and tandem drop them. HF's ids for "x\U0008071by" (tokenizers 0.23):
  CHECK(tok.encode("x\xf2\x80\x9c\x9by") == Ids{104, 218, 246, 245, 105});
  CHECK(tok.encode("a\x04"
                   "b") == Ids{tok.token_to_id("a"), tok.token_to_id("b")});
  // Code points from ASCII, Latin-1, Cyrillic, CJK, Hangul, emoji and the supplementary planes.
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x20, 0x7E},       {0x09, 0x0D},       {0xA0, 0xFF},
      {0x400, 0x4FF},     {0x4E00, 0x9FFF},   {0xAC00, 0xD7A3},
      {0x1F300, 0x1F6FF}, {0x10000, 0x3FFFF}, {0xC0000, 0x10FFFF}};
  std::mt19937 rng(99);
  for (int round = 0; round < 100; ++round) {
    std::string s;
    const int n = static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      const auto& [lo, hi] = ranges[rng() % ranges.size()];
      uint32_t cp = lo + rng() % (hi - lo + 1);
      if (cp < 0x80) {
        s += char(cp);
      } else if (cp < 0x800) {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        s += char(0xE0 | (cp >> 12));
        s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
      } else {
        s += char(0xF0 | (cp >> 18));
        s += char(0x80 | ((cp >> 12) & 0x3F));
        s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
      }
    }
    INFO("round " << round);
    CHECK(tok.decode(tok.encode(s)) == s);
  }
}

TEST_CASE("smollm2 tokenizer written by tandem encodes as the original", "[interop]") {
  TempDir dir("tok-smollm2");
  const TokenizerData data = tokenizer_data_from_hf(golden_dir().string());
  write_hf_tokenizer_files(data, dir.path.string());
  const TokenizerData back = tokenizer_data_from_hf(dir.path.string());
  CHECK(back.tokens == data.tokens);
  CHECK(back.merges == data.merges);
  CHECK(back.token_types == data.token_types);
  CHECK(back.chat_template == data.chat_template);
  CHECK(back.bos_id == data.bos_id);
  CHECK(back.eos_id == data.eos_id);
  Tokenizer a(data);
  Tokenizer b(back);
  const json golden = json::parse(std::ifstream(golden_dir() / "encodings.json"));
  for (const auto& e : golden.at("encodings"))
    CHECK(b.encode(e.at("text").get<std::string>()) == a.encode(e.at("text").get<std::string>()));
}

TEST_CASE("smollm2 tokenizer data laid out as the gguf file has it encodes as hugging face",
          "[interop]") {
  // What tokenizer_data_from_gguf fills from tokenizer.ggml.*: the same tokens and merges (the
  // golden script checks that), token types instead of an added-token list, pre "smollm".
  const json meta = json::parse(std::ifstream(golden_dir() / "gguf_tokenizer.json"));
  TokenizerData from_json = tokenizer_data_from_hf(golden_dir().string());
  TokenizerData d;
  d.model = meta.at("ggml.model");
  d.pre = meta.at("ggml.pre");
  d.tokens = from_json.tokens;
  d.merges = from_json.merges;
  d.token_types.assign(d.tokens.size(), TokenType::normal);
  for (const auto& [id, type] : meta.at("ggml.token_type_not_normal").items())
    d.token_types.at(std::stoi(id)) = static_cast<TokenType>(type.get<int32_t>());
  d.bos_id = meta.at("ggml.bos_token_id");
  d.eos_id = meta.at("ggml.eos_token_id");
  d.pad_id = meta.at("ggml.padding_token_id");
  d.unk_id = meta.at("ggml.unknown_token_id");
  d.add_bos = meta.at("ggml.add_bos_token");
  CHECK(d.pre == "smollm");
  CHECK(d.token_types == from_json.token_types);  // the 17 specials are control tokens in both
  Tokenizer tok(std::move(d));
  CHECK(tok.bos_id() == from_json.bos_id);
  CHECK(tok.eos_id() == from_json.eos_id);
  const json golden = json::parse(std::ifstream(golden_dir() / "encodings.json"));
  for (const auto& e : golden.at("encodings")) {
    const std::string text = e.at("text");
    INFO("text: " << text);
    CHECK(tok.encode(text) == e.at("ids_smollm").get<Ids>());
  }
}
