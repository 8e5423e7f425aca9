// Tests of pipeline stages: a model part's Weights (global names, copies, random init, AdamW and
// the subsystems that refuse a part).
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/hf.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/checkpoint.h"
#include "trainer/optimizer.h"

namespace tandem::model {
namespace {

using Kind = test::TinyKind;

ModelConfig config_of(Kind kind, int64_t layers) {
  ModelConfig c = test::tiny_model_config(kind);
  c.num_layers = layers;
  return c;
}

// Storage tensors by name.
std::unordered_map<std::string, Tensor> by_name(const Weights& w) {
  std::unordered_map<std::string, Tensor> out;
  for (const NamedTensor& s : w.storage()) out.emplace(s.name, s.tensor);
  return out;
}

TEST_CASE("a model part's weights hold its layers under their global names", "[unit]") {
  for (const bool tied : {true, false}) {
    INFO((tied ? "tied" : "untied"));
    const ModelConfig c = config_of(tied ? Kind::qwen2 : Kind::qwen3, 4);
    Weights whole(c, DType::f32);
    init_random(whole, 5);
    const size_t layer_names = whole.named().size() - (tied ? 2 : 3);  // of the 4 layers
    REQUIRE(layer_names % 4 == 0);

    Weights mid(c, ModelPart{2, 2, false, false}, DType::f32);
    CHECK(!mid.whole());
    CHECK(mid.layers.size() == 2);
    CHECK(!mid.embed.defined());
    CHECK(!mid.final_norm.defined());
    CHECK(!mid.lm_head.defined());
    CHECK(mid.named().size() == layer_names / 2);
    int in2 = 0, in3 = 0;
    for (const NamedTensor& t : mid.named()) {
      INFO(t.name);
      in2 += t.name.starts_with("model.layers.2.");
      in3 += t.name.starts_with("model.layers.3.");
      CHECK(t.tensor.defined());
    }
    CHECK(in2 == static_cast<int>(layer_names / 4));
    CHECK(in3 == static_cast<int>(layer_names / 4));
    for (const NamedTensor& t : mid.storage())
      CHECK((t.name.starts_with("model.layers.2.") || t.name.starts_with("model.layers.3.")));
    CHECK(mid.find("model.layers.0.input_layernorm.weight") == nullptr);
    CHECK_THROWS_WITH(mid.at("model.norm.weight"), Catch::Contains("layers 2..3 of 4"));
    // layers[i] is global layer 2 + i: the copy from the whole model lands there.
    mid.copy_from(whole);
    CHECK(test::bitwise_equal(mid.layers[1].down, whole.layers[3].down));
    CHECK(test::bitwise_equal(mid.at("model.layers.2.self_attn.q_proj.weight"),
                              whole.at("model.layers.2.self_attn.q_proj.weight")));

    // The first stage holds the embedding, the last the norm and the head (tied: its own copy of
    // the embedding matrix, under the embedding's name).
    const ModelPart first = ModelPart::stage(c, 0, 2), last = ModelPart::stage(c, 2, 2);
    CHECK((first.embedding && !first.head && !last.embedding && last.head));
    Weights w0(c, first, DType::f32), w1(c, last, DType::f32);
    CHECK((w0.embed.defined() && !w0.lm_head.defined() && !w0.final_norm.defined()));
    CHECK((!w1.embed.defined() && w1.lm_head.defined() && w1.final_norm.defined()));
    CHECK((w1.find("lm_head.weight") != nullptr) == !tied);
    if (tied) CHECK(w1.find("model.embed_tokens.weight") != nullptr);
    CHECK(w0.num_parameters() + w1.num_parameters() ==
          whole.num_parameters() + (tied ? c.vocab_size * c.hidden_size : 0));

    // init_random gives a part the whole model's values (a tied head copy the embedding's).
    init_random(w0, 5);
    init_random(w1, 5);
    const auto want = by_name(whole);
    for (const Weights* part : {&w0, &w1})
      for (const NamedTensor& t : part->storage()) {
        INFO(t.name);
        CHECK(test::bitwise_equal(t.tensor, want.at(t.name)));
      }
    CHECK(test::bitwise_equal(w1.lm_head, whole.lm_head));

    // A part copies only from a table that holds all of it.
    Weights other(c, ModelPart{1, 2, false, false}, DType::f32);
    CHECK_THROWS_WITH(other.copy_from(mid), Catch::Contains("model.layers.1."));
    // An unbound part binds its own storage tensors.
    const auto table = Weights::unbound(c, last, DType::f32);
    int64_t n = 0;
    for (size_t i = 0; i < table->storage().size(); ++i) n += table->storage_shape(i).numel();
    CHECK(n == w1.num_parameters());
    const Tensor flat = Tensor::empty({n}, DType::f32);
    table->bind(0, table->storage().size(), flat);
    CHECK((table->lm_head.defined() && table->layers[1].gate.defined()));
    CHECK_THROWS_WITH(Weights(c, ModelPart{3, 2, false, true}, DType::f32),
                      Catch::Contains("layers [3, 5)"));
  }
}

TEST_CASE(
    "a model part steps under AdamW as the whole model; sharded AdamW, checkpoints and "
    "save_hf refuse one",
    "[unit]") {
  const ModelConfig c = config_of(Kind::qwen2, 4);  // tied: the last stage's copy steps too
  const ModelPart last = ModelPart::stage(c, 2, 2);
  Weights whole(c, DType::f32), part(c, last, DType::f32);
  init_random(whole, 11);
  part.copy_from(whole);
  // Without clipping the update is per element: the part's tensors step as the whole model's.
  const trainer::AdamWConfig config{.max_grad_norm = 0.0f};
  trainer::AdamW whole_opt(whole, config), part_opt(part, config);
  for (int step = 0; step < 2; ++step) {
    Weights& gw = whole_opt.gradients();
    init_random(gw, 20 + static_cast<uint64_t>(step));
    part_opt.gradients().copy_from(gw);
    whole_opt.step(gw, 1e-2f);
    part_opt.step(part_opt.gradients(), 1e-2f);
  }
  const auto want = by_name(whole);
  for (const NamedTensor& t : part.storage()) {
    INFO(t.name);
    CHECK(test::bitwise_equal(t.tensor, want.at(t.name)));
  }
  CHECK(part_opt.m().part() == last);
  CHECK_THROWS_WITH(trainer::ShardedAdamW(part, nullptr, config),
                    Catch::Contains("model part (layers 2..3 of 4 with the head)"));
  const test::TempDir dir("part_refused");
  CHECK_THROWS_WITH(trainer::save_checkpoint(dir.file("ckpt"), 1, part, part_opt, {}),
                    Catch::Contains("checkpoint: the policy holds a model part"));
  CHECK_THROWS_WITH(save_hf(part, dir.file("hf")), Catch::Contains("model part"));
}

}  // namespace
}  // namespace tandem::model
