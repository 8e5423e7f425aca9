// Tests of model/gguf: GGUF files written here by a tiny writer, read back, loaded as models, and
// broken in every way a file can be; plus the committed golden file and the real SmolLM2 model.
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "core/half.h"
#include "model/gguf.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::model;

namespace {

const std::filesystem::path kRepo = std::filesystem::path(TANDEM_SOURCE_DIR);

// A directory of this process's test files, removed when the tests end.
struct TempDir {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("tandem-test-gguf-" + std::to_string(::getpid()));
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
};
const TempDir kTempDir;

std::string temp_path(const std::string& name) {
  std::filesystem::create_directories(kTempDir.dir);
  return (kTempDir.dir / name).string();
}

// A minimal GGUF writer, following the GGUF spec (docs/gguf.md in ggml) independently of the
// reader.
class Writer {
 public:
  uint32_t version = 3;
  uint32_t magic = 0x46554747;
  uint64_t alignment = 32;

  template <class T>
  void scalar(const std::string& key, GgufType t, T v) {
    header(key, t);
    put(kv_, v);
  }
  void str(const std::string& key, const std::string& s) {
    header(key, GgufType::string);
    put_string(kv_, s);
  }
  template <class T>
  void array(const std::string& key, GgufType et, const std::vector<T>& v) {
    header(key, GgufType::array);
    put(kv_, static_cast<uint32_t>(et));
    put(kv_, static_cast<uint64_t>(v.size()));
    for (const T& x : v) put(kv_, x);
  }
  void string_array(const std::string& key, const std::vector<std::string>& v) {
    header(key, GgufType::array);
    put(kv_, static_cast<uint32_t>(GgufType::string));
    put(kv_, static_cast<uint64_t>(v.size()));
    for (const std::string& s : v) put_string(kv_, s);
  }
  void tensor(const std::string& name, std::vector<int64_t> ne, uint32_t type,
              std::vector<uint8_t> data) {
    tensors_.push_back({name, std::move(ne), type, std::move(data)});
  }
  void tensor_f32(const std::string& name, std::vector<int64_t> ne, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    tensor(name, std::move(ne), 0, std::move(b));
  }

  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out;
    put(out, magic);
    put(out, version);
    put(out, static_cast<uint64_t>(tensors_.size()));
    put(out, n_kv_);
    out.insert(out.end(), kv_.begin(), kv_.end());
    uint64_t offset = 0;
    std::vector<uint64_t> offsets;
    for (const T& t : tensors_) {
      put_string(out, t.name);
      put(out, static_cast<uint32_t>(t.ne.size()));
      for (int64_t n : t.ne) put(out, static_cast<uint64_t>(n));
      put(out, t.type);
      put(out, offset);
      offsets.push_back(offset);
      offset = (offset + t.data.size() + alignment - 1) / alignment * alignment;
    }
    out.resize((out.size() + alignment - 1) / alignment * alignment);
    const size_t data = out.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(data + offsets[i]);
      out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
    }
    return out;
  }
  std::string write(const std::string& name) const { return write_bytes(name, bytes()); }
  static std::string write_bytes(const std::string& name, const std::vector<uint8_t>& b) {
    const std::string path = temp_path(name);
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return path;
  }

 private:
  struct T {
    std::string name;
    std::vector<int64_t> ne;
    uint32_t type;
    std::vector<uint8_t> data;
  };
  template <class V>
  static void put(std::vector<uint8_t>& b, V v) {
    const size_t n = b.size();
    b.resize(n + sizeof(V));
    std::memcpy(b.data() + n, &v, sizeof(V));
  }
  static void put_string(std::vector<uint8_t>& b, const std::string& s) {
    put(b, static_cast<uint64_t>(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
  void header(const std::string& key, GgufType t) {
    put_string(kv_, key);
    put(kv_, static_cast<uint32_t>(t));
    ++n_kv_;
  }

  std::vector<uint8_t> kv_;
  uint64_t n_kv_ = 0;
  std::vector<T> tensors_;
};

std::vector<float> values(const Tensor& t) {
  const std::vector<double> d = test::to_f64(t);
  return std::vector<float>(d.begin(), d.end());
}

// A small file with one of each metadata type and one tensor.
Writer metadata_writer() {
  Writer w;
  w.scalar("t.u8", GgufType::u8, uint8_t{200});
  w.scalar("t.i8", GgufType::i8, int8_t{-100});
  w.scalar("t.u16", GgufType::u16, uint16_t{60000});
  w.scalar("t.i16", GgufType::i16, int16_t{-30000});
  w.scalar("t.u32", GgufType::u32, uint32_t{4000000000u});
  w.scalar("t.i32", GgufType::i32, int32_t{-2000000000});
  w.scalar("t.u64", GgufType::u64, uint64_t{1} << 40);
  w.scalar("t.i64", GgufType::i64, int64_t{-(int64_t{1} << 50)});
  w.scalar("t.f32", GgufType::f32, 1.25f);
  w.scalar("t.f64", GgufType::f64, -1e-300);
  w.scalar("t.bool", GgufType::boolean, uint8_t{1});
  w.str("t.string", "héllo wörld");
  w.array("t.i32s", GgufType::i32, std::vector<int32_t>{3, -1, 4});
  w.array("t.u8s", GgufType::u8, std::vector<uint8_t>{1, 255});
  w.array("t.f32s", GgufType::f32, std::vector<float>{0.5f, -2.0f});
  w.array("t.f64s", GgufType::f64, std::vector<double>{1e100});
  w.array("t.bools", GgufType::boolean, std::vector<uint8_t>{0, 1, 1});
  w.string_array("t.strings", {"a b", "", "ĠĠ"});
  w.array("t.empty", GgufType::i64, std::vector<int64_t>{});
  w.tensor_f32("w", {3, 2}, {1, 2, 3, 4, 5, 6});
  return w;
}

}  // namespace

TEST_CASE("gguf reads every metadata type and a tensor back", "[unit]") {
  const std::string path = metadata_writer().write("meta.gguf");
  GgufFile f(path);
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.keys().size() == 19);
  CHECK(f.get_int("t.u8") == 200);
  CHECK(f.get_int("t.i8") == -100);
  CHECK(f.get_int("t.u16") == 60000);
  CHECK(f.get_int("t.i16") == -30000);
  CHECK(f.get_int("t.u32") == 4000000000);
  CHECK(f.get_int("t.i32") == -2000000000);
  CHECK(f.get_int("t.u64") == int64_t{1} << 40);
  CHECK(f.get_int("t.i64") == -(int64_t{1} << 50));
  CHECK(f.get_float("t.f32") == 1.25);
  CHECK(f.get_float("t.f64") == -1e-300);
  CHECK(f.get_float("t.u8") == 200.0);
  CHECK(f.get_bool("t.bool"));
  CHECK(f.get_string("t.string") == "héllo wörld");
  CHECK(f.get_int_array("t.i32s") == std::vector<int64_t>{3, -1, 4});
  CHECK(f.get_int_array("t.u8s") == std::vector<int64_t>{1, 255});
  CHECK(f.get_float_array("t.f32s") == std::vector<double>{0.5, -2.0});
  CHECK(f.get_float_array("t.f64s") == std::vector<double>{1e100});
  CHECK(f.at("t.bools").ints == std::vector<int64_t>{0, 1, 1});
  CHECK(f.at("t.bools").is_array());
  CHECK(f.get_string_array("t.strings") == std::vector<std::string>{"a b", "", "ĠĠ"});
  CHECK(f.get_int_array("t.empty").empty());
  CHECK(!f.find_string("nope").has_value());
  CHECK(!f.find_int("nope").has_value());
  CHECK(!f.find_float("nope").has_value());
  CHECK(!f.find_bool("nope").has_value());
  CHECK(f.find_string_array("nope") == nullptr);
  CHECK(f.find_int_array("nope") == nullptr);
  CHECK(!f.find_float_array("nope").has_value());
  CHECK(f.find_int("t.i8") == -100);

  REQUIRE_THROWS_WITH(f.get_int("nope"), Catch::Contains(path) && Catch::Contains("'nope'") &&
                                             Catch::Contains("missing"));
  REQUIRE_THROWS_WITH(f.get_string("t.i32"), Catch::Contains(path) && Catch::Contains("'t.i32'") &&
                                                 Catch::Contains("is i32, expected a string"));
  REQUIRE_THROWS_WITH(f.get_int("t.string"), Catch::Contains("'t.string' is string"));
  REQUIRE_THROWS_WITH(f.get_bool("t.u8"), Catch::Contains("'t.u8' is u8, expected a bool"));
  REQUIRE_THROWS_WITH(f.get_int_array("t.strings"),
                      Catch::Contains("'t.strings' is array of string"));
  REQUIRE_THROWS_WITH(f.get_string_array("t.string"), Catch::Contains("'t.string'"));
  REQUIRE_THROWS_WITH(f.get_int("t.i32s"), Catch::Contains("array of i32, expected an integer"));

  REQUIRE(f.tensors().size() == 1);
  const GgufTensorInfo& t = f.tensor("w");
  CHECK(t.ne == std::vector<int64_t>{3, 2});
  CHECK(t.shape() == Shape{2, 3});
  CHECK(t.type == GgmlType::f32);
  CHECK(t.nbytes == 24);
  Tensor out = Tensor::empty({2, 3}, DType::f32);
  f.read_tensor(t, out);
  CHECK(values(out) == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(f.find_tensor("x") == nullptr);
  REQUIRE_THROWS_WITH(f.tensor("x"), Catch::Contains(path) && Catch::Contains("'x' is missing"));
}

TEST_CASE("gguf honours general alignment and version 2", "[unit]") {
  Writer w;
  w.version = 2;
  w.alignment = 64;
  w.scalar("general.alignment", GgufType::u32, uint32_t{64});
  w.tensor_f32("a", {5}, {1, 2, 3, 4, 5});
  w.tensor_f32("b", {2, 1}, {-7, 8});
  GgufFile f(w.write("align.gguf"));
  CHECK(f.version() == 2);
  CHECK(f.alignment() == 64);
  CHECK(f.tensor("b").offset == 64);
  Tensor out = Tensor::empty({2}, DType::f32);
  f.read_tensor(f.tensor("b"), out);
  CHECK(values(out) == std::vector<float>{-7, 8});
}

TEST_CASE("gguf rejects a truncated file at every length naming the file", "[unit]") {
  const std::vector<uint8_t> full = metadata_writer().bytes();
  const std::string path = temp_path("cut.gguf");
  for (size_t n = 0; n < full.size(); n += (n < 64 ? 1 : 7)) {
    Writer::write_bytes("cut.gguf", std::vector<uint8_t>(full.begin(), full.begin() + n));
    INFO("cut at " << n << " of " << full.size());
    REQUIRE_THROWS_WITH(GgufFile(path), Catch::Contains(path) && (Catch::Contains("truncated") ||
                                                                  Catch::Contains("empty")));
  }
  REQUIRE_THROWS_WITH(GgufFile(temp_path("absent.gguf")), Catch::Contains("absent.gguf"));
}

TEST_CASE("gguf rejects bad magic version types offsets and duplicates", "[unit]") {
  auto fails = [](const Writer& w, const std::string& what) {
    const std::string path = w.write("bad.gguf");
    REQUIRE_THROWS_WITH(GgufFile(path), Catch::Contains(path) && Catch::Contains(what));
  };
  Writer w = metadata_writer();
  w.magic = 0x46554746;
  fails(w, "bad magic");
  w = metadata_writer();
  w.version = 4;
  fails(w, "version 4");
  w = metadata_writer();
  w.tensor("q", {32}, 99, std::vector<uint8_t>(18));
  fails(w, "tensor 'q' has unknown ggml type 99");
  w = metadata_writer();
  w.scalar("t.weird", static_cast<GgufType>(13), uint32_t{0});
  fails(w, "key 't.weird' has unknown value type 13");
  w = metadata_writer();
  w.tensor("q4", {48}, 2, std::vector<uint8_t>(27));
  fails(w, "tensor 'q4': row length 48 is not a multiple of the Q4_0 block size 32");
  w = metadata_writer();
  w.scalar("t.u8", GgufType::u8, uint8_t{1});
  fails(w, "key 't.u8' appears twice");
  w = metadata_writer();
  w.tensor_f32("w", {1}, {1});
  fails(w, "tensor 'w' appears twice");
  w = metadata_writer();
  w.scalar("t.b2", GgufType::boolean, uint8_t{2});
  fails(w, "key 't.b2': a bool must be 0 or 1");

  // A tensor whose data runs past the end: a big tensor info with too little data.
  w = metadata_writer();
  w.tensor("big", {64, 4}, 0, std::vector<uint8_t>(16));
  fails(w, "tensor 'big'");
  const std::string path = w.write("bad.gguf");
  REQUIRE_THROWS_WITH(GgufFile(path), Catch::Contains("extends past the end"));
}

// ---------------------------------------------------------------------------------------------
// Models.

namespace {

ModelConfig tiny_config(Architecture arch, bool tied) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 16;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 128;
  c.rms_norm_eps = 1e-6f;
  c.rope.theta = 50000.0f;
  c.tie_word_embeddings = tied;
  c.attention_bias = arch == Architecture::qwen2;
  c.qk_norm = arch == Architecture::qwen3;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

// llama.cpp convert_hf_to_gguf.py permute(): w.reshape(n_head, 2, rows / n_head / 2, cols)
// .swapaxes(1, 2).reshape(w.shape), for the rows of an HF q or k weight.
std::vector<float> llama_permute(const std::vector<float>& w, int64_t n_head, int64_t cols) {
  const int64_t rows = static_cast<int64_t>(w.size()) / cols, half = rows / n_head / 2;
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t a = 0; a < 2; ++a)
      for (int64_t i = 0; i < half; ++i)
        for (int64_t c = 0; c < cols; ++c)  // out[h][i][a] = in[h][a][i]
          out[static_cast<size_t>(((h * half + i) * 2 + a) * cols + c)] =
              w[static_cast<size_t>(((h * 2 + a) * half + i) * cols + c)];
  return out;
}

// Weights with seeded random values; ffn_down of layer 1 holds f16-exact values and ffn_up of
// layer 0 multiples of 1/128 in [-1, 1] (stored as F16 and Q8_0 below, so decoding is exact).
std::unique_ptr<Weights> random_weights(const ModelConfig& c) {
  auto w = std::make_unique<Weights>(c, DType::f32);
  uint64_t seed = 100;
  for (const NamedTensor& nt : w->named()) {
    Tensor t = nt.tensor;
    t.copy_from(test::random_tensor(t.shape(), DType::f32, ++seed));
    float* p = nt.tensor.data_as<float>();
    if (nt.name == "model.layers.1.mlp.down_proj.weight")
      for (int64_t i = 0; i < nt.tensor.numel(); ++i) p[i] = static_cast<float>(f16(p[i]));
    if (nt.name == "model.layers.0.mlp.up_proj.weight")
      for (int64_t i = 0; i < nt.tensor.numel(); ++i)
        p[i] = std::round(p[i] * 127) / 128 + 0.0f;  // no -0
  }
  return w;
}

std::vector<uint8_t> encode_q8_0(const std::vector<float>& v) {  // d = 1/128
  std::vector<uint8_t> b;
  for (size_t i = 0; i < v.size(); i += 32) {
    const uint16_t d = f32_to_f16_bits(1.0f / 128);
    b.push_back(static_cast<uint8_t>(d & 0xff));
    b.push_back(static_cast<uint8_t>(d >> 8));
    for (size_t j = 0; j < 32; ++j)
      b.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::lround(v[i + j] * 128))));
  }
  return b;
}

// Hook to break a tensor while writing: may rename it, change its dims or type, or drop it.
using Edit = std::function<bool(std::string& name, std::vector<int64_t>& ne, uint32_t& type)>;

Writer model_writer(const Weights& ref, const Edit& edit = {}) {
  const ModelConfig& c = ref.config();
  const std::string a = architecture_name(c.arch);
  Writer w;
  w.str("general.architecture", a);
  w.scalar(a + ".block_count", GgufType::u32, static_cast<uint32_t>(c.num_layers));
  w.scalar(a + ".context_length", GgufType::u32, static_cast<uint32_t>(c.max_position_embeddings));
  w.scalar(a + ".embedding_length", GgufType::u32, static_cast<uint32_t>(c.hidden_size));
  w.scalar(a + ".feed_forward_length", GgufType::u32, static_cast<uint32_t>(c.intermediate_size));
  w.scalar(a + ".attention.head_count", GgufType::u32, static_cast<uint32_t>(c.num_heads));
  w.scalar(a + ".attention.head_count_kv", GgufType::u32, static_cast<uint32_t>(c.num_kv_heads));
  w.scalar(a + ".attention.key_length", GgufType::u32, static_cast<uint32_t>(c.head_dim));
  w.scalar(a + ".rope.freq_base", GgufType::f32, c.rope.theta);
  w.scalar(a + ".attention.layer_norm_rms_epsilon", GgufType::f32, c.rms_norm_eps);
  w.str("tokenizer.ggml.model", "gpt2");
  w.str("tokenizer.ggml.pre", "smollm");
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int64_t i = 0; i < c.vocab_size; ++i) {
    tokens.push_back(i < 3 ? fmt::format("<|s{}|>", i)
                           : std::string(1, static_cast<char>('a' + i)));
    types.push_back(i < 3 ? 3 : 1);
  }
  w.string_array("tokenizer.ggml.tokens", tokens);
  w.array("tokenizer.ggml.token_type", GgufType::i32, types);
  w.string_array("tokenizer.ggml.merges", {"d e", "de f", "Ġ Ġa b"});
  w.scalar("tokenizer.ggml.bos_token_id", GgufType::u32, uint32_t{1});
  w.scalar("tokenizer.ggml.eos_token_id", GgufType::u32, uint32_t{2});
  w.scalar("tokenizer.ggml.padding_token_id", GgufType::u32, uint32_t{0});
  w.scalar("tokenizer.ggml.add_bos_token", GgufType::boolean, uint8_t{1});
  w.str("tokenizer.chat_template", "{{ messages }}");
  for (const NamedTensor& nt : ref.named()) {
    std::string name = gguf_tensor_name(nt.name);
    const Shape& s = nt.tensor.shape();
    std::vector<int64_t> ne;
    for (int d = s.ndim() - 1; d >= 0; --d) ne.push_back(s[d]);
    std::vector<float> v = values(nt.tensor);
    const bool is_q = nt.name.ends_with("q_proj.weight"), is_k = nt.name.ends_with("k_proj.weight");
    if (c.arch == Architecture::llama && (is_q || is_k))
      v = llama_permute(v, is_q ? c.num_heads : c.num_kv_heads, c.hidden_size);
    uint32_t type = 0;
    std::vector<uint8_t> data(v.size() * 4);
    std::memcpy(data.data(), v.data(), data.size());
    if (nt.name == "model.layers.1.mlp.down_proj.weight") {
      type = 1;
      data.clear();
      for (float x : v)
        for (int k = 0; k < 2; ++k)
          data.push_back(static_cast<uint8_t>(f32_to_f16_bits(x) >> (8 * k)));
    } else if (nt.name == "model.layers.0.mlp.up_proj.weight") {
      type = 8;
      data = encode_q8_0(v);
    }
    if (edit && !edit(name, ne, type)) continue;
    w.tensor(name, ne, type, std::move(data));
  }
  return w;
}

void check_same_weights(const Weights& got, const Weights& want) {
  REQUIRE(got.named().size() == want.named().size());
  for (size_t i = 0; i < got.named().size(); ++i) {
    INFO(want.named()[i].name);
    REQUIRE(got.named()[i].name == want.named()[i].name);
    CHECK(test::bitwise_equal(got.named()[i].tensor, want.named()[i].tensor));
  }
}

}  // namespace

TEST_CASE("gguf tensor names map to Hugging Face names", "[unit]") {
  const std::pair<const char*, const char*> names[] = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
      {"model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"},
      {"model.layers.12.self_attn.q_proj.weight", "blk.12.attn_q.weight"},
      {"model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"},
      {"model.layers.1.self_attn.v_proj.weight", "blk.1.attn_v.weight"},
      {"model.layers.1.self_attn.q_proj.bias", "blk.1.attn_q.bias"},
      {"model.layers.1.self_attn.k_proj.bias", "blk.1.attn_k.bias"},
      {"model.layers.1.self_attn.v_proj.bias", "blk.1.attn_v.bias"},
      {"model.layers.1.self_attn.o_proj.weight", "blk.1.attn_output.weight"},
      {"model.layers.1.self_attn.q_norm.weight", "blk.1.attn_q_norm.weight"},
      {"model.layers.1.self_attn.k_norm.weight", "blk.1.attn_k_norm.weight"},
      {"model.layers.1.post_attention_layernorm.weight", "blk.1.ffn_norm.weight"},
      {"model.layers.29.mlp.gate_proj.weight", "blk.29.ffn_gate.weight"},
      {"model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"},
      {"model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"},
  };
  for (const auto& [hf, g] : names) CHECK(gguf_tensor_name(hf) == g);
  REQUIRE_THROWS_WITH(gguf_tensor_name("model.layers.1.mlp.zz"), Catch::Contains("mlp.zz"));
}

TEST_CASE("gguf llama q k row map undoes the llama.cpp permutation", "[unit]") {
  // D = 4: HF rows (pair firsts x0 x1, pair seconds y0 y1) are stored as x0 y0 x1 y1.
  CHECK(llama_qk_gguf_to_hf_rows(1, 4) == std::vector<int64_t>{0, 2, 1, 3});
  for (auto [heads, dim] : {std::pair<int64_t, int64_t>{3, 64}, {9, 64}, {2, 8}}) {
    std::vector<float> hf(static_cast<size_t>(heads * dim * 3));
    for (size_t i = 0; i < hf.size(); ++i) hf[i] = static_cast<float>(i);
    const std::vector<float> g = llama_permute(hf, heads, 3);
    const std::vector<int64_t> map = llama_qk_gguf_to_hf_rows(heads, dim);
    std::vector<float> back(hf.size());
    for (size_t r = 0; r < map.size(); ++r)
      for (size_t c = 0; c < 3; ++c) back[static_cast<size_t>(map[r]) * 3 + c] = g[r * 3 + c];
    CHECK(back == hf);
    CHECK(g != hf);
  }
}

TEST_CASE("gguf loads llama qwen2 and qwen3 models exactly with config and tokenizer", "[unit]") {
  for (auto [arch, tied] : {std::pair{Architecture::llama, true},
                            {Architecture::llama, false},
                            {Architecture::qwen2, false},
                            {Architecture::qwen3, true}}) {
    INFO(architecture_name(arch) << " tied " << tied);
    const ModelConfig c = tiny_config(arch, tied);
    const auto ref = random_weights(c);
    const std::string path = model_writer(*ref).write("model.gguf");
    GgufModel m = load_gguf_model(path, DType::f32);
    CHECK(m.config.arch == arch);
    CHECK(m.config.vocab_size == 16);
    CHECK(m.config.hidden_size == 32);
    CHECK(m.config.intermediate_size == 64);
    CHECK(m.config.num_layers == 2);
    CHECK(m.config.num_heads == 4);
    CHECK(m.config.num_kv_heads == 2);
    CHECK(m.config.head_dim == 8);
    CHECK(m.config.max_position_embeddings == 128);
    CHECK(m.config.rms_norm_eps == 1e-6f);
    CHECK(m.config.rope.theta == 50000.0f);
    CHECK(m.config.rope.factor == 0.0f);
    CHECK(m.config.tie_word_embeddings == tied);
    CHECK(m.config.attention_bias == (arch == Architecture::qwen2));
    CHECK(m.config.qk_norm == (arch == Architecture::qwen3));
    CHECK(m.config.bos_token_id == 1);
    CHECK(m.config.eos_token_ids == std::vector<int32_t>{2});
    check_same_weights(*m.weights, *ref);

    const TokenizerData& t = m.tokenizer;
    CHECK(t.model == "gpt2");
    CHECK(t.pre == "smollm");
    CHECK(t.tokens.size() == 16);
    CHECK(t.tokens[1] == "<|s1|>");
    CHECK(t.tokens[5] == "f");
    CHECK(t.token_types[0] == TokenType::control);
    CHECK(t.token_types[7] == TokenType::normal);
    REQUIRE(t.merges.size() == 3);
    CHECK(t.merges[1] == std::pair<std::string, std::string>{"de", "f"});
    CHECK(t.merges[2] == std::pair<std::string, std::string>{"Ġ", "Ġa b"});
    CHECK(t.bos_id == 1);
    CHECK(t.eos_id == 2);
    CHECK(t.pad_id == 0);
    CHECK(t.unk_id == -1);
    CHECK(t.add_bos);
    CHECK(t.chat_template == "{{ messages }}");

    if (arch == Architecture::qwen2) {  // bf16 loading: the f32 values rounded once
      ModelConfig c2;
      auto w16 = load_gguf(path, DType::bf16, &c2);
      CHECK(c2.attention_bias);
      Weights want(c, DType::bf16);
      want.copy_from(*ref);
      check_same_weights(*w16, want);
    }
  }
}

TEST_CASE("gguf model loading names the tensor for missing extra misshapen and unsupported",
          "[unit]") {
  const ModelConfig c = tiny_config(Architecture::llama, false);
  const auto ref = random_weights(c);
  auto fails = [&](const Edit& edit, std::initializer_list<const char*> parts) {
    const std::string path = model_writer(*ref, edit).write("broken.gguf");
    try {
      load_gguf_model(path);
      FAIL("no error");
    } catch (const Error& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find(path) != std::string::npos);
      for (const char* p : parts) CHECK(msg.find(p) != std::string::npos);
    }
  };
  fails([](std::string& n, auto&, auto&) { return n != "blk.1.ffn_gate.weight"; },
        {"'blk.1.ffn_gate.weight'", "model.layers.1.mlp.gate_proj.weight", "missing"});
  fails(
      [](std::string& n, auto&, auto&) {
        if (n == "blk.0.attn_v.weight") n = "blk.0.attn_vv.weight";
        return true;
      },
      {"'blk.0.attn_v.weight'", "missing"});
  fails(
      [](std::string& n, std::vector<int64_t>& ne, auto&) {
        if (n == "blk.1.attn_k.weight") std::swap(ne[0], ne[1]);
        return true;
      },
      {"'blk.1.attn_k.weight'", "has shape (32, 16)", "expected (16, 32)"});
  fails(
      [](std::string& n, auto&, uint32_t& type) {
        if (n == "blk.0.attn_output.weight") type = 6;  // Q5_0
        return true;
      },
      {"'blk.0.attn_output.weight'", "Q5_0", "not supported"});
  // An extra tensor this model does not have.
  Writer w = model_writer(*ref);
  w.tensor_f32("blk.2.attn_norm.weight", {32}, std::vector<float>(32, 1.0f));
  const std::string path = w.write("extra.gguf");
  REQUIRE_THROWS_WITH(load_gguf_model(path), Catch::Contains(path) &&
                                                 Catch::Contains("'blk.2.attn_norm.weight'") &&
                                                 Catch::Contains("not a parameter"));
}

TEST_CASE("gguf config rejects unknown architectures and reads Llama-3 rope_freqs", "[unit]") {
  const ModelConfig c = tiny_config(Architecture::llama, true);
  const auto ref = random_weights(c);
  {
    Writer w;
    w.str("general.architecture", "gpt2");
    const std::string path = w.write("arch.gguf");
    GgufFile f(path);
    REQUIRE_THROWS_WITH(
        config_from_gguf(f),
        Catch::Contains(path) && Catch::Contains("'general.architecture' is 'gpt2'"));
  }
  // Llama 3.x factors for D = 8, theta 50000, factor 8, original context 8192.
  ops::RopeParams p;
  p.theta = 50000.0f;
  p.factor = 8;
  std::vector<float> factors;
  const double low = 8192 / 1.0, high = 8192 / 4.0;
  for (int i = 0; i < 8; i += 2) {
    const double wavelen = 2 * std::numbers::pi * std::pow(50000.0, i / 8.0);
    if (wavelen < high) {
      factors.push_back(1.0f);
    } else if (wavelen > low) {
      factors.push_back(8.0f);
    } else {
      const double smooth = (8192 / wavelen - 1.0) / 3.0;
      factors.push_back(static_cast<float>(1.0 / ((1 - smooth) / 8 + smooth)));
    }
  }
  REQUIRE(factors.back() == 8.0f);
  {
    Writer w = model_writer(*ref);
    w.tensor_f32("rope_freqs.weight", {4}, factors);
    GgufModel m = load_gguf_model(w.write("rope.gguf"));
    CHECK(m.config.rope.factor == 8.0f);
    CHECK(m.config.rope.low_freq_factor == 1.0f);
    CHECK(m.config.rope.high_freq_factor == 4.0f);
    CHECK(m.config.rope.original_max_position == 8192);
    check_same_weights(*m.weights, *ref);
  }
  {
    factors[1] *= 1.5f;
    Writer w = model_writer(*ref);
    w.tensor_f32("rope_freqs.weight", {4}, factors);
    const std::string path = w.write("rope.gguf");
    REQUIRE_THROWS_WITH(load_gguf_model(path), Catch::Contains(path) &&
                                                   Catch::Contains("'rope_freqs.weight' entry 1") &&
                                                   Catch::Contains("not supported"));
  }
}

TEST_CASE("gguf tokenizer data rejects bad merges ids and token types naming the key", "[unit]") {
  auto tokenizer_writer = [] {
    Writer w;
    w.str("tokenizer.ggml.model", "gpt2");
    w.string_array("tokenizer.ggml.tokens", {"a", "b", "ab"});
    return w;
  };
  {
    Writer w = tokenizer_writer();
    GgufFile f(w.write("tok.gguf"));
    const TokenizerData t = tokenizer_data_from_gguf(f);
    CHECK(t.tokens.size() == 3);
    CHECK(t.token_types.empty());
    CHECK(t.merges.empty());
    CHECK(t.bos_id == -1);
    CHECK(!t.add_bos);
  }
  auto fails = [](const Writer& w, std::initializer_list<const char*> parts) {
    const std::string path = w.write("tok.gguf");
    GgufFile f(path);
    try {
      tokenizer_data_from_gguf(f);
      FAIL("no error");
    } catch (const Error& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find(path) != std::string::npos);
      for (const char* p : parts) CHECK(msg.find(p) != std::string::npos);
    }
  };
  Writer w = tokenizer_writer();
  w.string_array("tokenizer.ggml.merges", {"a b", "ab"});
  fails(w, {"'tokenizer.ggml.merges' entry 1 is 'ab'"});
  w = tokenizer_writer();
  w.scalar("tokenizer.ggml.eos_token_id", GgufType::u32, uint32_t{3});
  fails(w, {"'tokenizer.ggml.eos_token_id' is 3", "[0, 3)"});
  w = tokenizer_writer();
  w.array("tokenizer.ggml.token_type", GgufType::i32, std::vector<int32_t>{1, 9, 1});
  fails(w, {"'tokenizer.ggml.token_type' entry 1 is 9"});
  w = tokenizer_writer();
  w.array("tokenizer.ggml.token_type", GgufType::i32, std::vector<int32_t>{1});
  fails(w, {"'tokenizer.ggml.token_type' has 1 entries, expected 3"});
  w = Writer();
  w.str("tokenizer.ggml.model", "llama");
  fails(w, {"'tokenizer.ggml.model' is 'llama', expected 'gpt2'"});
}

TEST_CASE("gguf quant decoders match the gguf Python package reference exactly", "[interop]") {
  const std::string path = (kRepo / "tests" / "golden" / "quants.gguf").string();
  GgufFile f(path);
  int checked = 0;
  for (const char* name : {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"}) {
    INFO(name);
    const GgufTensorInfo& t = f.tensor(name);
    const GgufTensorInfo& e = f.tensor(std::string(name) + ".expected");
    REQUIRE(t.shape() == e.shape());
    std::string upper = name;
    for (char& ch : upper) ch = static_cast<char>(std::toupper(ch));
    CHECK(ggml_type_name(static_cast<uint32_t>(t.type)) == upper);
    Tensor got = Tensor::empty(t.shape(), DType::f32), want = Tensor::empty(e.shape(), DType::f32);
    f.read_tensor(t, got);
    f.read_tensor(e, want);
    CHECK(test::max_abs_diff(test::to_f64(got), test::to_f64(want)) == 0.0);
    CHECK(test::max_abs(test::to_f64(want)) > 0.1);
    ++checked;
  }
  CHECK(checked == 8);
}

TEST_CASE("gguf loads SmolLM2-135M-Instruct Q4_1", "[interop]") {
  const std::string path = (kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
  if (!std::filesystem::exists(path)) {
    WARN("skipped: " << path << " is missing; run scripts/fetch-model");
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  GgufModel m = load_gguf_model(path, DType::f32);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WARN("SmolLM2-135M Q4_1 loaded to f32 in " << seconds << " s");
  const ModelConfig& c = m.config;
  CHECK(c.arch == Architecture::llama);
  CHECK(c.vocab_size == 49152);
  CHECK(c.hidden_size == 576);
  CHECK(c.num_layers == 30);
  CHECK(c.num_heads == 9);
  CHECK(c.num_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.intermediate_size == 1536);
  CHECK(c.tie_word_embeddings);
  CHECK(c.rope.theta == 100000.0f);
  CHECK(c.bos_token_id == 1);
  CHECK(c.eos_token_ids == std::vector<int32_t>{2});
  CHECK(m.weights->num_parameters() == 134515008);
  CHECK(m.tokenizer.tokens.size() == 49152);
  CHECK(m.tokenizer.merges.size() == 48900);
  CHECK(m.tokenizer.pre == "smollm");
  CHECK(m.tokenizer.chat_template.find("im_start") != std::string::npos);
  // Values gguf-py's dequantize gives, q and k rows put back in HF order with the inverse of
  // llama.cpp's permute (numpy: w.reshape(heads, D/2, 2, C).swapaxes(1, 2)); see
  // docs/model-gguf.md.
  struct Probe {
    const char* name;
    int64_t row;
    std::vector<float> first;
  };
  const Probe probes[] = {
      {"model.embed_tokens.weight",
       1000,
       {-0.1119384765625f, -0.0739593505859375f, 0.0379791259765625f, -0.0179901123046875f}},
      {"model.layers.0.self_attn.q_proj.weight",
       1,
       {-0.1591796875f, 0.39794921875f, -0.0198974609375f, -1.2734375f}},
      {"model.layers.0.self_attn.q_proj.weight",
       100,
       {-0.0821533203125f, -0.0821533203125f, -0.4453125f}},
      {"model.layers.0.self_attn.k_proj.weight",
       33,
       {-0.09912109375f, 0.22955322265625f, -0.2305908203125f, -0.362060546875f}},
      {"model.layers.29.mlp.down_proj.weight",
       5,
       {-0.3515625f, -0.08441162109375f, -0.217987060546875f, -0.1734619140625f}},
      {"model.layers.3.input_layernorm.weight", 0, {0.1376953125f, 0.3125f, 0.2099609375f}},
  };
  for (const Probe& p : probes) {
    INFO(p.name << " row " << p.row);
    const Tensor& t = m.weights->at(p.name);
    const float* row = t.data_as<float>() + p.row * (t.ndim() == 2 ? t.size(1) : 0);
    CHECK(std::vector<float>(row, row + p.first.size()) == p.first);
  }
  for (const NamedTensor& nt : m.weights->storage()) {
    INFO(nt.name);
    const float* p = nt.tensor.data_as<float>();
    float biggest = 0;  // stays NaN once a NaN is seen
    for (int64_t i = 0; i < nt.tensor.numel(); ++i)
      biggest = std::isnan(p[i]) ? p[i] : std::max(biggest, std::abs(p[i]));
    CHECK(biggest > 0.0f);
    CHECK(biggest < 100.0f);  // also false for NaN and inf
  }
}
