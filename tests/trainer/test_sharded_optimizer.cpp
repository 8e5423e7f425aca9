// ShardedAdamW against AdamW on the summed gradients: ranks as threads of one process meeting in
// a file store (Gloo over loopback), 1 to 3 of them, ranges that cross storage tensors; the
// fixed-point step bitwise on any world size. (Its state saved and loaded at another world size:
// test_checkpoint_shards.cpp.)
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/comm.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

using model::NamedTensor;
using model::Weights;

using test::on_ranks;

}  // namespace

TEST_CASE("ShardedAdamW on 1 2 and 3 ranks takes the steps of AdamW on the summed gradients",
          "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  cfg.max_grad_norm = 0.5f;  // clipped: the global norm decides
  for (const int world : {1, 2, 3}) {
    INFO("world " << world);
    // The reference: every rank's gradients summed in rank order, one AdamW.
    Weights ref(c, DType::f32);
    test::fill_uniform(ref, 1);
    AdamW adamw(ref, cfg);
    std::vector<std::unique_ptr<Weights>> grads;
    for (int r = 0; r < world; ++r) {
      grads.push_back(std::make_unique<Weights>(c, DType::f32));
      test::fill_uniform(*grads.back(), 100 + static_cast<uint64_t>(r));
    }
    Weights sum(c, DType::f32);
    sum.zero();
    for (int r = 0; r < world; ++r)
      for (size_t t = 0; t < sum.storage().size(); ++t) {
        float* s = sum.storage()[t].tensor.data_as<float>();
        const float* g = grads[static_cast<size_t>(r)]->storage()[t].tensor.data_as<float>();
        for (int64_t i = 0; i < sum.storage()[t].tensor.numel(); ++i) s[i] += g[i];
      }
    for (int step = 0; step < 2; ++step) adamw.step(sum, 1e-2f);

    const test::TempDir tmp("sharded-adamw");
    std::vector<std::unique_ptr<Weights>> params;
    for (int r = 0; r < world; ++r) {
      params.push_back(std::make_unique<Weights>(c, DType::f32));
      test::fill_uniform(*params.back(), 1);
    }
    std::vector<int64_t> sizes(static_cast<size_t>(world));
    on_ranks(world, tmp.file("store"), [&](int r, Communicator& comm) {
      ShardedAdamW sharded(*params[static_cast<size_t>(r)], &comm, cfg);
      for (const model::FlatRange& piece : sharded.layout().ranges(r))
        sizes[static_cast<size_t>(r)] += piece.size();
      for (int step = 0; step < 2; ++step) {
        const StepResult res = sharded.step(*grads[static_cast<size_t>(r)], 1e-2f);
        CHECK(res.clip_scale < 1.0f);
      }
      CHECK(sharded.step_count() == 2);
    });
    int64_t total = 0;
    for (const int64_t s : sizes) total += s;
    CHECK(total == [&] {
      int64_t n = 0;
      for (const NamedTensor& s : ref.storage()) n += s.tensor.numel();
      return n;
    }());
    for (int r = 0; r < world; ++r) {
      for (size_t t = 0; t < ref.storage().size(); ++t) {
        INFO(ref.storage()[t].name << " on rank " << r);
        CHECK(test::max_abs_diff(test::to_f64(params[static_cast<size_t>(r)]->storage()[t].tensor),
                                 test::to_f64(ref.storage()[t].tensor)) < 1e-6);
      }
    }
  }
}

TEST_CASE("ShardedAdamW step_fixed gives the same weights bitwise on 1 2 and 3 ranks", "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  AdamWConfig cfg;
  cfg.max_grad_norm = 0.5f;
  Weights g(c, DType::f32);
  test::fill_uniform(g, 5);
  // The gradient in fixed point, split into 6 parts that the ranks hold in different ways.
  std::vector<int64_t> whole;
  for (const NamedTensor& s : g.storage())
    for (int64_t i = 0; i < s.tensor.numel(); ++i)
      whole.push_back(std::llrint(
          std::ldexp(static_cast<double>(s.tensor.data_as<float>()[i]), ShardedAdamW::kFixedBits)));
  std::vector<std::vector<int64_t>> parts(6, std::vector<int64_t>(whole.size()));
  for (size_t i = 0; i < whole.size(); ++i) {
    int64_t left = whole[i];
    for (size_t p = 0; p + 1 < parts.size(); ++p) {
      parts[p][i] = (static_cast<int64_t>(i * 7 + p * 13) % 11 - 5) * (int64_t{1} << 30);
      left -= parts[p][i];
    }
    parts.back()[i] = left;
  }
  Weights one(c, DType::f32);
  test::fill_uniform(one, 1);
  {
    ShardedAdamW alone(one, nullptr, cfg);
    for (int step = 0; step < 2; ++step) alone.step_fixed(whole, 1e-2f);
  }
  for (const int world : {2, 3}) {
    INFO("world " << world);
    const test::TempDir tmp("sharded-fixed");
    std::vector<std::unique_ptr<Weights>> params;
    for (int r = 0; r < world; ++r) {
      params.push_back(std::make_unique<Weights>(c, DType::f32));
      test::fill_uniform(*params.back(), 1);
    }
    on_ranks(world, tmp.file("store"), [&](int r, Communicator& comm) {
      std::vector<int64_t> mine(whole.size(), 0);
      for (size_t p = static_cast<size_t>(r); p < parts.size(); p += static_cast<size_t>(world))
        for (size_t i = 0; i < mine.size(); ++i) mine[i] += parts[p][i];
      ShardedAdamW sharded(*params[static_cast<size_t>(r)], &comm, cfg);
      for (int step = 0; step < 2; ++step) sharded.step_fixed(mine, 1e-2f);
    });
    for (int r = 0; r < world; ++r)
      for (size_t t = 0; t < one.storage().size(); ++t) {
        INFO(one.storage()[t].name << " on rank " << r);
        CHECK(test::max_abs_diff(test::to_f64(params[static_cast<size_t>(r)]->storage()[t].tensor),
                                 test::to_f64(one.storage()[t].tensor)) == 0);
      }
  }
}

TEST_CASE("ShardedAdamW with one rank's gradients takes AdamW's steps bitwise", "[unit]") {
  // What a data-parallel job whose minibatches each lie on one rank sums: that rank's gradients
  // plus zeros. The global norm (and so the clipping) must be AdamW's to the bit.
  const model::ModelConfig c = test::micro_model_config(true);
  AdamWConfig cfg;
  cfg.max_grad_norm = 0.5f;
  std::vector<std::unique_ptr<Weights>> grads;
  for (uint64_t seed : {200, 300, 400}) {
    grads.push_back(std::make_unique<Weights>(c, DType::f32));
    test::fill_uniform(*grads.back(), seed);
  }
  Weights one(c, DType::f32);
  test::fill_uniform(one, 1);
  std::vector<float> norms;
  {
    AdamW adamw(one, cfg);
    for (const auto& g : grads) norms.push_back(adamw.step(*g, 1e-2f).grad_norm);
  }
  for (const int world : {2, 3}) {
    INFO("world " << world);
    const test::TempDir tmp("sharded-one-rank");
    Weights zeros(c, DType::f32);
    zeros.zero();
    std::vector<std::unique_ptr<Weights>> params;
    for (int r = 0; r < world; ++r) {
      params.push_back(std::make_unique<Weights>(c, DType::f32));
      test::fill_uniform(*params.back(), 1);
    }
    std::vector<std::vector<float>> seen(static_cast<size_t>(world));
    on_ranks(world, tmp.file("store"), [&](int r, Communicator& comm) {
      ShardedAdamW sharded(*params[static_cast<size_t>(r)], &comm, cfg);
      // Step k's gradients on rank k mod world.
      for (size_t k = 0; k < grads.size(); ++k) {
        const bool holds = static_cast<int>(k) % world == r;
        seen[static_cast<size_t>(r)].push_back(
            sharded.step(holds ? *grads[k] : zeros, 1e-2f).grad_norm);
      }
    });
    for (int r = 0; r < world; ++r) {
      CHECK(seen[static_cast<size_t>(r)] == norms);
      for (size_t t = 0; t < one.storage().size(); ++t) {
        INFO(one.storage()[t].name << " on rank " << r);
        CHECK(test::max_abs_diff(test::to_f64(params[static_cast<size_t>(r)]->storage()[t].tensor),
                                 test::to_f64(one.storage()[t].tensor)) == 0);
      }
    }
  }
}

}  // namespace tandem::trainer
