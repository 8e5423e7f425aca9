// Hugging Face model directories: config.json round trips, save_hf/load_hf bitwise round trips
// (single file, shards, bf16), bad inputs, and the files read back by Python's safetensors.
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "model/hf.h"
#include "model/safetensors.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::model;
using Catch::Contains;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

ModelConfig tiny_config(Architecture arch) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = arch == Architecture::qwen3 ? 32 : 16;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = arch == Architecture::llama ? 1e-5f : 1e-6f;
  c.rope.theta = arch == Architecture::llama ? 500000.0f : 1000000.0f;
  c.tie_word_embeddings = arch == Architecture::llama;
  c.attention_bias = arch == Architecture::qwen2;
  c.qk_norm = arch == Architecture::qwen3;
  c.bos_token_id = 1;
  c.eos_token_ids =
      arch == Architecture::llama ? std::vector<int32_t>{2, 3} : std::vector<int32_t>{2};
  if (arch == Architecture::llama) {
    c.rope.factor = 8.0f;
    c.rope.low_freq_factor = 1.0f;
    c.rope.high_freq_factor = 4.0f;
    c.rope.original_max_position = 128;
  }
  return c;
}

std::unique_ptr<Weights> random_weights(Architecture arch, DType dtype, uint64_t seed) {
  auto w = std::make_unique<Weights>(tiny_config(arch), dtype);
  uint64_t s = seed;
  for (const NamedTensor& t : w->storage()) {
    Tensor dst = t.tensor;
    dst.copy_from(test::random_tensor(t.tensor.shape(), dtype, ++s));
  }
  return w;
}

void require_same_weights(const Weights& a, const Weights& b) {
  REQUIRE(a.named().size() == b.named().size());
  for (size_t i = 0; i < a.named().size(); ++i) {
    INFO(a.named()[i].name);
    REQUIRE(a.named()[i].name == b.named()[i].name);
    CHECK(test::bitwise_equal(a.named()[i].tensor, b.named()[i].tensor));
  }
}

bool same_config(const ModelConfig& a, const ModelConfig& b) {
  return a.arch == b.arch && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_layers == b.num_layers &&
         a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.max_position_embeddings == b.max_position_embeddings &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope.theta == b.rope.theta &&
         a.rope.factor == b.rope.factor && a.rope.low_freq_factor == b.rope.low_freq_factor &&
         a.rope.high_freq_factor == b.rope.high_freq_factor &&
         a.rope.original_max_position == b.rope.original_max_position &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.attention_bias == b.attention_bias &&
         a.qk_norm == b.qk_norm && a.bos_token_id == b.bos_token_id &&
         a.eos_token_ids == b.eos_token_ids;
}

// Rewrites a model directory's model.safetensors with edited tensors.
void edit_checkpoint(const std::string& dir,
                     const std::function<void(std::vector<NamedTensor>&)>& edit) {
  const std::string path = dir + "/model.safetensors";
  std::vector<NamedTensor> tensors;
  {
    SafetensorsFile f(path);
    for (const SafetensorsEntry& e : f.tensors()) {
      Tensor t = Tensor::empty(e.shape, e.dtype);
      f.read_into(e.name, t);
      tensors.push_back({e.name, t});
    }
  }
  edit(tensors);
  write_safetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace

TEST_CASE("hf configs round trip for llama qwen2 and qwen3", "[unit]") {
  for (Architecture arch : {Architecture::llama, Architecture::qwen2, Architecture::qwen3}) {
    INFO(architecture_name(arch));
    const ModelConfig c = tiny_config(arch);
    const json j = config_to_hf(c, DType::bf16);
    CHECK(j["model_type"] == architecture_name(arch));
    CHECK(j["torch_dtype"] == "bfloat16");
    CHECK(j["hidden_act"] == "silu");
    const ModelConfig back = config_from_hf(json::parse(j.dump()), "mem");
    CHECK(same_config(c, back));
  }
  const json llama = config_to_hf(tiny_config(Architecture::llama));
  CHECK(llama["rope_scaling"]["rope_type"] == "llama3");
  CHECK(llama["rms_norm_eps"].dump() == "1e-05");
  CHECK(llama["eos_token_id"] == json::array({2, 3}));
  CHECK(config_to_hf(tiny_config(Architecture::qwen2))["use_sliding_window"] == false);
}

TEST_CASE("hf configs read transformers defaults and spellings", "[unit]") {
  json j = {{"architectures", {"Qwen2ForCausalLM"}},
            {"vocab_size", 32},
            {"hidden_size", 64},
            {"intermediate_size", 128},
            {"num_hidden_layers", 1},
            {"num_attention_heads", 4},
            {"max_position_embeddings", 64},
            {"rms_norm_eps", 1e-6},
            {"eos_token_id", 7},
            {"rope_scaling",
             {{"type", "llama3"},
              {"factor", 2.0},
              {"low_freq_factor", 1},
              {"high_freq_factor", 4},
              {"original_max_position_embeddings", 32}}}};
  const ModelConfig c = config_from_hf(j, "cfg.json");
  CHECK(c.arch == Architecture::qwen2);
  CHECK(c.attention_bias);
  CHECK(c.num_kv_heads == 4);
  CHECK(c.head_dim == 16);
  CHECK(c.rope.theta == 10000.0f);
  CHECK(c.rope.factor == 2.0f);
  CHECK(c.rope.original_max_position == 32);
  CHECK(c.bos_token_id == -1);
  CHECK(c.eos_token_ids == std::vector<int32_t>{7});
  CHECK_FALSE(c.tie_word_embeddings);
}

TEST_CASE("hf configs written by transformers 5 with rope_parameters read back", "[unit]") {
  // Saved by transformers 5.24 (AutoConfig.save_pretrained) from tandem's own config.json.
  const json llama = json::parse(R"({"architectures": ["LlamaForCausalLM"],
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "bfloat16",
    "eos_token_id": [2, 3], "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 256,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 128, "rope_theta": 500000.0, "rope_type": "llama3"},
    "tie_word_embeddings": true, "transformers_version": "5.24.0", "use_cache": true,
    "vocab_size": 96})");
  const ModelConfig l = config_from_hf(llama, "llama.json");
  CHECK(l.rope.theta == 500000.0f);
  CHECK(l.rope.factor == 8.0f);
  CHECK(l.rope.original_max_position == 128);
  CHECK(l.tie_word_embeddings);
  CHECK(l.eos_token_ids == std::vector<int32_t>{2, 3});
  const json qwen3 = json::parse(R"({"architectures": ["Qwen3ForCausalLM"],
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "bfloat16",
    "eos_token_id": [2, 3], "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96,
    "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 256,
    "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": null, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "sliding_window": null,
    "tie_word_embeddings": false, "transformers_version": "5.24.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 96})");
  const ModelConfig q = config_from_hf(qwen3, "qwen3.json");
  CHECK(q.arch == Architecture::qwen3);
  CHECK(q.qk_norm);
  CHECK(q.head_dim == 32);
  CHECK(q.rope.theta == 500000.0f);
  CHECK(q.rope.factor == 0.0f);
}

TEST_CASE("bad hf configs name the file and the field", "[unit]") {
  const json good = config_to_hf(tiny_config(Architecture::qwen3));
  json j = good;
  j["model_type"] = "mistral";
  REQUIRE_THROWS_WITH(config_from_hf(j, "dir/config.json"), Contains("dir/config.json") &&
                                                                Contains("model_type") &&
                                                                Contains("'mistral'"));
  for (const char* key : {"hidden_size", "vocab_size", "num_hidden_layers", "rms_norm_eps"}) {
    j = good;
    j.erase(key);
    REQUIRE_THROWS_WITH(config_from_hf(j, "dir/config.json"),
                        Contains("dir/config.json") && Contains(key) && Contains("missing"));
  }
  j = good;
  j["num_attention_heads"] = "four";
  REQUIRE_THROWS_WITH(config_from_hf(j, "c.json"),
                      Contains("c.json") && Contains("num_attention_heads") && Contains("four"));
  j = good;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  REQUIRE_THROWS_WITH(config_from_hf(j, "c.json"), Contains("c.json") && Contains("yarn"));
  j = good;
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 4.0}};
  REQUIRE_THROWS_WITH(config_from_hf(j, "c.json"),
                      Contains("c.json") && Contains("low_freq_factor"));
  j = good;
  j["num_key_value_heads"] = 3;
  REQUIRE_THROWS_WITH(config_from_hf(j, "c.json"), Contains("c.json") && Contains("3"));
  j = good;
  j["eos_token_id"] = json::array({1, "x"});
  REQUIRE_THROWS_WITH(config_from_hf(j, "c.json"), Contains("c.json") && Contains("eos_token_id"));
}

TEST_CASE("save_hf and load_hf round trip llama qwen2 and qwen3 bitwise", "[unit]") {
  test::TempDir tmp("roundtrip");
  uint64_t seed = 100;
  for (Architecture arch : {Architecture::llama, Architecture::qwen2, Architecture::qwen3}) {
    INFO(architecture_name(arch));
    auto w = random_weights(arch, DType::f32, seed += 100);
    const std::string dir = tmp.file(architecture_name(arch));
    SaveOptions opts;
    opts.extra_files["tokenizer_config.json"] = R"({"model_max_length": 256})";
    save_hf(*w, dir, opts);
    CHECK(fs::exists(dir + "/config.json"));
    CHECK(fs::exists(dir + "/generation_config.json"));
    CHECK(fs::exists(dir + "/model.safetensors"));
    CHECK(fs::exists(dir + "/tokenizer_config.json"));
    CHECK_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
    // HF names in Weights::named() order, tagged for transformers.
    SafetensorsFile f(dir + "/model.safetensors");
    CHECK(f.metadata().at("format") == "pt");
    REQUIRE(f.tensors().size() == w->named().size());
    for (size_t i = 0; i < f.tensors().size(); ++i)
      CHECK(f.tensors()[i].name == w->named()[i].name);

    auto back = load_hf(dir);
    CHECK(same_config(back->config(), w->config()));
    require_same_weights(*w, *back);
    // A .safetensors path with config.json beside it loads too.
    require_same_weights(*w, *load_hf(dir + "/model.safetensors"));
  }
}

TEST_CASE("save_hf shards above max_shard_bytes and load_hf reads the shards", "[unit]") {
  test::TempDir tmp("shards");
  auto w = random_weights(Architecture::qwen2, DType::f32, 7);
  const std::string dir = tmp.file("model");
  SaveOptions opts;
  opts.max_shard_bytes = 40000;
  save_hf(*w, dir, opts);
  CHECK_FALSE(fs::exists(dir + "/model.safetensors"));
  std::ifstream in(dir + "/model.safetensors.index.json");
  const json index = json::parse(in);
  size_t total = 0;
  for (const NamedTensor& t : w->named()) total += t.tensor.nbytes();
  CHECK(index["metadata"]["total_size"] == total);
  CHECK(index["weight_map"].size() == w->named().size());
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".safetensors")) {
      ++shards;
      CHECK(name.starts_with("model-000"));
      CHECK(fs::file_size(entry.path()) < 40000 + 4096);
    }
  }
  CHECK(shards > 2);
  CHECK(fs::exists(fmt::format("{}/model-00001-of-{:05d}.safetensors", dir, shards)));
  require_same_weights(*w, *load_hf(dir));
}

TEST_CASE("bf16 weights save and load bitwise and cast on request", "[unit]") {
  test::TempDir tmp("bf16");
  auto w = random_weights(Architecture::qwen3, DType::bf16, 11);
  save_hf(*w, tmp.file("bf16"));
  json cfg = json::parse(std::ifstream(tmp.file("bf16") + "/config.json"));
  CHECK(cfg["torch_dtype"] == "bfloat16");
  SafetensorsFile f(tmp.file("bf16") + "/model.safetensors");
  CHECK(f.tensors()[0].dtype == DType::bf16);
  require_same_weights(*w, *load_hf(tmp.file("bf16"), DType::bf16));

  // bf16 -> f32 on save, f32 file -> bf16 on load: exact both ways.
  SaveOptions opts;
  opts.dtype = DType::f32;
  save_hf(*w, tmp.file("f32"), opts);
  CHECK(SafetensorsFile(tmp.file("f32") + "/model.safetensors").tensors()[0].dtype == DType::f32);
  require_same_weights(*w, *load_hf(tmp.file("f32"), DType::bf16));
  auto wide = load_hf(tmp.file("bf16"), DType::f32);
  CHECK(test::to_f64(wide->embed) == test::to_f64(w->embed));
}

TEST_CASE("save_hf replaces an existing directory whole", "[unit]") {
  test::TempDir tmp("replace");
  const std::string dir = tmp.file("m");
  auto sharded = random_weights(Architecture::llama, DType::f32, 21);
  SaveOptions opts;
  opts.max_shard_bytes = 30000;
  save_hf(*sharded, dir, opts);
  REQUIRE(fs::exists(dir + "/model.safetensors.index.json"));
  auto w = random_weights(Architecture::llama, DType::f32, 22);
  save_hf(*w, dir + "/");
  CHECK_FALSE(fs::exists(dir + "/model.safetensors.index.json"));  // stale shards are gone
  require_same_weights(*w, *load_hf(dir));
  int entries = 0;
  for (const auto& e : fs::directory_iterator(tmp.path)) entries += e.exists() ? 1 : 0;
  CHECK(entries == 1);  // no .tmp- or .old- leftovers
  opts.extra_files["../evil"] = "x";
  REQUIRE_THROWS_WITH(save_hf(*w, dir, opts), Contains("../evil"));
  require_same_weights(*w, *load_hf(dir));
}

TEST_CASE("load_hf names the file and tensor of a bad checkpoint", "[unit]") {
  test::TempDir tmp("bad");
  const std::string dir = tmp.file("m");
  auto w = random_weights(Architecture::qwen2, DType::f32, 31);
  const std::string file = dir + "/model.safetensors";
  auto fresh = [&] { save_hf(*w, dir); };

  SECTION("wrong shape") {
    fresh();
    edit_checkpoint(dir, [](std::vector<NamedTensor>& ts) {
      for (NamedTensor& t : ts)
        if (t.name == "model.layers.1.self_attn.k_proj.weight")
          t.tensor = test::random_tensor({16, 64}, DType::f32, 1);
    });
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(file) &&
                                          Contains("model.layers.1.self_attn.k_proj.weight") &&
                                          Contains("(16, 64)") && Contains("(32, 64)"));
  }
  SECTION("missing tensor") {
    fresh();
    edit_checkpoint(dir, [](std::vector<NamedTensor>& ts) {
      std::erase_if(ts, [](const NamedTensor& t) { return t.name == "model.norm.weight"; });
    });
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(file) && Contains("'model.norm.weight'"));
  }
  SECTION("unexpected tensor") {
    fresh();
    edit_checkpoint(dir, [](std::vector<NamedTensor>& ts) {
      ts.push_back({"model.layers.0.mlp.extra.weight", test::random_tensor({4}, DType::f32, 2)});
      ts.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq",
                    test::random_tensor({8}, DType::f32, 3)});
    });
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(file) &&
                                          Contains("'model.layers.0.mlp.extra.weight'") &&
                                          !Contains("inv_freq"));
  }
  SECTION("integer dtype") {
    fresh();
    edit_checkpoint(dir, [](std::vector<NamedTensor>& ts) {
      for (NamedTensor& t : ts)
        if (t.name == "model.norm.weight") t.tensor = test::random_ints({64}, DType::i32, 1, 0, 9);
    });
    REQUIRE_THROWS_WITH(load_hf(dir),
                        Contains(file) && Contains("model.norm.weight") && Contains("I32"));
  }
  SECTION("truncated checkpoint") {
    fresh();
    fs::resize_file(file, fs::file_size(file) - 100);
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(file) && Contains("lm_head.weight"));
  }
  SECTION("header size larger than the file") {
    fresh();
    fs::resize_file(file, 64);
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(file) && Contains("header size"));
  }
  SECTION("unsupported model_type") {
    fresh();
    json cfg = json::parse(std::ifstream(dir + "/config.json"));
    cfg["model_type"] = "gpt2";
    std::ofstream(dir + "/config.json") << cfg.dump();
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(dir + "/config.json") && Contains("'gpt2'"));
  }
  SECTION("missing config field") {
    fresh();
    json cfg = json::parse(std::ifstream(dir + "/config.json"));
    cfg.erase("intermediate_size");
    std::ofstream(dir + "/config.json") << cfg.dump();
    REQUIRE_THROWS_WITH(load_hf(dir),
                        Contains(dir + "/config.json") && Contains("intermediate_size"));
  }
  SECTION("no checkpoint") {
    fresh();
    fs::remove(file);
    REQUIRE_THROWS_WITH(load_hf(dir), Contains(dir) && Contains("model.safetensors"));
  }
}

TEST_CASE("a tied lm_head in the checkpoint loads only when it equals the embedding", "[unit]") {
  test::TempDir tmp("tied");
  const std::string dir = tmp.file("m");
  auto w = random_weights(Architecture::llama, DType::f32, 41);
  save_hf(*w, dir);
  edit_checkpoint(dir, [&](std::vector<NamedTensor>& ts) {
    ts.push_back({"lm_head.weight", w->embed});
  });
  require_same_weights(*w, *load_hf(dir));
  // Rotary buffers of old checkpoints are ignored.
  edit_checkpoint(dir, [&](std::vector<NamedTensor>& ts) {
    ts.push_back(
        {"model.layers.1.self_attn.rotary_emb.inv_freq", test::random_tensor({8}, DType::f32, 4)});
  });
  require_same_weights(*w, *load_hf(dir));
  edit_checkpoint(dir, [&](std::vector<NamedTensor>& ts) {
    ts.pop_back();
    ts.back().tensor = test::random_tensor(w->embed.shape(), DType::f32, 5);
  });
  REQUIRE_THROWS_WITH(load_hf(dir), Contains(dir + "/model.safetensors") &&
                                        Contains("lm_head.weight") &&
                                        Contains("tie_word_embeddings"));
}

TEST_CASE("python safetensors reads the files tandem writes", "[interop]") {
  if (std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") != 0)
    FAIL("python3 with the safetensors and numpy packages is needed: run scripts/setup");
  test::TempDir tmp("interop");
  auto w = random_weights(Architecture::qwen3, DType::f32, 51);
  SaveOptions opts;
  opts.max_shard_bytes = 60000;
  save_hf(*w, tmp.file("model"), opts);
  const std::vector<NamedTensor> extra = {
      {"half", test::random_tensor({3, 4}, DType::f16, 1)},
      {"ids", test::random_ints({5}, DType::i64, 2, -100, 100)},
      {"count", test::random_ints({2, 3}, DType::i32, 3, 0, 50)},
      {"bytes", Tensor::zeros({6}, DType::u8)}};
  for (int i = 0; i < 6; ++i) extra[3].tensor.data_as<uint8_t>()[i] = static_cast<uint8_t>(i * 40);
  write_safetensors(tmp.file("extra.safetensors"), extra, {{"who", "tandem"}});

  // Expected shapes and sums per tensor, per file; the snippet checks them and prints "ok".
  json expected = json::object();
  auto add = [&](const std::string& file, const NamedTensor& t) {
    double sum = 0;
    for (double v : test::to_f64(t.tensor)) sum += v;
    json shape = json::array();
    for (int d = 0; d < t.tensor.ndim(); ++d) shape.push_back(t.tensor.size(d));
    expected[file][t.name] = {{"shape", shape}, {"sum", sum}};
  };
  std::ifstream idx(tmp.file("model") + "/model.safetensors.index.json");
  const json weight_map = json::parse(idx)["weight_map"];
  for (const NamedTensor& t : w->named())
    add(tmp.file("model") + "/" + weight_map[t.name].get<std::string>(), t);
  for (const NamedTensor& t : extra) add(tmp.file("extra.safetensors"), t);
  std::ofstream(tmp.file("expected.json")) << expected.dump();
  std::ofstream(tmp.file("check.py")) << R"(import json, sys
from safetensors import safe_open
from safetensors.numpy import load_file
expected = json.load(open(sys.argv[1]))
bad = []
for path, tensors in expected.items():
    got = load_file(path)
    if sorted(got) != sorted(tensors):
        bad.append(f"{path}: names {sorted(got)}")
    for name, e in tensors.items():
        a = got[name]
        s = float(a.astype("float64").sum())
        if list(a.shape) != e["shape"] or abs(s - e["sum"]) > 1e-6 * (1 + abs(e["sum"])):
            bad.append(f"{path}: {name} shape {list(a.shape)} sum {s} expected {e}")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
        if path.endswith("extra.safetensors") and meta.get("who") != "tandem":
            bad.append(f"{path}: metadata {meta}")
        if not path.endswith("extra.safetensors") and meta.get("format") != "pt":
            bad.append(f"{path}: metadata {meta}")
import numpy as np
from safetensors.numpy import save_file
save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64),
           "c": np.full((2, 1, 3), 0.5, dtype=np.float16)}, sys.argv[2], metadata={"by": "py"})
print("\n".join(bad) if bad else "ok")
)";
  const std::string cmd = fmt::format("python3 {} {} {} 2>&1", tmp.file("check.py"),
                                      tmp.file("expected.json"), tmp.file("py.safetensors"));
  std::FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = ::pclose(p);
  INFO(out);
  CHECK(rc == 0);
  CHECK(out == "ok\n");

  // And tandem reads what Python wrote.
  SafetensorsFile py(tmp.file("py.safetensors"));
  CHECK(py.metadata().at("by") == "py");
  REQUIRE(py.tensors().size() == 3);
  CHECK(py.at("a").shape == Shape{3, 4});
  CHECK(test::to_f64(py.view("a"))[11] == 11.0);
  CHECK(test::to_f64(py.view("b")) == std::vector<double>{0, 1, 2, 3, 4});
  Tensor c = Tensor::empty({2, 1, 3}, DType::f32);
  py.read_into("c", c);
  CHECK(test::to_f64(c) == std::vector<double>(6, 0.5));
}
