// ShardedAdamW inside a DP x TP grid (ShardOptions::model_parallel): ranks holding tensor-parallel
// shards of the model take the shards of the whole model's AdamW step, their global norm the whole
// gradients' (the replicated norms counted once); a gradient shared by two ranks (a tied
// embedding's copies) is summed so both copies take one update.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

using model::NamedTensor;
using model::Weights;

// The micro Qwen3 (q/k norms, untied) with sizes 2 ranks split: 2 KV heads, V = 38.
model::ModelConfig splittable_config() {
  model::ModelConfig c = test::micro_model_config(true);
  c.num_kv_heads = 2;
  c.vocab_size = 38;
  return c;
}

// The storage tensors a tensor-parallel rank holds as replicas (the norms of the Megatron split).
std::vector<std::string> replicated(const Weights& w) {
  std::vector<std::string> out;
  for (const NamedTensor& s : w.storage())
    if (s.name.find("norm") != std::string::npos) out.push_back(s.name);
  return out;
}

// Largest |a - b| / (|b| + 1e-6) over every storage tensor.
double max_rel_diff(const Weights& a, const Weights& b) {
  double worst = 0;
  for (size_t t = 0; t < a.storage().size(); ++t) {
    const float* x = a.storage()[t].tensor.data_as<float>();
    const float* y = b.storage()[t].tensor.data_as<float>();
    for (int64_t i = 0; i < a.storage()[t].tensor.numel(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(x[i]) - y[i]) / (std::abs(y[i]) + 1e-6));
  }
  return worst;
}

}  // namespace

TEST_CASE("ShardedAdamW on tensor-parallel shards takes the shards of the whole model's step",
          "[unit]") {
  const model::ModelConfig c = splittable_config();
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  cfg.max_grad_norm = 0.5f;  // clipped: the global norm decides the update
  const int tp = 2;
  for (const int dp : {1, 2}) {
    INFO("dp " << dp << " x tp " << tp);
    // The reference: the data-parallel ranks' whole gradients summed, one AdamW on whole weights.
    Weights ref(c, DType::f32);
    test::fill_uniform(ref, 1);
    AdamW adamw(ref, cfg);
    std::vector<std::unique_ptr<Weights>> grads;
    Weights sum(c, DType::f32);
    sum.zero();
    for (int d = 0; d < dp; ++d) {
      grads.push_back(std::make_unique<Weights>(c, DType::f32));
      test::fill_uniform(*grads.back(), 100 + static_cast<uint64_t>(d) * 50);
      for (size_t t = 0; t < sum.storage().size(); ++t) {
        float* s = sum.storage()[t].tensor.data_as<float>();
        const float* g = grads.back()->storage()[t].tensor.data_as<float>();
        for (int64_t i = 0; i < sum.storage()[t].tensor.numel(); ++i) s[i] += g[i];
      }
    }
    std::vector<float> ref_norms;
    for (int step = 0; step < 2; ++step) ref_norms.push_back(adamw.step(sum, 1e-2f).grad_norm);

    Weights start(c, DType::f32);
    test::fill_uniform(start, 1);
    const test::TempDir tmp("mp-adamw");
    test::on_ranks(dp * tp, tmp.file("store"), [&](int r, Communicator& world) {
      const int d = r / tp, t = r % tp;  // the grid's order: tensor-parallel ranks adjacent
      std::vector<int> dp_ranks, tp_ranks;
      for (int k = 0; k < dp; ++k) dp_ranks.push_back(k * tp + t);
      for (int k = 0; k < tp; ++k) tp_ranks.push_back(d * tp + k);
      std::unique_ptr<Communicator> dp_group, tp_group;
      for (int k = 0; k < tp; ++k) {  // every rank joins every split of its kind, in one order
        std::vector<int> ranks;
        for (int j = 0; j < dp; ++j) ranks.push_back(j * tp + k);
        if (k == t) dp_group = world.split("dp" + std::to_string(k), ranks);
      }
      for (int j = 0; j < dp; ++j) {
        std::vector<int> ranks;
        for (int k = 0; k < tp; ++k) ranks.push_back(j * tp + k);
        if (j == d) tp_group = world.split("tp" + std::to_string(j), ranks);
      }
      std::unique_ptr<Weights> params = model::cut_tp_shard(start, t, tp);
      const std::unique_ptr<Weights> g = model::cut_tp_shard(*grads[static_cast<size_t>(d)], t, tp);
      ShardOptions opts;
      opts.model_parallel = tp_group.get();
      if (t > 0) opts.norm_excluded = replicated(*params);
      ShardedAdamW sharded(*params, dp > 1 ? dp_group.get() : nullptr, cfg, opts);
      for (int step = 0; step < 2; ++step) {
        const StepResult res = sharded.step(*g, 1e-2f);
        CHECK(res.clip_scale < 1.0f);
        CHECK(std::abs(res.grad_norm - ref_norms[static_cast<size_t>(step)]) <=
              2e-6f * ref_norms[static_cast<size_t>(step)]);
      }
      // Elementwise the same update but for the norm's rounding (the squares summed by part).
      const std::unique_ptr<Weights> expect = model::cut_tp_shard(ref, t, tp);
      CHECK(max_rel_diff(sharded.params(), *expect) < 1e-5);
    });
  }
}

TEST_CASE(
    "a norm left out without a model-parallel group, or of a tensor the weights lack, is "
    "refused naming it",
    "[unit]") {
  const model::ModelConfig c = splittable_config();
  Weights w(c, DType::f32);
  test::fill_uniform(w, 3);
  ShardOptions opts;
  opts.norm_excluded = {"model.norm.weight"};
  REQUIRE_THROWS_WITH(ShardedAdamW(w, nullptr, {}, opts),
                      Catch::Contains("ShardOptions::model_parallel"));
  const test::TempDir tmp("mp-adamw-bad");
  test::on_ranks(1, tmp.file("store"), [&](int, Communicator& world) {
    ShardOptions bad;
    bad.model_parallel = &world;
    bad.norm_excluded = {"model.layers.9.input_layernorm.weight"};
    REQUIRE_THROWS_WITH(ShardedAdamW(w, nullptr, {}, bad),
                        Catch::Contains("model.layers.9.input_layernorm.weight"));
    ShardOptions shared;
    shared.shared = {{"model.norm.weight", &world}};  // not a unit of its own: the head's
    REQUIRE_THROWS_WITH(ShardedAdamW(w, nullptr, {}, shared), Catch::Contains("model.norm.weight"));
  });
}

TEST_CASE("a gradient shared by two ranks is summed so both copies take the same update",
          "[unit]") {
  const model::ModelConfig c = splittable_config();
  AdamWConfig cfg;
  cfg.max_grad_norm = 0;  // no clipping: the embedding's update depends on its gradient alone
  const std::string embed = "model.embed_tokens.weight";
  std::vector<std::unique_ptr<Weights>> grads;
  for (int r = 0; r < 2; ++r) {
    grads.push_back(std::make_unique<Weights>(c, DType::f32));
    test::fill_uniform(*grads.back(), 700 + static_cast<uint64_t>(r) * 40);
  }
  // The reference: the embedding's gradients of both copies added.
  Weights ref(c, DType::f32), sum(c, DType::f32);
  test::fill_uniform(ref, 9);
  sum.copy_from(*grads[0]);
  {
    float* s = sum.at(embed).data_as<float>();
    const float* b = grads[1]->at(embed).data_as<float>();
    for (int64_t i = 0; i < sum.at(embed).numel(); ++i) s[i] += b[i];
  }
  AdamW adamw(ref, cfg);
  adamw.step(sum, 1e-2f);

  std::vector<std::vector<float>> after(2);
  const test::TempDir tmp("mp-adamw-shared");
  test::on_ranks(2, tmp.file("store"), [&](int r, Communicator& world) {
    Weights params(c, DType::f32);
    test::fill_uniform(params, 9);
    ShardOptions opts;
    opts.shared = {{embed, &world}};
    ShardedAdamW sharded(params, nullptr, cfg, opts);
    sharded.step(*grads[static_cast<size_t>(r)], 1e-2f);
    const Tensor& e = sharded.params().at(embed);
    after[static_cast<size_t>(r)].assign(e.data_as<float>(), e.data_as<float>() + e.numel());
  });
  CHECK(after[0] == after[1]);
  const Tensor& e = ref.at(embed);
  CHECK(after[0] == std::vector<float>(e.data_as<float>(), e.data_as<float>() + e.numel()));
}

}  // namespace tandem::trainer
