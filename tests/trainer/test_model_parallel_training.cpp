// PolicyTrainer on tensor-parallel ranks (ModelParallel::tp): each rank trains its shard of the
// policy; the losses, gradient norms and weights after two steps are the one-rank job's but for
// the rounding of sums split by rank, and with data parallelism beside tensor parallelism the
// deterministic update has the same bits on 1 and 2 data-parallel ranks. On pipeline stages
// (ModelParallel::pp, 1F1B through trainer::run_pipeline), with the optimizer state, the
// gradients or the parameters sharded over data-parallel ranks: the one-rank weights bitwise with
// untied embeddings, up to rounding with tied ones (the two copies' gradients are added once per
// step rather than per micro-batch).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "model/tensor_parallel.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "tests/trainer/train_samples.h"
#include "trainer/parallel/grid.h"
#include "trainer/train_step.h"

namespace tandem::trainer {
namespace {

// The tiny tied Llama with a vocabulary 2 ranks split (H = 4, Hkv = 2, F = 96).
model::ModelConfig splittable_config() {
  model::ModelConfig c = test::tiny_model_config(test::TinyKind::llama_tied);
  c.vocab_size = 102;
  return c;
}

// Puts the tensors of tensor-parallel rank t of tp's weights (a shard, or a part of one) back
// where model::tp_slice cut them from `full`.
void place(model::Weights& full, const model::Weights& piece, int t, int tp) {
  const model::ModelConfig& cfg = full.config();
  const model::TpSplit split = model::tp_split(cfg, t, tp);
  for (const model::NamedTensor& n : piece.named()) {
    const model::TpSlice s = model::tp_slice(cfg, split, n.name);
    const Tensor dst = full.at(n.name);
    const int64_t rows = dst.size(0), cols = dst.ndim() > 1 ? dst.size(1) : 1;
    const float* src = n.tensor.data_as<float>();
    float* out = dst.data_as<float>();
    if (s.dim == 1) {
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < s.length; ++j) out[i * cols + s.begin + j] = src[i * s.length + j];
    } else {
      std::copy(src, src + n.tensor.numel(), out + s.begin * cols);
    }
  }
}

struct Run {
  std::vector<double> loss;
  std::vector<float> grad_norm;
  std::unique_ptr<model::Weights> weights;  // the whole f32 policy after the steps
};

// `steps` training steps on dp x tp x pp ranks in the grid's order (rank (s dp + d) tp + t): each
// rank holds stage s's model::ModelPart of tensor-parallel shard t (the whole shard when pp = 1),
// the last stage the loss; data-parallel rank d trains the groups g with g % dp == d.
Run train(const model::ModelConfig& cfg, int dp, int tp, int pp, ShardLevel level,
          const std::vector<TrainSample>& batch, int steps) {
  model::Weights start(cfg, DType::f32);
  test::fill_random_weights(start, 7);
  Run run;
  run.weights = std::make_unique<model::Weights>(cfg, DType::f32);
  const bool tied = cfg.tie_word_embeddings;
  const std::string embed = "model.embed_tokens.weight";
  std::vector<std::unique_ptr<model::Weights>> parts(static_cast<size_t>(pp * tp));
  const auto rank = [&](int s, int d, int t) { return (s * dp + d) * tp + t; };
  const test::TempDir tmp("pp-training");
  test::on_ranks(dp * tp * pp, tmp.file("store"), [&](int r, Communicator& world) {
    const int t = r % tp, d = (r / tp) % dp, s = r / (tp * dp);
    std::vector<int> dp_ranks, pp_ranks, tp_ranks, mp_ranks;
    for (int j = 0; j < dp; ++j) dp_ranks.push_back(rank(s, j, t));
    for (int k = 0; k < pp; ++k) pp_ranks.push_back(rank(k, d, t));
    for (int k = 0; k < tp; ++k) tp_ranks.push_back(rank(s, d, k));
    for (int k = 0; k < pp; ++k)
      for (int j = 0; j < tp; ++j) mp_ranks.push_back(rank(k, d, j));
    std::unique_ptr<Communicator> dp_group, pp_group, tp_group, mp_group, tie_group;
    if (dp > 1)
      dp_group = world.split("dp" + std::to_string(s) + "." + std::to_string(t), dp_ranks);
    if (pp > 1)
      pp_group = world.split("pp" + std::to_string(d) + "." + std::to_string(t), pp_ranks);
    if (tp > 1) {
      tp_group = world.split("tp" + std::to_string(s) + "." + std::to_string(d), tp_ranks);
      mp_group = world.split("mp" + std::to_string(d), mp_ranks);
    }
    const bool copies = tied && pp > 1;  // the embedding on the first stage and the last
    if (copies && (s == 0 || s == pp - 1))
      tie_group = world.split("tie" + std::to_string(d) + "." + std::to_string(t),
                              {rank(0, d, t), rank(pp - 1, d, t)});
    const std::unique_ptr<model::Weights> shard = model::cut_tp_shard(start, t, tp);
    const StageLayers layers = stage_layers(static_cast<int>(cfg.num_layers), s, pp);
    model::Weights w(
        shard->config(),
        model::ModelPart::stage(shard->config(), layers.first, layers.end - layers.first),
        DType::f32);
    w.copy_from(*shard);
    ShardOptions so;
    so.level = level;
    so.deterministic = true;
    so.model_parallel = tp > 1 ? mp_group.get() : pp_group.get();
    if (tie_group) so.shared = {{embed, tie_group.get()}};
    if (copies && s == pp - 1) so.norm_excluded = {embed};  // stage 0 counts it
    if (t > 0)  // tensor-parallel rank 0 counts the replicated norms
      for (const model::NamedTensor& n : w.storage())
        if (n.name.find("norm") != std::string::npos) so.norm_excluded.push_back(n.name);
    AdamWConfig ac;
    ac.max_grad_norm = 0.05f;
    ac.eps = 1e-3f;
    ShardedAdamW opt(w, dp_group.get(), ac, so);
    const LrSchedule lr(LrScheduleConfig{.lr = 1e-2f});
    TrainStepConfig tc;
    tc.deterministic = true;
    tc.micro_batch_tokens = 24;
    tc.minibatches = 2;
    tc.loss.kl_beta = 0;
    PolicyTrainer trainer(
        opt, nullptr, lr, tc,
        ModelParallel{.tp = tp_group.get(), .pp = pp_group.get(), .tp_kv_heads = cfg.num_kv_heads});
    BatchShard shard_of_batch;
    std::vector<TrainSample> mine;
    for (size_t i = 0; i < batch.size(); ++i) {
      shard_of_batch.lengths.push_back(static_cast<int64_t>(batch[i].completion.size()));
      if (batch[i].group % dp == d) {
        shard_of_batch.positions.push_back(i);
        mine.push_back(batch[i]);
      }
    }
    for (int step = 0; step < steps; ++step) {
      const TrainStepMetrics m = trainer.step(mine, dp > 1 ? &shard_of_batch : nullptr);
      if (r == 0) {
        run.loss.push_back(m.loss);
        run.grad_norm.push_back(m.grad_norm);
      }
    }
    auto out = std::make_unique<model::Weights>(w.config(), w.part(), DType::f32);
    if (level == ShardLevel::parameters) {  // each unit gathered from the data-parallel ranks
      const model::ShardLayout& layout = opt.layout();
      for (size_t u = 0; u < layout.units().size(); ++u) {
        const model::FlatRange f = layout.units()[u].flat;
        const Tensor unit = Tensor::empty({f.size()}, DType::f32);
        opt.gather_unit(u, unit);
        layout.for_each_piece(f.begin, f.end, [&](size_t i, int64_t off, int64_t at, int64_t n) {
          std::memcpy(out->storage()[i].tensor.data_as<float>() + off, unit.data_as<float>() + at,
                      static_cast<size_t>(n) * sizeof(float));
        });
      }
    } else {
      out->copy_from(opt.params());
    }
    if (d == 0) parts[static_cast<size_t>(s * tp + t)] = std::move(out);
  });
  for (int i = 0; i < pp * tp; ++i) {
    REQUIRE(parts[static_cast<size_t>(i)] != nullptr);
    place(*run.weights, *parts[static_cast<size_t>(i)], i % tp, tp);
  }
  return run;
}

double max_abs_diff(const model::Weights& a, const model::Weights& b) {
  double worst = 0;
  for (size_t t = 0; t < a.storage().size(); ++t) {
    const float* x = a.storage()[t].tensor.data_as<float>();
    const float* y = b.storage()[t].tensor.data_as<float>();
    for (int64_t i = 0; i < a.storage()[t].tensor.numel(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(x[i]) - y[i]));
  }
  return worst;
}

bool same_bits(const model::Weights& a, const model::Weights& b) {
  for (size_t t = 0; t < a.storage().size(); ++t)
    if (std::memcmp(a.storage()[t].tensor.data(), b.storage()[t].tensor.data(),
                    a.storage()[t].tensor.nbytes()) != 0)
      return false;
  return true;
}

}  // namespace

TEST_CASE("tensor-parallel training on 2 ranks trains the weights of one rank up to rounding",
          "[unit]") {
  const model::ModelConfig cfg = splittable_config();
  const std::vector<TrainSample> batch = test::random_train_batch(4, 3, cfg.vocab_size, 11, -4.0f);
  for (const ShardLevel level : {ShardLevel::optimizer, ShardLevel::gradients}) {
    INFO("trainer.shard = " << shard_level_name(level));
    const Run one = train(cfg, 1, 1, 1, level, batch, 2);
    const Run tp2 = train(cfg, 1, 2, 1, level, batch, 2);
    const Run dp2tp2 = train(cfg, 2, 2, 1, level, batch, 2);
    for (size_t s = 0; s < one.loss.size(); ++s) {
      // The logprobs' and the gradients' sums are split by rank: f32 rounding, not bits.
      CHECK(std::abs(tp2.loss[s] - one.loss[s]) <= 1e-5 * (std::abs(one.loss[s]) + 1e-3));
      CHECK(std::abs(tp2.grad_norm[s] - one.grad_norm[s]) <= 1e-5f * one.grad_norm[s]);
      // (The reported loss adds the data-parallel ranks' parts in another order.)
      CHECK(std::abs(dp2tp2.loss[s] - tp2.loss[s]) <= 1e-12 * std::abs(tp2.loss[s]));
      CHECK(dp2tp2.grad_norm[s] == tp2.grad_norm[s]);
    }
    // Two clipped steps of lr 1e-2 move weights by up to 2e-2; rounding moves them far less.
    CHECK(max_abs_diff(*tp2.weights, *one.weights) < 2e-6);
    CHECK(max_abs_diff(*tp2.weights, *one.weights) > 0);  // the sums really were split
    // Data parallelism beside tensor parallelism: the deterministic update's bits.
    CHECK(same_bits(*dp2tp2.weights, *tp2.weights));
  }
}

TEST_CASE(
    "pipeline stages under 1F1B train the weights of one rank at every sharding level and bitwise "
    "when untied",
    "[unit]") {
  for (const bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied") << " embeddings");
    model::ModelConfig cfg = test::tiny_model_config(tied ? test::TinyKind::llama_tied
                                                          : test::TinyKind::llama_untied_rope3);
    cfg.num_layers = 4;
    const std::vector<TrainSample> batch =
        test::random_train_batch(4, 3, cfg.vocab_size, 23, -4.0f);
    const Run one = train(cfg, 1, 1, 1, ShardLevel::optimizer, batch, 2);
    struct Case {
      int dp, pp;
      ShardLevel level;
    };
    for (const Case& k : {Case{1, 2, ShardLevel::optimizer}, Case{1, 3, ShardLevel::optimizer},
                          Case{2, 2, ShardLevel::optimizer}, Case{2, 2, ShardLevel::gradients},
                          Case{2, 2, ShardLevel::parameters}, Case{1, 3, ShardLevel::parameters},
                          // Replicas of 2, 1 and 1 groups: idle passes in the schedule.
                          Case{3, 2, ShardLevel::parameters}}) {
      const int dp = k.dp, pp = k.pp;
      INFO("dp " << dp << " x pp " << pp << ", trainer.shard = " << shard_level_name(k.level));
      const Run run = train(cfg, dp, 1, pp, k.level, batch, 2);
      REQUIRE(run.loss.size() == one.loss.size());
      // Tied: each micro-batch's embedding gradient is the head's and the embedding's added in f32
      // on one rank, the two copies' fixed-point sums added once a step on a pipeline.
      const double loss_tol = tied ? 1e-6 : 1e-12;
      for (size_t s = 0; s < one.loss.size(); ++s) {
        CHECK(std::abs(run.loss[s] - one.loss[s]) <= loss_tol * std::abs(one.loss[s]));
        if (tied)
          CHECK(std::abs(run.grad_norm[s] - one.grad_norm[s]) <= 1e-5f * one.grad_norm[s]);
        else
          CHECK(run.grad_norm[s] == one.grad_norm[s]);
      }
      if (tied) {
        CHECK(max_abs_diff(*run.weights, *one.weights) < 1e-6);
      } else {
        CHECK(same_bits(*run.weights, *one.weights));
      }
    }
  }
}

TEST_CASE(
    "tensor-parallel pipeline stages (TP 2 x PP 2) train the weights of one rank up to "
    "rounding",
    "[unit]") {
  for (const bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied") << " embeddings");
    model::ModelConfig cfg = splittable_config();
    cfg.tie_word_embeddings = tied;
    cfg.num_layers = 4;
    const std::vector<TrainSample> batch =
        test::random_train_batch(4, 3, cfg.vocab_size, 29, -4.0f);
    const Run one = train(cfg, 1, 1, 1, ShardLevel::optimizer, batch, 2);
    const Run grid = train(cfg, 1, 2, 2, ShardLevel::optimizer, batch, 2);
    const Run tp2 = train(cfg, 1, 2, 1, ShardLevel::optimizer, batch, 2);
    for (size_t s = 0; s < one.loss.size(); ++s) {
      CHECK(std::abs(grid.loss[s] - one.loss[s]) <= 1e-5 * (std::abs(one.loss[s]) + 1e-3));
      CHECK(std::abs(grid.grad_norm[s] - one.grad_norm[s]) <= 1e-5f * one.grad_norm[s]);
    }
    CHECK(max_abs_diff(*grid.weights, *one.weights) < 2e-6);
    // Untied, the stages add nothing to tensor parallelism's rounding: TP 2's weights bitwise.
    if (!tied) CHECK(same_bits(*grid.weights, *tp2.weights));
  }
}

}  // namespace tandem::trainer
