// Tests of model/weights: HF-named views alias the fused storage, the state-dict order, tied
// embeddings, sizes, lookups and copies.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "model/weights.h"
#include "tests/testutil.h"

namespace tandem::model {
namespace {

ModelConfig small_config(bool tied, bool bias, bool qk_norm) {
  ModelConfig c;
  c.vocab_size = 101;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  c.qk_norm = qk_norm;
  return c;
}

const char* ptr(const Tensor& t) { return static_cast<const char*>(t.data()); }

TEST_CASE("weights q k v and gate up views alias the fused storage", "[unit]") {
  const ModelConfig c = small_config(false, true, true);
  Weights w(c, DType::f32);
  const int64_t C = 64, D = 16, H = 4, Hkv = 2, F = 96;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::string p = hf_layer_prefix(l);
    CHECK(L.qkv.shape() == Shape{(H + 2 * Hkv) * D, C});
    CHECK(ptr(w.at(p + "self_attn.q_proj.weight")) == ptr(L.qkv));
    CHECK(ptr(w.at(p + "self_attn.k_proj.weight")) == ptr(L.qkv) + H * D * C * 4);
    CHECK(ptr(w.at(p + "self_attn.v_proj.weight")) == ptr(L.qkv) + (H + Hkv) * D * C * 4);
    CHECK(w.at(p + "self_attn.k_proj.weight").shape() == Shape{Hkv * D, C});
    CHECK(ptr(w.at(p + "self_attn.q_proj.bias")) == ptr(L.qkv_bias));
    CHECK(ptr(w.at(p + "self_attn.v_proj.bias")) == ptr(L.qkv_bias) + (H + Hkv) * D * 4);
    CHECK(ptr(w.at(p + "mlp.gate_proj.weight")) == ptr(L.gate_up));
    CHECK(ptr(w.at(p + "mlp.up_proj.weight")) == ptr(L.gate_up) + F * C * 4);
    CHECK(w.at(p + "self_attn.q_norm.weight").shape() == Shape{D});
  }
  // A write through a named view shows in the fused tensor.
  w.zero();
  const Tensor v = w.at("model.layers.1.self_attn.v_proj.weight");
  v.data_as<float>()[3] = 2.5f;
  CHECK(w.layers[1].qkv.data_as<float>()[(H + Hkv) * D * C + 3] == 2.5f);
  const Tensor up = w.at("model.layers.0.mlp.up_proj.weight");
  up.data_as<float>()[C + 1] = -1.5f;
  CHECK(w.layers[0].gate_up.data_as<float>()[F * C + C + 1] == -1.5f);
}

TEST_CASE("weights list names in hugging face state dict order", "[unit]") {
  Weights w(small_config(false, true, true), DType::f32);
  std::vector<std::string> names;
  for (const NamedTensor& n : w.named()) names.push_back(n.name);
  const std::vector<std::string> layer = {
      "input_layernorm.weight",  "self_attn.q_proj.weight",        "self_attn.q_proj.bias",
      "self_attn.k_proj.weight", "self_attn.k_proj.bias",          "self_attn.v_proj.weight",
      "self_attn.v_proj.bias",   "self_attn.o_proj.weight",        "self_attn.q_norm.weight",
      "self_attn.k_norm.weight", "mlp.gate_proj.weight",           "mlp.up_proj.weight",
      "mlp.down_proj.weight",    "post_attention_layernorm.weight"};
  std::vector<std::string> want = {"model.embed_tokens.weight"};
  for (int l = 0; l < 2; ++l)
    for (const std::string& s : layer) want.push_back(hf_layer_prefix(l) + s);
  want.push_back("model.norm.weight");
  want.push_back("lm_head.weight");
  CHECK(names == want);
  for (const NamedTensor& n : w.named()) CHECK(w.find(n.name) != nullptr);
}

TEST_CASE("weights with tied embeddings share lm_head with embed", "[unit]") {
  Weights tied(small_config(true, false, false), DType::bf16);
  CHECK(ptr(tied.lm_head) == ptr(tied.embed));
  CHECK(tied.find("lm_head.weight") == nullptr);
  CHECK(tied.named().back().name == "model.norm.weight");
  CHECK(tied.find("model.layers.0.self_attn.q_proj.bias") == nullptr);
  CHECK(!tied.layers[0].qkv_bias.defined());
  CHECK(!tied.layers[0].q_norm.defined());
  CHECK_THROWS_WITH(tied.at("model.layers.9.mlp.up_proj.weight"),
                    Catch::Contains("no parameter named 'model.layers.9.mlp.up_proj.weight'"));
  Weights untied(small_config(false, false, false), DType::f32);
  CHECK(ptr(untied.lm_head) != ptr(untied.embed));
}

TEST_CASE("weights count parameters and bytes of one arena", "[unit]") {
  const int64_t V = 101, C = 64, F = 96, D = 16, H = 4, Hkv = 2, L = 2;
  const int64_t per_layer = 2 * C + (H + 2 * Hkv) * D * C + C * H * D + 3 * F * C;
  for (bool tied : {true, false})
    for (bool bias : {true, false})
      for (bool qk : {true, false}) {
        Weights w(small_config(tied, bias, qk), DType::bf16);
        const int64_t want = V * C * (tied ? 1 : 2) + C +
                             L * (per_layer + (bias ? (H + 2 * Hkv) * D : 0) + (qk ? 2 * D : 0));
        CHECK(w.num_parameters() == want);
        int64_t storage = 0;
        for (const NamedTensor& s : w.storage()) storage += s.tensor.numel();
        CHECK(storage == want);
        int64_t named = 0;
        for (const NamedTensor& n : w.named()) named += n.tensor.numel();
        CHECK(named == want);  // the named views cover the storage exactly once
        CHECK(w.nbytes() >= static_cast<size_t>(want) * 2);
        CHECK(w.nbytes() < static_cast<size_t>(want) * 2 + w.storage().size() * Arena::kAlignment);
        CHECK(w.dtype() == DType::bf16);
      }
}

TEST_CASE("weights copy casts between dtypes and rejects another model", "[unit]") {
  const ModelConfig c = small_config(false, true, false);
  Weights a(c, DType::f32), b(c, DType::bf16);
  for (size_t i = 0; i < a.storage().size(); ++i) {
    Tensor t = a.storage()[i].tensor;
    t.copy_from(test::random_tensor(t.shape(), DType::f32, 10 + i));
  }
  b.copy_from(a);
  for (size_t i = 0; i < a.storage().size(); ++i) {
    const std::vector<double> x = test::to_f64(a.storage()[i].tensor);
    const std::vector<double> y = test::to_f64(b.storage()[i].tensor);
    CHECK(test::max_abs_diff(x, y) <= 1.0 / 128 * test::max_abs(x));
  }
  Weights other(small_config(false, false, false), DType::f32);
  CHECK_THROWS_AS(other.copy_from(a), Error);
}

}  // namespace
}  // namespace tandem::model
