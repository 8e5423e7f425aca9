// The colocated GRPO loop.
#include "trainer/job.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "model/loader.h"
#include "rewards/factory.h"
#include "rewards/reward_set.h"
#include "rollout/engine.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/grpo.h"
#include "trainer/report.h"
#include "trainer/shaping.h"
#include "trainer/synthetic.h"
#include "trainer/train_step.h"
#include "weight_sync/local.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The prompt data: synthetic (generated, then split) or a JSONL file (split by load_dataset).
Dataset make_data(const JobConfig& job) {
  const DataSection& d = job.data;
  if (d.source == "synthetic") {
    SyntheticOptions so;
    so.task = d.task;
    so.count = d.synthetic_size;
    // Difficulty 1..5: operands of 1..d digits, two operands up to difficulty 3, then three.
    so.arithmetic.min_digits = 1;
    so.arithmetic.max_digits = static_cast<int>(std::clamp<int64_t>(d.difficulty, 1, 5));
    so.arithmetic.max_operands = d.difficulty >= 4 ? 3 : 2;
    so.arithmetic.operations = d.difficulty >= 3 ? "+-*" : "+-";
    so.arithmetic.allow_negative = d.difficulty >= 2;
    return split_dataset(make_synthetic(so, static_cast<uint64_t>(d.seed)), job.eval.split_fraction,
                         static_cast<uint64_t>(d.seed));
  }
  DataOptions o;
  o.path = d.path;
  o.prompt_field = d.prompt_field;
  if (!d.messages_field.empty()) o.messages_field = d.messages_field;
  o.answer_field = d.answer_field;
  o.extra_fields = d.extra_fields;
  o.eval_fraction = job.eval.split_fraction;
  o.seed = static_cast<uint64_t>(d.seed);
  return load_dataset(o);
}

rewards::RewardSet make_rewards(const JobConfig& job) {
  std::vector<rewards::RewardSet::Entry> entries;
  int max_failures = 3;
  for (const RewardSpec& r : job.rewards) {
    nlohmann::json opt = nlohmann::json::object();
    std::string kind = r.kind;
    if (r.kind == "builtin") {
      kind = r.function == "math_match" ? "math_answer" : r.function;
      if (kind == "regex_format") opt["pattern"] = r.pattern;
      if (kind == "length_penalty") opt["target_tokens"] = r.target_length;
    } else if (r.kind == "plugin") {
      opt["path"] = r.path;
      opt["config"] = r.config;
    } else if (r.kind == "remote") {
      opt = {{"address", r.address},
             {"timeout_ms", r.timeout_ms},
             {"retries", r.retries},
             {"max_concurrency", r.max_concurrency},
             {"batch_size", r.batch_size}};
      if (!r.token_env.empty()) {
        // The token stays out of the config file (and of --print-config and the run's logs).
        const char* token = std::getenv(r.token_env.c_str());
        TANDEM_CHECK(token != nullptr && *token != '\0',
                     "reward '{}': the environment variable {} (token_env) is not set ({})", r.name,
                     r.token_env, job.where("rewards"));
        opt["token"] = token;
      }
    } else {
      TANDEM_CHECK(false, "reward '{}': kind '{}' is not available in this build ({})", r.name,
                   r.kind, job.where("rewards"));
    }
    try {
      entries.push_back({rewards::make_reward(kind, r.name, opt), r.weight, r.fallback});
    } catch (const Error& e) {
      TANDEM_CHECK(false, "{} ({})", e.what(), job.where("rewards"));
    }
    max_failures = static_cast<int>(r.max_consecutive_failures);
  }
  rewards::RewardSetOptions o;
  o.max_consecutive_failures = max_failures;
  return rewards::RewardSet(std::move(entries), o);
}

rollout::SamplingParams sampling(const JobConfig& job, const model::LoadedModel& m, int n,
                                 double temperature, uint64_t seed) {
  rollout::SamplingParams sp;
  sp.n = n;
  sp.temperature = static_cast<float>(temperature);
  sp.top_p = static_cast<float>(job.rollout.top_p);
  sp.top_k = static_cast<int>(job.rollout.top_k);
  sp.min_p = static_cast<float>(job.rollout.min_p);
  sp.max_tokens = static_cast<int>(job.rollout.max_new_tokens);
  sp.seed = seed;
  sp.stop_token_ids = m.stop_ids();
  return sp;
}

struct Rollout {
  std::vector<rewards::RewardSample> reward_samples;
  std::vector<TrainSample> samples;
  std::vector<int32_t> group_sizes;
  std::vector<bool> truncated;
  int64_t tokens = 0;
};

// Generates n samples for each example and collects what rewards and the trainer need.
Rollout generate(rollout::Engine& engine, const model::LoadedModel& m,
                 const std::vector<Example>& batch, const JobConfig& job, int n, double temperature,
                 uint64_t seed) {
  std::vector<rollout::Request> reqs;
  for (size_t i = 0; i < batch.size(); ++i) {
    std::vector<int32_t> prompt = render_prompt(m.tok(), batch[i], true, job.data.system_prompt);
    if (static_cast<int64_t>(prompt.size()) > job.data.max_prompt_tokens)
      prompt.erase(prompt.begin(), prompt.end() - job.data.max_prompt_tokens);
    reqs.push_back({fmt::format("{}", i), std::move(prompt),
                    sampling(job, m, n, temperature, seed + 7919 * i)});
  }
  const std::vector<rollout::RequestOutput> outs = engine.generate(std::move(reqs));
  Rollout r;
  for (size_t i = 0; i < outs.size(); ++i) {
    const rollout::RequestOutput& o = outs[i];
    TANDEM_CHECK(o.status == rollout::RequestStatus::done, "rollout of prompt '{}' failed: {}",
                 batch[i].id, o.error);
    const std::string prompt_text = m.tok().decode(o.prompt);
    r.group_sizes.push_back(static_cast<int32_t>(o.samples.size()));
    for (const rollout::SampleOutput& s : o.samples) {
      const bool truncated = s.finish_reason == rollout::FinishReason::length;
      r.reward_samples.push_back({prompt_text, s.text, batch[i].answer, batch[i].extra,
                                  static_cast<int64_t>(s.tokens.size()), truncated});
      r.samples.push_back({o.prompt, s.tokens, s.logprobs, 0.0f});
      r.truncated.push_back(truncated);
      r.tokens += static_cast<int64_t>(s.tokens.size());
    }
  }
  return r;
}

// Appends `more` (a later rollout round) to `r`.
void append(Rollout& r, Rollout&& more) {
  auto move_all = [](auto& to, auto& from) {
    to.insert(to.end(), std::make_move_iterator(from.begin()), std::make_move_iterator(from.end()));
  };
  move_all(r.reward_samples, more.reward_samples);
  move_all(r.samples, more.samples);
  move_all(r.group_sizes, more.group_sizes);
  r.truncated.insert(r.truncated.end(), more.truncated.begin(), more.truncated.end());
  r.tokens += more.tokens;
}

// Appends the scores of a later round (the same functions) to `b`.
void append(rewards::RewardBreakdown& b, const rewards::RewardBreakdown& more) {
  if (b.names.empty()) {
    b = more;
    return;
  }
  b.total.insert(b.total.end(), more.total.begin(), more.total.end());
  for (size_t f = 0; f < b.names.size(); ++f) {
    b.values[f].insert(b.values[f].end(), more.values[f].begin(), more.values[f].end());
    b.failed[f].insert(b.failed[f].end(), more.failed[f].begin(), more.failed[f].end());
    if (b.call_errors[f].empty()) b.call_errors[f] = more.call_errors[f];
  }
}

// A step's samples: one round of rollout.prompts_per_step prompts, and with dynamic sampling
// refill rounds of more prompts until that many groups carry a reward signal.
struct StepBatch {
  Rollout rollout;                     // every generated group, round after round
  rewards::RewardBreakdown breakdown;  // of every sample
  std::vector<float> rewards;          // the summed reward plus the overlong penalty
  std::vector<uint8_t> group_kept;     // per group: it enters the update
  int64_t groups_kept = 0, refill_rounds = 0;
  double rollout_s = 0, reward_s = 0;
};

StepBatch collect_batch(rollout::Engine& engine, const model::LoadedModel& m, PromptStream& stream,
                        rewards::RewardSet& reward_set, const JobConfig& job, int64_t step) {
  const ShapingSection& shaping = job.trainer.shaping;
  const int64_t B = job.rollout.prompts_per_step;
  StepBatch sb;
  for (int64_t round = 0;; ++round) {
    // A refill draws the missing groups divided by the share of groups kept so far (a full batch
    // while none was), so one round usually suffices; at most B prompts.
    int64_t draw = B;
    if (round > 0) {
      const int64_t need = B - sb.groups_kept;
      const int64_t generated = static_cast<int64_t>(sb.group_kept.size());
      draw = std::clamp((need * generated + std::max<int64_t>(sb.groups_kept, 1) - 1) /
                            std::max<int64_t>(sb.groups_kept, 1),
                        need, B);
    }
    const std::vector<Example> batch = stream.next_batch(draw);
    // Round 0 keeps the seeds of a job without refill; each round gets its own stream of seeds.
    const uint64_t seed = static_cast<uint64_t>(job.rollout.seed) * 1000003 +
                          static_cast<uint64_t>(step) * 7919 +
                          static_cast<uint64_t>(round) * 0x9e3779b97f4a7c15ull;
    const auto t0 = Clock::now();
    Rollout r = generate(engine, m, batch, job, static_cast<int>(job.rollout.n),
                         job.rollout.temperature, seed);
    sb.rollout_s += seconds_since(t0);

    const auto t1 = Clock::now();
    const rewards::RewardBreakdown rb = reward_set.score(r.reward_samples);
    std::vector<float> rewards(rb.total.begin(), rb.total.end());
    if (shaping.overlong_factor > 0) {
      for (size_t i = 0; i < rewards.size(); ++i)
        rewards[i] +=
            overlong_penalty(r.reward_samples[i].completion_tokens, job.rollout.max_new_tokens,
                             shaping.overlong_buffer, static_cast<float>(shaping.overlong_factor));
    }
    std::vector<uint8_t> kept(r.group_sizes.size(), shaping.dynamic_sampling ? 0 : 1);
    if (shaping.dynamic_sampling) {
      // Groups past the B-th with signal are dropped too: the batch keeps its configured size.
      for (int32_t g : groups_with_signal(rewards, r.group_sizes))
        if (sb.groups_kept < B) {
          kept[static_cast<size_t>(g)] = 1;
          ++sb.groups_kept;
        }
    } else {
      sb.groups_kept += static_cast<int64_t>(kept.size());
    }
    sb.reward_s += seconds_since(t1);
    append(sb.rollout, std::move(r));
    append(sb.breakdown, rb);
    sb.rewards.insert(sb.rewards.end(), rewards.begin(), rewards.end());
    sb.group_kept.insert(sb.group_kept.end(), kept.begin(), kept.end());
    if (!shaping.dynamic_sampling || sb.groups_kept >= B || round >= shaping.max_refill_rounds)
      break;
    sb.refill_rounds = round + 1;
  }
  return sb;
}

struct EvalResult {
  double mean_reward = 0, pass1 = 0, passk = 0;
};

// Held-out prompts: pass_k samples each; a sample is correct when the first reward function
// gives it at least 1 (e.g. math_match).
EvalResult evaluate(rollout::Engine& engine, const model::LoadedModel& m,
                    const std::vector<Example>& eval, const JobConfig& job,
                    rewards::RewardSet& rewards) {
  EvalResult e;
  const size_t count = std::min<size_t>(eval.size(), static_cast<size_t>(job.eval.max_prompts));
  if (count == 0) return e;
  const std::vector<Example> prompts(eval.begin(), eval.begin() + static_cast<int64_t>(count));
  const int k = static_cast<int>(job.eval.pass_k);
  Rollout r = generate(engine, m, prompts, job, k, job.eval.temperature, 424242);
  const rewards::RewardBreakdown b = rewards.score(r.reward_samples);
  size_t at = 0;
  double correct_samples = 0, solved = 0;
  for (size_t p = 0; p < count; ++p) {
    bool any = false;
    for (int j = 0; j < k; ++j, ++at) {
      e.mean_reward += b.total[at];
      const bool ok = !b.values.empty() && b.values[0][at] >= 1.0;
      correct_samples += ok ? 1 : 0;
      any = any || ok;
    }
    solved += any ? 1 : 0;
  }
  e.mean_reward /= static_cast<double>(at);
  e.pass1 = correct_samples / static_cast<double>(at);
  e.passk = solved / static_cast<double>(count);
  return e;
}

// The process's peak resident memory so far (Linux reports ru_maxrss in KiB).
double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

std::string format_eta(double seconds) {
  if (seconds < 60) return fmt::format("{:.0f}s", seconds);
  if (seconds < 3600)
    return fmt::format("{:.0f}m{:02.0f}s", std::floor(seconds / 60), std::fmod(seconds, 60));
  return fmt::format("{:.1f}h", seconds / 3600);
}

}  // namespace

Dataset job_dataset(const JobConfig& job) { return make_data(job); }

JobResult run_job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks) {
  TANDEM_CHECK(job.placement.mode == "colocated" && job.placement.device == "cpu",
               "placement {} on {} is not available yet: use colocated on cpu ({})",
               job.placement.mode, job.placement.device, job.where("placement.mode"));
  TANDEM_CHECK(fs::exists(job.model.path), "model.path '{}' does not exist ({})", job.model.path,
               job.where("model.path"));
  // Process-wide, so that rollout and training compute alike; restored when the job returns.
  const ops::ScopedMatmulPrecision precision(
      job.placement.cpu_matmul == "bf16" ? ops::MatmulPrecision::bf16 : ops::MatmulPrecision::f32);
  if (job.placement.cpu_matmul == "bf16" && !ops::matmul_has_amx())
    spdlog::warn(
        "placement.cpu_matmul = \"bf16\" without AMX-BF16 on this CPU: the operands are "
        "rounded, then summed by the f32 kernel (slower than f32)");
  const auto run_t0 = Clock::now();
  fs::create_directories(job.logging.dir);
  model::LoadedModel m = model::load_model(job.model.path, DType::f32);
  model::Weights& policy = *m.weights;
  std::unique_ptr<model::Weights> reference;
  if (job.trainer.grpo.loss.kl_beta > 0) {
    reference = std::make_unique<model::Weights>(policy.config(), DType::f32);
    reference->copy_from(policy);
  }
  Dataset data = make_data(job);
  TANDEM_CHECK(!data.train.empty(), "the training split is empty ({})", job.where("data.source"));
  PromptStream stream(data.train, static_cast<uint64_t>(job.data.seed), true);
  rewards::RewardSet reward_set = make_rewards(job);

  rollout::EngineOptions eo;
  eo.block_size = job.rollout.block_size;
  eo.num_blocks = job.rollout.num_blocks;
  eo.max_batch_tokens = job.rollout.max_batch_tokens;
  eo.max_seqs = std::max<int64_t>(job.rollout.max_seqs, job.rollout.n);
  eo.max_context = std::min<int64_t>(job.data.max_prompt_tokens + job.rollout.max_new_tokens + 1,
                                     m.config().max_position_embeddings);
  // Weight publish, weight_sync's single-rank path: with rollout.dtype = trainer.dtype the engine
  // reads the trainer's tensors as they are and publishing moves no bytes; otherwise the engine
  // has its own copy (same storage tensors in its dtype) and publishing casts each tensor into
  // it. The engine then drops its prefix cache and stamps the version.
  std::unique_ptr<model::Weights> rollout_copy;
  if (job.rollout.dtype != job.trainer.dtype)
    rollout_copy = std::make_unique<model::Weights>(policy.config(),
                                                    dtype_from_name(job.rollout.dtype.c_str()));
  const model::Weights& engine_weights = rollout_copy ? *rollout_copy : policy;
  const auto params_of = [](const model::Weights& w) {
    std::vector<weight_sync::Param> params;
    for (const model::NamedTensor& t : w.storage()) params.push_back({t.name, t.tensor});
    return params;
  };
  const std::vector<weight_sync::Param> policy_params = params_of(policy),
                                        engine_params = params_of(engine_weights);
  const weight_sync::LocalPublisher publisher(policy_params, engine_params);
  publisher.publish(0);
  rollout::Engine engine(engine_weights, eo, &m.tok());

  AdamW adamw(policy, job.trainer.optimizer);
  LrScheduleConfig sc = job.trainer.schedule;
  if (sc.total_steps == 0)
    sc.total_steps = job.trainer.steps * job.trainer.step.epochs * job.trainer.step.minibatches;
  const LrSchedule schedule(sc);
  TrainStepConfig tc = job.trainer.step;
  tc.loss = job.trainer.grpo.loss;
  tc.temperature = static_cast<float>(job.rollout.temperature);
  // pi_old is the trainer's policy: an engine sampling from other-precision weights reports
  // logprobs of another policy, so the trainer computes its own.
  if (!publisher.zero_copy()) tc.always_recompute_old = true;
  PolicyTrainer trainer(policy, reference.get(), adamw, schedule, tc);

  if (job.trainer.optimizer_offload)
    std::fprintf(stderr,
                 "tandem: trainer.optimizer.offload: on cpu the optimizer state is in host memory "
                 "already; nothing to offload\n");

  TrainerState state;
  auto publish = [&] {
    const auto version = static_cast<uint64_t>(state.weight_version);
    const weight_sync::PublishStats st = publisher.publish(version);
    engine.set_weights(engine_weights, version);
    return st;
  };
  state.config = to_toml(job);
  std::string resume = job.checkpoint.resume;
  if (resume == "auto") resume = latest_checkpoint(job.checkpoint.dir).value_or("");
  if (resume == "none") resume.clear();
  if (!resume.empty()) {
    load_checkpoint(resume, policy, adamw, state);
    if (state.extra.contains("stream")) stream.restore(state.extra["stream"]);
    trainer.set_steps_done(state.extra.value("optimizer_steps", int64_t{0}));
    publish();
    std::fprintf(stderr, "tandem: resumed from %s at step %lld\n", resume.c_str(),
                 static_cast<long long>(state.step));
  }

  std::ofstream metrics_out(fs::path(job.logging.dir) / "metrics.jsonl", std::ios::app);
  std::ofstream samples_out(fs::path(job.logging.dir) / "samples.jsonl", std::ios::app);
  const std::map<std::string, std::string> tokenizer_files =
      model::hf_tokenizer_files(m.tok().data());
  auto checkpoint = [&] {
    state.extra["stream"] = stream.state();
    state.extra["optimizer_steps"] = trainer.steps_done();
    CheckpointOptions co;
    co.keep_last = static_cast<int>(job.checkpoint.keep_last);
    co.extra_files = tokenizer_files;
    const std::string dir =
        save_checkpoint(job.checkpoint.dir, state.step, policy, adamw, state, co);
    std::fprintf(stderr, "tandem: checkpoint %s\n", dir.c_str());
  };

  JobResult result;
  auto run_eval = [&](int64_t step) {
    const EvalResult e = evaluate(engine, m, data.eval, job, reward_set);
    nlohmann::ordered_json j{{"step", step},
                             {"eval/mean_reward", e.mean_reward},
                             {"eval/pass@1", e.pass1},
                             {"eval/pass@k", e.passk},
                             {"eval/k", job.eval.pass_k}};
    metrics_out << j.dump() << "\n" << std::flush;
    std::fprintf(stderr, "tandem: eval at step %lld: pass@1 %.3f, pass@%lld %.3f, reward %.3f\n",
                 static_cast<long long>(step), e.pass1, static_cast<long long>(job.eval.pass_k),
                 e.passk, e.mean_reward);
    write_report((fs::path(job.logging.dir) / "metrics.jsonl").string(),
                 (fs::path(job.logging.dir) / "report.html").string(),
                 fmt::format("tandem: {}", job.source));
    if (result.first_eval_accuracy < 0) result.first_eval_accuracy = e.pass1;
    result.last_eval_accuracy = e.pass1;
  };
  if (job.eval.every > 0 && !data.eval.empty()) run_eval(state.step);

  const int64_t first_step = state.step;
  while (state.step < job.trainer.steps) {
    const auto t0 = Clock::now();
    StepBatch sb = collect_batch(engine, m, stream, reward_set, job, state.step);
    Rollout& r = sb.rollout;
    const std::vector<float>& rewards = sb.rewards;
    const rewards::RewardBreakdown& rb = sb.breakdown;
    // Reward and zero-variance statistics describe every generated group; the update's
    // advantages are those of the kept groups (the same values unless advantage_scale is
    // batch-std).
    const Advantages adv = compute_advantages(rewards, r.group_sizes, job.trainer.grpo.advantage);

    // Samples that enter the loss: truncated ones masked on request, groups without signal
    // dropped with dynamic sampling.
    const auto truncated_flags = std::make_unique<bool[]>(r.truncated.size());
    std::copy(r.truncated.begin(), r.truncated.end(), truncated_flags.get());
    const std::vector<bool> keep =
        loss_mask(std::span<const bool>(truncated_flags.get(), r.truncated.size()),
                  job.trainer.shaping.mask_truncated);
    std::vector<float> kept_rewards;
    std::vector<int32_t> kept_sizes;
    size_t at = 0;
    for (size_t g = 0; g < r.group_sizes.size(); ++g) {
      if (sb.group_kept[g]) {
        kept_rewards.insert(kept_rewards.end(), rewards.begin() + static_cast<int64_t>(at),
                            rewards.begin() + static_cast<int64_t>(at) + r.group_sizes[g]);
        kept_sizes.push_back(r.group_sizes[g]);
      }
      at += static_cast<size_t>(r.group_sizes[g]);
    }
    const Advantages kept_adv =
        kept_sizes.size() == r.group_sizes.size() ? adv
        : kept_sizes.empty()
            ? Advantages{}
            : compute_advantages(kept_rewards, kept_sizes, job.trainer.grpo.advantage);
    std::vector<TrainSample> train;
    at = 0;
    size_t kept_at = 0;
    for (size_t g = 0; g < r.group_sizes.size(); ++g) {
      for (int32_t j = 0; j < r.group_sizes[g]; ++j, ++at) {
        if (!sb.group_kept[g]) continue;
        const float advantage = kept_adv.values[kept_at++];
        if (!keep[at]) continue;
        r.samples[at].advantage = advantage;
        train.push_back(std::move(r.samples[at]));
      }
    }
    // Minibatches must divide the batch: trim the remainder (only after filtering).
    train.resize(train.size() - train.size() % static_cast<size_t>(tc.minibatches));
    if (train.empty())
      std::fprintf(stderr,
                   "tandem: step %lld: no sample to train on (%lld groups generated, none with "
                   "reward variance after %lld refill rounds): update skipped\n",
                   static_cast<long long>(state.step + 1),
                   static_cast<long long>(r.group_sizes.size()),
                   static_cast<long long>(sb.refill_rounds));
    // The training phase does not need the engine's KV cache and activations: free them for
    // the trainer; the next rollout or eval takes them again.
    if (job.placement.release_memory) engine.release_memory();

    const auto t2 = Clock::now();
    TrainStepMetrics tm;
    double t_publish = 0;
    weight_sync::PublishStats published;
    if (!train.empty()) {
      tm = trainer.step(train);
      // And the other way round: the rollout and eval that follow take the trainer's memory.
      if (job.placement.release_memory) trainer.release_activations();
      state.weight_version += 1;
      const auto t3 = Clock::now();
      published = publish();
      t_publish = seconds_since(t3);
    }
    const double t_train = seconds_since(t2);
    state.step += 1;
    state.data_epoch = stream.epoch();
    state.data_position = stream.index();

    int64_t max_len = 0, truncated = 0;
    for (const auto& s : r.reward_samples) {
      max_len = std::max(max_len, s.completion_tokens);
      truncated += s.truncated ? 1 : 0;
    }
    const double step_s = seconds_since(t0);
    const double n_samples = static_cast<double>(r.reward_samples.size());
    nlohmann::ordered_json j;
    j["step"] = state.step;
    j["loss"] = tm.loss;
    j["reward/mean"] = adv.stats.reward_mean;
    j["reward/std"] = adv.stats.reward_std;
    const nlohmann::json reward_metrics = rb.metrics();
    for (auto it = reward_metrics.begin(); it != reward_metrics.end(); ++it) j[it.key()] = *it;
    j["advantage/mean"] = kept_adv.stats.advantage_mean;
    j["advantage/std"] = kept_adv.stats.advantage_std;
    j["advantage/min"] = kept_adv.stats.advantage_min;
    j["advantage/max"] = kept_adv.stats.advantage_max;
    j["zero_variance_group_fraction"] = adv.stats.zero_variance_fraction;
    j["pg_clipfrac_low"] = tm.policy.pg_clipfrac_low();
    j["pg_clipfrac_high"] = tm.policy.pg_clipfrac_high();
    j["kl_old"] = tm.policy.approx_kl_old();
    j["kl_ref"] = tm.policy.kl_ref_mean();
    j["entropy"] = tm.policy.entropy_mean();
    j["grad_norm"] = tm.grad_norm;
    j["lr"] = tm.lr;
    j["skipped_steps"] = tm.skipped_steps;
    j["response_length/mean"] = static_cast<double>(r.tokens) / std::max(n_samples, 1.0);
    j["response_length/max"] = max_len;
    j["response_tokens"] = r.tokens;
    j["truncation_rate"] = static_cast<double>(truncated) / std::max(n_samples, 1.0);
    j["old_logp_recomputed"] = tm.old_recomputed ? 1 : 0;
    if (tm.old_recomputed) {  // otherwise the old logprobs are the rollout's: nothing to compare
      j["rollout_trainer_logp/max_abs"] = tm.rollout_vs_trainer_max_abs;
      j["rollout_trainer_logp/mean_abs"] = tm.rollout_vs_trainer_mean_abs;
      j["token_mult_prob_error"] = tm.policy.token_mult_prob_error();
    }
    j["samples_trained"] = train.size();
    j["packed_tokens"] = tm.packed_tokens;
    j["update_skipped"] = train.empty() ? 1 : 0;
    j["dynamic_sampling/groups_generated"] = r.group_sizes.size();
    j["dynamic_sampling/groups_kept"] = sb.groups_kept;
    j["dynamic_sampling/refill_rounds"] = sb.refill_rounds;
    j["memory/peak_rss_mib"] = peak_rss_mib();
    j["tokens_per_s"] = static_cast<double>(r.tokens) / std::max(step_s, 1e-9);
    j["time/rollout_s"] = sb.rollout_s;
    j["time/reward_s"] = sb.reward_s;
    j["time/train_s"] = t_train;
    j["time/old_logp_s"] = tm.seconds_old;
    j["time/ref_logp_s"] = tm.seconds_ref;
    j["time/update_s"] = tm.seconds_update;
    j["weight_sync/bytes"] = published.bytes_written;
    j["weight_sync/cast_tensors"] = published.cast;
    j["weight_sync/copied_tensors"] = published.copied;
    j["weight_sync/shared_tensors"] = published.shared;
    j["time/publish_s"] = t_publish;
    j["time/step_s"] = step_s;
    metrics_out << j.dump() << "\n" << std::flush;
    if (hooks.on_step) hooks.on_step(j);
    write_report((fs::path(job.logging.dir) / "metrics.jsonl").string(),
                 (fs::path(job.logging.dir) / "report.html").string(),
                 fmt::format("tandem: {}", job.source));

    const double elapsed = seconds_since(run_t0);
    const double per_step = elapsed / static_cast<double>(state.step - first_step);
    const std::string groups = job.trainer.shaping.dynamic_sampling
                                   ? fmt::format(" | groups {}/{} ({} refills)", sb.groups_kept,
                                                 r.group_sizes.size(), sb.refill_rounds)
                                   : "";
    std::fprintf(
        stderr,
        "step %lld/%lld | reward %.3f%s | kl %.4f | entropy %.3f | len %.1f | %.0f tok/s | "
        "%.1fs (rollout %.1f, train %.1f) | eta %s\n",
        static_cast<long long>(state.step), static_cast<long long>(job.trainer.steps),
        adv.stats.reward_mean, groups.c_str(), tm.policy.kl_ref_mean(), tm.policy.entropy_mean(),
        j["response_length/mean"].get<double>(), j["tokens_per_s"].get<double>(), step_s,
        sb.rollout_s, t_train,
        format_eta(per_step * static_cast<double>(job.trainer.steps - state.step)).c_str());
    if (job.logging.samples_every > 0 && state.step % job.logging.samples_every == 0 &&
        !r.reward_samples.empty()) {
      samples_out << nlohmann::json{{"step", state.step},
                                    {"prompt", r.reward_samples[0].prompt},
                                    {"completion", r.reward_samples[0].completion},
                                    {"answer", r.reward_samples[0].answer},
                                    {"reward", rewards[0]}}
                         .dump()
                  << "\n"
                  << std::flush;
    }
    result.steps_done = state.step;
    if (job.eval.every > 0 && !data.eval.empty() && state.step % job.eval.every == 0)
      run_eval(state.step);
    const bool last = state.step >= job.trainer.steps;
    if (hooks.checkpoints && (stop.load() || last ||
                              (job.checkpoint.every > 0 && state.step % job.checkpoint.every == 0)))
      checkpoint();
    if (stop.load()) {
      result.interrupted = true;
      break;
    }
  }
  if (job.eval.every > 0 && !data.eval.empty() && state.step % job.eval.every != 0)
    run_eval(state.step);
  return result;
}

}  // namespace tandem::trainer
