// PolicyTrainer: the step-0 identities with samples from the rollout engine, micro-batch
// invariance, bad batches, and a tiny model that learns a toy reward (emit ids below 10).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <deque>

#include "kernels/ops.h"
#include "rollout/engine.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/checkpoint.h"
#include "trainer/train_step.h"

using namespace tandem;
using namespace tandem::trainer;

namespace {

rollout::EngineOptions engine_options() {
  rollout::EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 512;
  o.max_batch_tokens = 512;
  o.max_seqs = 128;
  o.max_context = 64;
  return o;
}

// G samples of each prompt from the engine, scored by `reward`, with group advantages.
std::vector<TrainSample> rollout_samples(
    rollout::Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int G,
    int max_tokens, uint64_t seed, const std::function<float(const std::vector<int32_t>&)>& reward,
    double* mean_reward = nullptr) {
  std::vector<rollout::Request> reqs;
  for (size_t p = 0; p < prompts.size(); ++p) {
    rollout::SamplingParams sp;
    sp.n = G;
    sp.max_tokens = max_tokens;
    sp.seed = seed + 1000 * p;
    reqs.push_back({std::to_string(p), prompts[p], sp});
  }
  const auto outs = engine.generate(reqs);
  std::vector<TrainSample> samples;
  std::vector<float> rewards;
  std::vector<int32_t> groups;
  for (const auto& o : outs) {
    REQUIRE(o.status == rollout::RequestStatus::done);
    groups.push_back(static_cast<int32_t>(o.samples.size()));
    for (const auto& s : o.samples) {
      samples.push_back({o.prompt, s.tokens, s.logprobs, 0.0f});
      rewards.push_back(reward(s.tokens));
    }
  }
  const Advantages adv = compute_advantages(rewards, groups, AdvantageConfig{});
  for (size_t i = 0; i < samples.size(); ++i) samples[i].advantage = adv.values[i];
  if (mean_reward != nullptr) *mean_reward = adv.stats.reward_mean;
  return samples;
}

std::vector<std::vector<int32_t>> prompts_of(int n, int len, int64_t V, uint64_t seed) {
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n; ++i) {
    const Tensor ids = test::random_ints({len}, DType::i32, seed + static_cast<uint64_t>(i), 0, V);
    out.emplace_back(ids.data_as<int32_t>(), ids.data_as<int32_t>() + len);
  }
  return out;
}

// The toy reward: the share of completion tokens with an id below 10 (about 10% at random).
float small_ids(const std::vector<int32_t>& t) {
  return static_cast<float>(std::count_if(t.begin(), t.end(), [](int32_t x) { return x < 10; })) /
         static_cast<float>(t.size());
}

}  // namespace

TEST_CASE("train step at step 0 has ratio 1 and KL 0 with the rollout's logprobs", "[unit]") {
  // In both CPU matmul precisions: bf16 rounds the operands (AMX where the CPU has it), and
  // the engine's decode and the trainer's packed forward still compute alike.
  for (const auto precision : {ops::MatmulPrecision::f32, ops::MatmulPrecision::bf16}) {
    INFO("bf16 matmuls: " << (precision == ops::MatmulPrecision::bf16));
    const ops::ScopedMatmulPrecision scope(precision);
    const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::qwen3);
    model::Weights policy(cfg, DType::f32), ref(cfg, DType::f32);
    test::fill_random_weights(policy, 3);
    ref.copy_from(policy);
    rollout::Engine engine(policy, engine_options());
    const auto samples =
        rollout_samples(engine, prompts_of(3, 5, cfg.vocab_size, 1), 4, 6, 9, small_ids);

    AdamW opt(policy, AdamWConfig{});
    const LrSchedule lr(LrScheduleConfig{.lr = 1e-3f});
    TrainStepConfig tc;
    tc.loss.kl_beta = 0.1;
    tc.always_recompute_old = true;  // measures rollout vs trainer logprobs
    PolicyTrainer trainer(opt, &ref, lr, tc);
    const TrainStepMetrics m = trainer.step(samples);
    CHECK(m.old_recomputed);
    // The engine's logprobs are the training forward's, bitwise.
    CHECK(m.rollout_vs_trainer_max_abs == 0.0);
    CHECK(m.policy.ratio_min == 1.0);
    CHECK(m.policy.ratio_max == 1.0);
    CHECK(m.policy.kl_ref_sum == 0.0);
    CHECK(m.policy.clipped_low + m.policy.clipped_high == 0);
    CHECK(m.optimizer_steps == 1);
    CHECK(std::isfinite(m.grad_norm));
    CHECK(m.grad_norm > 0);
  }
}

TEST_CASE("train step loss and gradient do not depend on the micro-batch split", "[unit]") {
  const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::llama_tied);
  model::Weights init(cfg, DType::f32);
  test::fill_random_weights(init, 5);
  rollout::Engine engine(init, engine_options());
  const auto samples =
      rollout_samples(engine, prompts_of(4, 6, cfg.vocab_size, 2), 4, 5, 4, small_ids);
  int64_t packed = 0;
  for (const auto& s : samples)
    packed += static_cast<int64_t>(s.prompt.size() + s.completion.size()) - 1;

  std::vector<TrainStepMetrics> runs;
  for (int parts : {1, 2, 4}) {
    model::Weights policy(cfg, DType::f32);
    policy.copy_from(init);
    AdamW opt(policy, AdamWConfig{});
    const LrSchedule lr(LrScheduleConfig{.lr = 1e-3f});
    TrainStepConfig tc;
    tc.loss.aggregation = LossAggregation::kSeqMeanTokenMean;
    tc.micro_batch_tokens = (packed + parts - 1) / parts;
    PolicyTrainer trainer(opt, nullptr, lr, tc);
    runs.push_back(trainer.step(samples));
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    CHECK(runs[i].loss == Approx(runs[0].loss).epsilon(1e-6));
    CHECK(runs[i].grad_norm == Approx(runs[0].grad_norm).epsilon(1e-6));
  }
}

TEST_CASE("train step with shared prompts: the same logprobs bitwise, the same update", "[unit]") {
  const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::qwen2);
  model::Weights init(cfg, DType::f32);
  test::fill_random_weights(init, 6);
  rollout::Engine engine(init, engine_options());
  const auto samples =
      rollout_samples(engine, prompts_of(4, 9, cfg.vocab_size, 3), 4, 5, 5, small_ids);
  std::deque<model::Weights> after;  // not movable
  std::vector<TrainStepMetrics> runs;
  std::vector<std::vector<float>> logps;
  // Whole samples; shared prompts in one micro-batch; shared with groups split over micro-batches.
  for (auto [share, budget] :
       {std::pair{false, int64_t{4096}}, {true, int64_t{4096}}, {true, 20}}) {
    after.emplace_back(cfg, DType::f32);
    after.back().copy_from(init);
    AdamW opt(after.back(), AdamWConfig{});
    const LrSchedule lr(LrScheduleConfig{.lr = 1e-3f});
    TrainStepConfig tc;
    tc.share_prompts = share;
    tc.micro_batch_tokens = budget;
    tc.always_recompute_old = true;
    PolicyTrainer trainer(opt, nullptr, lr, tc);
    logps.push_back(trainer.logprobs(after.back(), samples));
    runs.push_back(trainer.step(samples));
  }
  // 4 prompts of 9 tokens, 4 samples each: whole samples run 9 + n - 1 rows each; shared, a
  // group's prompt runs 8 rows once per micro-batch it is in.
  int64_t whole = 0, completions = 0;
  for (const TrainSample& s : samples) {
    whole += static_cast<int64_t>(s.prompt.size() + s.completion.size()) - 1;
    completions += static_cast<int64_t>(s.completion.size());
  }
  CHECK(runs[0].packed_tokens == whole);
  CHECK(runs[1].packed_tokens == completions + 4 * 8);
  CHECK(runs[2].packed_tokens > runs[1].packed_tokens);
  CHECK(runs[2].packed_tokens < runs[0].packed_tokens);
  for (size_t i = 1; i < runs.size(); ++i) {
    INFO("run " << i);
    CHECK(logps[i] == logps[0]);
    CHECK(runs[i].rollout_vs_trainer_max_abs == 0.0);
    CHECK(runs[i].policy.entropy_sum == runs[0].policy.entropy_sum);
    CHECK(runs[i].loss == Approx(runs[0].loss).epsilon(1e-6));
    CHECK(runs[i].grad_norm == Approx(runs[0].grad_norm).epsilon(1e-5));
    for (size_t t = 0; t < init.storage().size(); ++t) {
      const std::vector<double> a = test::to_f64(after[0].storage()[t].tensor);
      const std::vector<double> b = test::to_f64(after[i].storage()[t].tensor);
      INFO(init.storage()[t].name);
      CHECK(test::max_abs_diff(a, b) <= 1e-5 * test::max_abs(a));
    }
  }
}

TEST_CASE("train steps with the activations released between them are bitwise unchanged",
          "[unit]") {
  const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::llama_tied);
  model::Weights init(cfg, DType::f32);
  test::fill_random_weights(init, 9);
  rollout::Engine engine(init, engine_options());
  const auto samples =
      rollout_samples(engine, prompts_of(4, 6, cfg.vocab_size, 3), 4, 5, 6, small_ids);
  std::vector<std::vector<double>> losses;
  std::vector<std::unique_ptr<model::Weights>> finals;
  for (bool release : {false, true}) {
    auto policy = std::make_unique<model::Weights>(cfg, DType::f32);
    policy->copy_from(init);
    model::Weights ref(cfg, DType::f32);
    ref.copy_from(init);
    AdamW opt(*policy, AdamWConfig{});
    const LrSchedule lr(LrScheduleConfig{.lr = 1e-3f});
    TrainStepConfig tc;
    tc.loss.kl_beta = 0.01;
    tc.micro_batch_tokens = 64;
    PolicyTrainer trainer(opt, &ref, lr, tc);
    losses.emplace_back();
    for (int s = 0; s < 3; ++s) {
      losses.back().push_back(trainer.step(samples).loss);
      if (release) trainer.release_activations();
    }
    finals.push_back(std::move(policy));
  }
  CHECK(losses[0] == losses[1]);
  for (size_t i = 0; i < finals[0]->storage().size(); ++i)
    CHECK(test::bitwise_equal(finals[0]->storage()[i].tensor, finals[1]->storage()[i].tensor));
}

TEST_CASE("train step refuses batches the minibatches do not divide", "[unit]") {
  const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::llama_tied);
  model::Weights policy(cfg, DType::f32);
  test::fill_random_weights(policy, 6);
  AdamW opt(policy, AdamWConfig{});
  const LrSchedule lr(LrScheduleConfig{.lr = 1e-3f});
  TrainStepConfig tc;
  tc.minibatches = 2;
  PolicyTrainer trainer(opt, nullptr, lr, tc);
  std::vector<TrainSample> three(3, TrainSample{{1, 2}, {3}, {-1.0f}, 0.5f});
  CHECK_THROWS_WITH(trainer.step(three), Catch::Contains("do not divide"));
  tc.loss.kl_beta = 0.1;
  CHECK_THROWS_WITH(PolicyTrainer(opt, nullptr, lr, tc), Catch::Contains("reference"));
}

TEST_CASE("a tiny model learns to emit small token ids with GRPO", "[unit]") {
  const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::llama_tied);
  model::Weights policy(cfg, DType::f32);
  test::fill_random_weights(policy, 11);
  rollout::Engine engine(policy, engine_options());
  AdamWConfig ac;
  ac.weight_decay = 0;
  AdamW opt(policy, ac);
  const LrSchedule lr(LrScheduleConfig{.lr = 2e-2f});
  TrainStepConfig tc;
  tc.epochs = 2;  // old logprobs recomputed, clipping active
  PolicyTrainer trainer(opt, nullptr, lr, tc);
  const auto prompts = prompts_of(8, 4, cfg.vocab_size, 3);
  double first = 0, last = 0;
  for (int step = 0; step < 25; ++step) {
    double mean = 0;
    const auto samples = rollout_samples(engine, prompts, 8, 8, 100 + step, small_ids, &mean);
    if (step == 0) first = mean;
    last = mean;
    trainer.step(samples);
    engine.set_weights(policy, static_cast<uint64_t>(step + 1));
  }
  WARN("share of ids below 10: " << first << " at step 0, " << last << " at step 24");
  CHECK(first < 0.2);
  CHECK(last > 0.6);
}

TEST_CASE("training resumed from a checkpoint is bitwise the same as training straight", "[unit]") {
  const model::ModelConfig cfg = test::tiny_model_config(test::TinyKind::qwen2);
  const auto prompts = prompts_of(4, 4, cfg.vocab_size, 8);
  LrScheduleConfig lc;
  lc.kind = LrScheduleKind::cosine;
  lc.lr = 1e-2f;
  lc.warmup_steps = 2;
  lc.total_steps = 8;
  const LrSchedule lr(lc);
  TrainStepConfig tc;
  tc.minibatches = 2;
  tc.loss.kl_beta = 0.05;

  // A "process": fresh weights, optimizer, trainer and engine; runs trainer steps [from, to),
  // after loading `resume_dir` when given; returns the checkpoint it writes at the end.
  const test::TempDir tmp("train-resume");
  auto run = [&](int from, int to, const std::string& resume_dir, const std::string& root) {
    model::Weights policy(cfg, DType::f32), ref(cfg, DType::f32);
    test::fill_random_weights(policy, 21);
    ref.copy_from(policy);
    AdamW opt(policy, AdamWConfig{});
    TrainerState state;
    if (!resume_dir.empty()) load_checkpoint(resume_dir, policy, opt, state);
    REQUIRE(state.step == from);
    PolicyTrainer trainer(opt, &ref, lr, tc);
    trainer.set_steps_done(state.extra.value("optimizer_steps", int64_t{0}));
    rollout::Engine engine(policy, engine_options());
    engine.set_weights(policy, static_cast<uint64_t>(state.weight_version));
    for (int step = from; step < to; ++step) {
      const auto samples = rollout_samples(engine, prompts, 4, 6, 7 + step, small_ids);
      trainer.step(samples);
      state.step = step + 1;
      state.weight_version = step + 1;
      engine.set_weights(policy, static_cast<uint64_t>(state.weight_version));
    }
    state.extra["optimizer_steps"] = trainer.steps_done();
    return save_checkpoint(root, state.step, policy, opt, state);
  };
  const std::string straight = run(0, 4, "", tmp.file("a"));
  const std::string half = run(0, 2, "", tmp.file("b"));
  const std::string resumed = run(2, 4, half, tmp.file("b"));

  model::Weights pa(cfg, DType::f32), pb(cfg, DType::f32);
  AdamW oa(pa, AdamWConfig{}), ob(pb, AdamWConfig{});
  TrainerState sa, sb;
  load_checkpoint(straight, pa, oa, sa);
  load_checkpoint(resumed, pb, ob, sb);
  CHECK(sa.step == 4);
  CHECK(sa == sb);
  CHECK(oa.step_count() == ob.step_count());
  for (size_t i = 0; i < pa.storage().size(); ++i) {
    INFO(pa.storage()[i].name);
    CHECK(test::bitwise_equal(pa.storage()[i].tensor, pb.storage()[i].tensor));
    CHECK(test::bitwise_equal(oa.m().storage()[i].tensor, ob.m().storage()[i].tensor));
    CHECK(test::bitwise_equal(oa.v().storage()[i].tensor, ob.v().storage()[i].tensor));
  }
}
