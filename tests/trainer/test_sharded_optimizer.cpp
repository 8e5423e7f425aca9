// ShardedAdamW against AdamW on the summed gradients: ranks as threads of one process meeting in
// a file store (Gloo over loopback), 1 to 3 of them, ranges that cross storage tensors; the state
// exported and imported at another world size; the fixed-point step bitwise on any world size.
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
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

using model::NamedTensor;
using model::Weights;

void fill_random(Weights& w, uint64_t seed) {
  for (const NamedTensor& s : w.storage()) {
    Tensor t = s.tensor;
    t.copy_from(test::random_tensor(t.shape(), t.dtype(), ++seed, -1.0, 1.0));
  }
}

// Runs fn(rank, comm) on `world` threads joined in a file store under dir.
template <class Fn>
void on_ranks(int world, const std::string& dir, Fn fn) {
  std::filesystem::create_directories(dir);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        rendezvous::RankInfo info;
        info.rank = r;
        info.world_size = world;
        info.master_addr = "127.0.0.1";
        info.launcher = "test";
        CommOptions o;
        o.timeout_s = 30;
        o.store = "file:" + dir;
        std::unique_ptr<Communicator> comm = Communicator::create(info, o);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors) CHECK(e.empty());
}

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
    fill_random(ref, 1);
    AdamW adamw(ref, cfg);
    std::vector<std::unique_ptr<Weights>> grads;
    for (int r = 0; r < world; ++r) {
      grads.push_back(std::make_unique<Weights>(c, DType::f32));
      fill_random(*grads.back(), 100 + static_cast<uint64_t>(r));
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
      fill_random(*params.back(), 1);
    }
    std::vector<int64_t> sizes(static_cast<size_t>(world));
    on_ranks(world, tmp.file("store"), [&](int r, Communicator& comm) {
      ShardedAdamW sharded(*params[static_cast<size_t>(r)], &comm, cfg);
      sizes[static_cast<size_t>(r)] = sharded.end() - sharded.begin();
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

TEST_CASE("ShardedAdamW state exported on 2 ranks and imported on 3 continues as AdamW", "[unit]") {
  const model::ModelConfig c = test::micro_model_config(false);
  AdamWConfig cfg;
  Weights ref(c, DType::f32), g(c, DType::f32);
  fill_random(ref, 1);
  fill_random(g, 7);
  AdamW adamw(ref, cfg);
  adamw.step(g, 1e-2f);

  const test::TempDir tmp("sharded-adamw-export");
  Weights p2a(c, DType::f32), p2b(c, DType::f32), full_params(c, DType::f32);
  fill_random(p2a, 1);
  fill_random(p2b, 1);
  fill_random(full_params, 1);
  AdamW full(full_params, cfg);
  Weights half(c, DType::f32);  // each of 2 ranks gives g / 2
  half.copy_from(g);
  for (const NamedTensor& s : half.storage()) {
    float* x = s.tensor.data_as<float>();
    for (int64_t i = 0; i < s.tensor.numel(); ++i) x[i] *= 0.5f;
  }
  Weights* p2[] = {&p2a, &p2b};
  on_ranks(2, tmp.file("two"), [&](int r, Communicator& comm) {
    ShardedAdamW sharded(*p2[r], &comm, cfg);
    sharded.step(half, 1e-2f);
    sharded.export_to(r == 0 ? &full : nullptr);
  });
  for (size_t t = 0; t < ref.storage().size(); ++t) {
    INFO(ref.storage()[t].name);
    CHECK(test::max_abs_diff(test::to_f64(full.m().storage()[t].tensor),
                             test::to_f64(adamw.m().storage()[t].tensor)) < 1e-7);
  }
  CHECK(full.step_count() == 1);

  // Three ranks take their ranges of it and step on; AdamW steps on too.
  adamw.step(g, 1e-2f);
  std::vector<std::unique_ptr<Weights>> p3;
  for (int r = 0; r < 3; ++r) {
    p3.push_back(std::make_unique<Weights>(c, DType::f32));
    p3.back()->copy_from(p2a);
  }
  Weights third(c, DType::f32), zero(c, DType::f32);
  third.copy_from(g);
  zero.zero();
  on_ranks(3, tmp.file("three"), [&](int r, Communicator& comm) {
    ShardedAdamW sharded(*p3[static_cast<size_t>(r)], &comm, cfg);
    sharded.import_from(full);
    sharded.step(r == 0 ? third : zero, 1e-2f);  // the sum is g
    CHECK(sharded.step_count() == 2);
  });
  for (int r = 0; r < 3; ++r)
    for (size_t t = 0; t < ref.storage().size(); ++t) {
      INFO(ref.storage()[t].name << " on rank " << r);
      CHECK(test::max_abs_diff(test::to_f64(p3[static_cast<size_t>(r)]->storage()[t].tensor),
                               test::to_f64(ref.storage()[t].tensor)) < 1e-6);
    }
}

TEST_CASE("ShardedAdamW step_fixed gives the same weights bitwise on 1 2 and 3 ranks", "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  AdamWConfig cfg;
  cfg.max_grad_norm = 0.5f;
  Weights g(c, DType::f32);
  fill_random(g, 5);
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
  fill_random(one, 1);
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
      fill_random(*params.back(), 1);
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

}  // namespace tandem::trainer
