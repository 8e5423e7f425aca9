// PolicyTrainer over ShardedAdamW at every sharding level: ranks as threads of one process, the
// batch split by groups, the deterministic update's weights bitwise those of one rank; and the
// unit hooks' bounds (gradient buckets, gathered units).
#include <catch2/catch.hpp>

#include <vector>

#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "tests/trainer/train_samples.h"
#include "trainer/train_step.h"

namespace tandem::trainer {
namespace {

TrainStepConfig step_config() {
  TrainStepConfig tc;
  tc.deterministic = true;
  tc.micro_batch_tokens = 24;  // several micro-batches, a different number on each rank
  tc.minibatches = 2;          // two optimizer steps a step, the old logprobs recomputed
  tc.loss.kl_beta = 0;
  return tc;
}

// The policy's f32 weights after `steps` training steps on `world` ranks at `level`, flattened in
// storage order (gathered unit by unit at ShardLevel::parameters).
std::vector<float> train(const model::ModelConfig& cfg, ShardLevel level, int world, bool overlap,
                         int64_t bucket_bytes, const std::vector<TrainSample>& batch, int steps,
                         std::vector<CommStats>* stats = nullptr) {
  std::vector<float> result;
  const test::TempDir tmp("sharded-training");
  test::on_ranks(world, tmp.file("store"), [&](int r, Communicator& comm) {
    model::Weights w(cfg, DType::f32);
    test::fill_random_weights(w, 7);
    ShardOptions so;
    so.level = level;
    so.overlap = overlap;
    so.bucket_bytes = bucket_bytes;
    so.deterministic = true;
    AdamWConfig ac;
    ac.max_grad_norm = 0.05f;  // clipped: the global norm decides
    ShardedAdamW opt(w, world > 1 ? &comm : nullptr, ac, so);
    const LrSchedule lr(LrScheduleConfig{.lr = 1e-2f});
    PolicyTrainer trainer(opt, nullptr, lr, step_config());
    // Rank r trains the groups g with g % world == r.
    BatchShard shard;
    std::vector<TrainSample> mine;
    for (size_t i = 0; i < batch.size(); ++i) {
      shard.lengths.push_back(static_cast<int64_t>(batch[i].completion.size()));
      if (batch[i].group % world == r) {
        shard.positions.push_back(i);
        mine.push_back(batch[i]);
      }
    }
    for (int s = 0; s < steps; ++s) trainer.step(mine, world > 1 ? &shard : nullptr);
    if (stats != nullptr && r == 0) stats->push_back(opt.take_comm_stats());
    std::vector<float> flat;
    if (level == ShardLevel::parameters) {
      for (size_t u = 0; u < opt.layout().units().size(); ++u) {
        Tensor t = Tensor::empty({opt.layout().units()[u].flat.size()}, DType::f32);
        opt.gather_unit(u, t);
        flat.insert(flat.end(), t.data_as<float>(), t.data_as<float>() + t.numel());
      }
    } else {
      for (const model::NamedTensor& s : opt.params().storage())
        flat.insert(flat.end(), s.tensor.data_as<float>(),
                    s.tensor.data_as<float>() + s.tensor.numel());
    }
    if (r == 0) result = flat;
  });
  return result;
}

}  // namespace

TEST_CASE("every sharding level on 1 2 and 4 ranks trains the weights of one rank bitwise",
          "[unit]") {
  for (const test::TinyKind kind : {test::TinyKind::llama_tied, test::TinyKind::qwen2}) {
    const model::ModelConfig cfg = test::tiny_model_config(kind);
    INFO(test::tiny_kind_name(kind));
    const std::vector<TrainSample> batch = test::random_train_batch(4, 3, cfg.vocab_size, 5);
    const std::vector<float> one = train(cfg, ShardLevel::optimizer, 1, true, 32 << 20, batch, 2);
    {
      // The weights moved.
      model::Weights w(cfg, DType::f32);
      test::fill_random_weights(w, 7);
      size_t k = 0, moved = 0;
      for (const model::NamedTensor& s : w.storage())
        for (int64_t i = 0; i < s.tensor.numel(); ++i, ++k)
          moved += s.tensor.data_as<float>()[i] != one[k] ? 1 : 0;
      CHECK(moved > one.size() / 2);
    }
    for (const ShardLevel level :
         {ShardLevel::optimizer, ShardLevel::gradients, ShardLevel::parameters})
      for (const int world : {1, 2, 4}) {
        INFO(shard_level_name(level) << " on " << world << " ranks");
        // Small buckets: a unit's collectives go in pieces; overlap off on 2 ranks.
        const std::vector<float> got =
            train(cfg, level, world, world != 2, world == 4 ? 64 << 10 : 32 << 20, batch, 2);
        REQUIRE(got.size() == one.size());
        size_t differ = 0;
        for (size_t i = 0; i < got.size(); ++i) differ += got[i] != one[i] ? 1 : 0;
        CHECK(differ == 0);
      }
  }
}

}  // namespace tandem::trainer
