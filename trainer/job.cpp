// The colocated GRPO loop in phases: collect (rollout and refills, scored round by round),
// select (masks, dynamic sampling, advantages once), update, publish, record; on one rank or on
// several data-parallel ranks, each generating and training its share of every round's groups.
#include "trainer/job.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include <sys/resource.h>

#include "core/comm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "model/loader.h"
#include "rewards/factory.h"
#include "rewards/reward_set.h"
#include "rollout/engine.h"
#include "trainer/append_file.h"
#include "trainer/canary.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/disaggregated.h"
#include "trainer/grpo.h"
#include "trainer/job_start.h"
#include "trainer/pass_interval.h"
#include "trainer/report.h"
#include "trainer/rollout_group.h"
#include "trainer/shaping.h"
#include "trainer/synthetic.h"
#include "trainer/tensorboard.h"
#include "trainer/train_step.h"

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
  o.eval_path = d.eval_path;
  o.prompt_field = d.prompt_field;
  if (!d.messages_field.empty()) o.messages_field = d.messages_field;
  o.answer_field = d.answer_field;
  o.require_answer = d.require_answer;
  o.id_field = d.id_field;
  o.extra_fields = d.extra_fields;
  o.eval_fraction = job.eval.split_fraction;
  o.seed = static_cast<uint64_t>(d.seed);
  return load_dataset(o);
}

rewards::RewardSet make_rewards(const JobConfig& job) {
  std::vector<rewards::RewardSet::Entry> entries;
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
      opt["isolate"] = r.isolate;
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
      entries.push_back({rewards::make_reward(kind, r.name, opt), r.weight, r.fallback,
                         static_cast<int>(r.max_consecutive_failures)});
    } catch (const Error& e) {
      TANDEM_CHECK(false, "{} ({})", e.what(), job.where("rewards"));
    }
  }
  return rewards::RewardSet(std::move(entries));
}

// One completion and its score.
struct Sample {
  std::vector<int32_t> tokens;  // (n) completion ids
  std::vector<float> logprobs;  // (n) the engine's
  std::string text;
  bool truncated = false;  // stopped by rollout.max_new_tokens, not by an end token
  float reward = 0;        // the reward functions' weighted sum plus the overlong penalty
  int64_t length = 0;      // completion tokens (tokens.size() where this rank generated it)
};

// A prompt ready for the engine.
struct Prompt {
  Example example;
  RenderedPrompt rendered;
};

// A prompt's G samples.
struct Group {
  Prompt prompt;
  std::vector<Sample> samples;
  bool kept = false;  // enters the update (every group, unless dynamic sampling drops it)
  // Generated by this rank: samples hold tokens, logprobs and text. Another rank's group holds
  // only each sample's reward, truncation and length.
  bool local = true;
};

// The collect phase's result: every group generated in a step, round after round.
struct Collected {
  std::vector<Group> groups;
  rewards::RewardBreakdown breakdown;  // of every sample, in group order
  int64_t groups_kept = 0, refill_rounds = 0;
  int64_t prompts_skipped = 0;  // longer than data.max_prompt_tokens
  double rollout_s = 0, reward_s = 0;
};

// The select phase's result: what the update trains on, and the statistics of the batch.
struct Selected {
  std::vector<TrainSample> train;  // this rank's share
  BatchShard shard;                // where they lie in the batch of every rank's samples
  RewardStats rewards;             // of every generated group
  AdvantageStats advantages;       // of the kept groups
  int64_t masked_truncated = 0;    // kept samples left out by trainer.shaping.mask_truncated
  int64_t dropped_remainder = 0;   // left out so that trainer.minibatches divides the batch
  size_t batch() const { return shard.lengths.size(); }
};

// The update and publish phases' result.
struct Updated {
  TrainStepMetrics train;
  PublishStats published;
  std::optional<CanaryResult> canary;  // with weight_sync.canary
  double train_s = 0, publish_s = 0;
};

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

// Generates n samples for each prompt, the i-th prompt's from seed + 7919 (first + i): `first` is
// the index of prompts[0] in its round, so that a prompt's samples do not depend on the rank.
std::vector<Group> generate(rollout::Engine& engine, const model::LoadedModel& m,
                            std::vector<Prompt> prompts, const JobConfig& job, int n,
                            double temperature, uint64_t seed, size_t first = 0,
                            RemoteRollout* remote = nullptr) {
  std::vector<rollout::Request> requests;
  for (size_t i = 0; i < prompts.size(); ++i)
    requests.push_back({fmt::format("{}", i), prompts[i].rendered.tokens,
                        sampling(job, m, n, temperature, seed + 7919 * (first + i))});
  // Disaggregated: the workers generate, the same requests.
  std::vector<rollout::RequestOutput> outputs = remote != nullptr
                                                    ? remote->generate(std::move(requests))
                                                    : engine.generate(std::move(requests));
  std::vector<Group> groups(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    rollout::RequestOutput& o = outputs[i];
    TANDEM_CHECK(o.status == rollout::RequestStatus::done, "rollout of prompt '{}' failed: {}",
                 prompts[i].example.id, o.error);
    groups[i].prompt = std::move(prompts[i]);
    for (rollout::SampleOutput& s : o.samples) {
      const auto length = static_cast<int64_t>(s.tokens.size());
      groups[i].samples.push_back({std::move(s.tokens), std::move(s.logprobs), std::move(s.text),
                                   s.finish_reason == rollout::FinishReason::length, 0, length});
    }
  }
  return groups;
}

// Scores every sample of `groups` (setting Sample::reward) and returns the breakdown.
rewards::RewardBreakdown score(std::span<Group> groups, rewards::RewardSet& reward_set,
                               const JobConfig& job) {
  std::vector<rewards::RewardSample> inputs;
  for (const Group& g : groups)
    for (const Sample& s : g.samples)
      inputs.push_back({g.prompt.rendered.text, s.text, g.prompt.example.answer,
                        g.prompt.example.extra, static_cast<int64_t>(s.tokens.size()),
                        s.truncated});
  rewards::RewardBreakdown breakdown = reward_set.score(inputs);
  const ShapingSection& shaping = job.trainer.shaping;
  size_t i = 0;
  for (Group& g : groups) {
    for (Sample& s : g.samples) {
      s.reward = static_cast<float>(breakdown.total[i++]);
      if (shaping.overlong_factor > 0)
        s.reward +=
            overlong_penalty(static_cast<int64_t>(s.tokens.size()), job.rollout.max_new_tokens,
                             shaping.overlong_buffer, static_cast<float>(shaping.overlong_factor));
    }
  }
  return breakdown;
}

std::vector<float> rewards_of(const Group& g) {
  std::vector<float> r;
  for (const Sample& s : g.samples) r.push_back(s.reward);
  return r;
}

// The select phase: advantages of the kept groups, computed once (the reward statistics describe
// every generated group); the samples that enter the loss; a remainder that trainer.minibatches
// does not divide dropped and counted.
Selected select(Collected& c, const JobConfig& job) {
  std::vector<float> all_rewards, kept_rewards;
  std::vector<int32_t> all_sizes, kept_sizes;
  for (const Group& g : c.groups) {
    const std::vector<float> r = rewards_of(g);
    all_rewards.insert(all_rewards.end(), r.begin(), r.end());
    all_sizes.push_back(static_cast<int32_t>(r.size()));
    if (!g.kept) continue;
    kept_rewards.insert(kept_rewards.end(), r.begin(), r.end());
    kept_sizes.push_back(static_cast<int32_t>(r.size()));
  }
  Selected s;
  s.rewards = reward_stats(all_rewards, all_sizes);
  const Advantages adv = compute_advantages(kept_rewards, kept_sizes, job.trainer.grpo.advantage);
  s.advantages = adv.stats;
  // The batch is every rank's kept samples in group order; this rank trains the local ones.
  size_t a = 0;
  int64_t group = -1;
  for (Group& g : c.groups) {
    ++group;
    if (!g.kept) continue;
    for (Sample& x : g.samples) {
      const float advantage = adv.values[a++];
      if (!enters_loss(x.truncated, job.trainer.shaping.mask_truncated)) {
        ++s.masked_truncated;
        continue;
      }
      if (g.local) {
        s.shard.positions.push_back(s.shard.lengths.size());
        s.train.push_back({g.prompt.rendered.tokens, x.tokens, x.logprobs, advantage, group});
      }
      s.shard.lengths.push_back(x.length);
    }
  }
  const size_t minibatches = static_cast<size_t>(job.trainer.step.minibatches);
  s.dropped_remainder = static_cast<int64_t>(s.shard.lengths.size() % minibatches);
  s.shard.lengths.resize(s.shard.lengths.size() - static_cast<size_t>(s.dropped_remainder));
  while (!s.shard.positions.empty() && s.shard.positions.back() >= s.shard.lengths.size()) {
    s.shard.positions.pop_back();
    s.train.pop_back();
  }
  return s;
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

rollout::EngineOptions engine_options(const JobConfig& job, const model::ModelConfig& c) {
  rollout::EngineOptions eo;
  eo.block_size = job.rollout.block_size;
  eo.num_blocks = job.rollout.num_blocks;
  eo.max_batch_tokens = job.rollout.max_batch_tokens;
  eo.max_seqs = std::max<int64_t>(job.rollout.max_seqs, job.rollout.n);
  eo.max_context = std::min<int64_t>(job.data.max_prompt_tokens + job.rollout.max_new_tokens + 1,
                                     c.max_position_embeddings);
  return eo;
}

TrainStepConfig train_step_config(const JobConfig& job) {
  TrainStepConfig tc = job.trainer.step;
  tc.loss = job.trainer.grpo.loss;
  tc.temperature = static_cast<float>(job.rollout.temperature);
  return tc;
}

LrScheduleConfig schedule_config(const JobConfig& job) {
  LrScheduleConfig sc = job.trainer.schedule;
  if (sc.total_steps == 0)
    sc.total_steps = job.trainer.steps * job.trainer.step.epochs * job.trainer.step.minibatches;
  return sc;
}

// TANDEM_TEST_STALL_CHECKPOINT=<rank>:<stage>:<step> stops that rank at that stage of that
// step's save (CheckpointOptions::on_stage): it says so on stderr and sleeps, for a test to kill
// it there; not killed within 120 s, it fails.
std::function<void(const std::string&)> stall_for_tests(int rank, int64_t step) {
  const char* env = std::getenv("TANDEM_TEST_STALL_CHECKPOINT");
  if (env == nullptr || *env == '\0') return {};
  const std::string spec = env;
  const size_t a = spec.find(':'), b = spec.rfind(':');
  TANDEM_CHECK(a != std::string::npos && b > a,
               "TANDEM_TEST_STALL_CHECKPOINT='{}': expected <rank>:<stage>:<step>", spec);
  if (spec.substr(0, a) != std::to_string(rank) || spec.substr(b + 1) != std::to_string(step))
    return {};
  return [stage = spec.substr(a + 1, b - a - 1), rank, step](const std::string& at) {
    if (at != stage) return;
    std::fprintf(stderr,
                 "tandem: rank %d stalls at checkpoint stage %s of step %lld "
                 "(TANDEM_TEST_STALL_CHECKPOINT)\n",
                 rank, stage.c_str(), static_cast<long long>(step));
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(120));
    TANDEM_FAIL("TANDEM_TEST_STALL_CHECKPOINT: rank {} was not killed within 120 s", rank);
  };
}

// A running job: the model, data, rewards, rollout engine, trainer and outputs of one process,
// and the phases of a step.
class Job {
 public:
  // comm: the data-parallel ranks (null: this process alone).
  Job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks,
      Communicator* comm);
  JobResult run();

 private:
  // What a rank does with the step's results: rank 0 writes metrics, samples, report, eval and
  // checkpoints and prints progress; the others only compute.
  enum class Role { writer, worker };
  // Groups [first, last) of a round of `count` are this rank's.
  std::pair<size_t, size_t> share(size_t count, int rank) const;
  // The round's groups of every rank, in order, from this rank's (`mine`, scored into
  // `breakdown`, which becomes the round's breakdown) and the prompts of all.
  std::vector<Group> exchange(std::vector<Group> mine, std::vector<Prompt>& prompts,
                              rewards::RewardBreakdown& breakdown);
  bool any_rank(bool mine);
  std::vector<Prompt> draw_prompts(int64_t count, int64_t& skipped);
  Collected collect();
  Updated update_and_publish(const Selected& selected);
  PublishStats publish();
  // weight_sync.canary after a publish (none when off); `step` made the weights.
  std::optional<CanaryResult> check_canary(int64_t step);
  void record(const Collected& c, const Selected& s, const Updated& u, double step_s, Role role);
  void evaluate();
  void checkpoint();
  void resume();
  std::string agreed_latest_checkpoint();
  void write_metrics(const nlohmann::ordered_json& line);

  const JobConfig& job_;
  const std::atomic<bool>& stop_;
  const JobHooks& hooks_;
  Communicator* comm_;
  const int rank_, world_;
  const Role role_;
  const Clock::time_point start_ = Clock::now();
  model::LoadedModel m_;
  model::Weights& policy_;
  std::unique_ptr<model::Weights> reference_;  // frozen, for the KL term (kl_beta > 0)
  Dataset data_;
  PromptFormat format_;
  PromptStream stream_;
  std::vector<Prompt> eval_prompts_;  // the held-out prompts evaluated, rendered once
  rewards::RewardSet rewards_;
  // The engine's weights and their publish through weight_sync: with rollout.dtype =
  // trainer.dtype and rollout_tp = 1 the engine reads the trainer's tensors as they are and
  // publishing moves no bytes; otherwise it has its own copy (its tensor-parallel shard, in its
  // dtype) that publishing fills. The engine then drops its prefix cache and stamps the version.
  std::unique_ptr<RolloutGroup> rollout_;
  std::unique_ptr<rollout::Engine> engine_;
  // Disaggregated (placement.mode): the workers that generate the training rollouts; engine_
  // then serves eval only.
  std::unique_ptr<RemoteRollout> remote_;
  std::unique_ptr<Canary> canary_;  // weight_sync.canary: probes the engine after each publish
  // One rank: AdamW. Several: each rank's range of the optimizer state (ZeRO).
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<ShardedAdamW> sharded_;
  const LrSchedule schedule_;
  TrainStepConfig step_config_;
  std::unique_ptr<PolicyTrainer> trainer_;
  TrainerState state_;
  std::optional<AppendFile> metrics_out_, samples_out_;  // opened once resumed
  std::unique_ptr<TensorBoardWriter> tensorboard_;       // with logging.tensorboard
  std::map<std::string, std::string> tokenizer_files_;
  JobResult result_;
  int64_t first_step_ = 0;
  bool warned_skipped_ = false;
};

Job::Job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks,
         Communicator* comm)
    : job_(job),
      stop_(stop),
      hooks_(hooks),
      comm_(comm),
      rank_(comm != nullptr ? comm->rank() : 0),
      world_(comm != nullptr ? comm->size() : 1),
      role_(rank_ == 0 ? Role::writer : Role::worker),
      m_(model::load_model(job.model.path, DType::f32)),
      policy_(*m_.weights),
      data_(make_data(job)),
      format_(prompt_format(m_.tok(), job.model.chat_template, job.data.system_prompt)),
      stream_(data_.train, static_cast<uint64_t>(job.data.seed), job.data.shuffle),
      rewards_(make_rewards(job)),
      adamw_(comm == nullptr && !job.trainer.step.deterministic
                 ? std::make_unique<AdamW>(policy_, job.trainer.optimizer)
                 : nullptr),
      sharded_(comm != nullptr || job.trainer.step.deterministic
                   ? std::make_unique<ShardedAdamW>(policy_, comm, job.trainer.optimizer)
                   : nullptr),
      schedule_(schedule_config(job)),
      step_config_(train_step_config(job)) {
  TANDEM_CHECK(!data_.train.empty(), "the training split is empty ({})", job.where("data.source"));
  if (job.trainer.grpo.loss.kl_beta > 0) {
    reference_ = std::make_unique<model::Weights>(policy_.config(), DType::f32);
    reference_->copy_from(policy_);
  }
  rollout_ = std::make_unique<RolloutGroup>(job, policy_, comm);
  engine_ = std::make_unique<rollout::Engine>(rollout_->weights(), engine_options(job, m_.config()),
                                              &m_.tok(), rollout_->tp_group());
  // pi_old is the trainer's policy: an engine sampling from other-precision weights, or summing
  // its tensor-parallel shards' partial products in another order, reports logprobs that are not
  // the trainer's bitwise, so the trainer computes its own.
  if (!rollout_->zero_copy() || rollout_->tp() > 1) step_config_.always_recompute_old = true;
  // Disaggregated: the workers' engines sample; the trainer computes pi_old itself and logs how
  // far the workers' logprobs are from it (rollout_trainer_logp/*).
  if (job.placement.mode == "disaggregated") step_config_.always_recompute_old = true;
  trainer_ = sharded_ ? std::make_unique<PolicyTrainer>(policy_, reference_.get(), *sharded_,
                                                        schedule_, step_config_)
                      : std::make_unique<PolicyTrainer>(policy_, reference_.get(), *adamw_,
                                                        schedule_, step_config_);
  if (job.trainer.optimizer_offload)
    std::fprintf(stderr,
                 "tandem: trainer.optimizer.offload: on cpu the optimizer state is in host memory "
                 "already; nothing to offload\n");

  // The held-out prompts: the first eval.max_prompts of the eval split that fit.
  int64_t skipped = 0;
  for (const Example& ex : data_.eval) {
    if (static_cast<int64_t>(eval_prompts_.size()) >= job.eval.max_prompts) break;
    RenderedPrompt r = render_prompt(m_.tok(), ex, format_);
    if (static_cast<int64_t>(r.tokens.size()) > job.data.max_prompt_tokens) {
      ++skipped;
      continue;
    }
    eval_prompts_.push_back({ex, std::move(r)});
  }
  if (skipped > 0)
    std::fprintf(stderr,
                 "tandem: %lld held-out prompts are longer than data.max_prompt_tokens = %lld and "
                 "are not evaluated\n",
                 static_cast<long long>(skipped),
                 static_cast<long long>(job.data.max_prompt_tokens));

  if (job.weight_sync.canary)  // the probe: the first training prompt
    canary_ = std::make_unique<Canary>(job, render_prompt(m_.tok(), data_.train[0], format_).tokens,
                                       comm, rollout_->tp());

  state_.config = to_toml(job);
  resume();
  if (job.placement.mode == "disaggregated")
    remote_ = std::make_unique<RemoteRollout>(job, m_, policy_,
                                              static_cast<uint64_t>(state_.weight_version));
  check_canary(state_.step);  // the weights the job starts or resumes with
  if (role_ == Role::writer) {
    metrics_out_.emplace((fs::path(job.logging.dir) / "metrics.jsonl").string());
    samples_out_.emplace((fs::path(job.logging.dir) / "samples.jsonl").string());
    if (job.logging.tensorboard)
      tensorboard_ = std::make_unique<TensorBoardWriter>(job.logging.dir, state_.step);
  }
  tokenizer_files_ = model::hf_tokenizer_files(m_.tok().data());
  first_step_ = state_.step;
}

void Job::resume() {
  std::string from = job_.checkpoint.resume;
  if (from == "auto") from = agreed_latest_checkpoint();
  if (from == "none") from.clear();
  if (from.empty()) return;
  // Any number of ranks wrote it: this rank reads the pieces that overlap its range.
  if (sharded_)
    load_checkpoint(from, policy_, *sharded_, state_);
  else
    load_checkpoint(from, policy_, *adamw_, state_);
  state_.config = to_toml(job_);  // the config this run trains with, not the checkpoint's
  if (state_.extra.contains("stream")) stream_.restore(state_.extra["stream"]);
  trainer_->set_steps_done(state_.extra.value("optimizer_steps", int64_t{0}));
  publish();
  std::fprintf(stderr, "tandem: resumed from %s at step %lld\n", from.c_str(),
               static_cast<long long>(state_.step));
}

// Rank 0's latest checkpoint, on every rank: rank 0 has recovered interrupted saves under the
// directory's lock before the others may look, so their own look could find another.
std::string Job::agreed_latest_checkpoint() {
  const std::optional<std::string> latest = latest_checkpoint(job_.checkpoint.dir);
  if (comm_ == nullptr) return latest.value_or("");
  int64_t step = -1;
  if (role_ == Role::writer && latest)
    step = std::stoll(fs::path(*latest).filename().string().substr(5));  // step-<N>
  comm_->broadcast(Tensor::wrap(&step, {1}, DType::i64), 0);  // world: 8 bytes from rank 0
  return step < 0 ? "" : checkpoint_dir(job_.checkpoint.dir, step);
}

// The next `count` prompts of the stream, rendered. A prompt longer than data.max_prompt_tokens
// is skipped (cutting it would change its task), counted in `skipped`, and another drawn.
std::vector<Prompt> Job::draw_prompts(int64_t count, int64_t& skipped) {
  std::vector<Prompt> prompts;
  int64_t skipped_here = 0;
  while (static_cast<int64_t>(prompts.size()) < count) {
    for (Example& ex : stream_.next_batch(count - static_cast<int64_t>(prompts.size()))) {
      RenderedPrompt r = render_prompt(m_.tok(), ex, format_);
      const auto length = static_cast<int64_t>(r.tokens.size());
      if (length <= job_.data.max_prompt_tokens) {
        prompts.push_back({std::move(ex), std::move(r)});
        continue;
      }
      ++skipped_here;
      if (!warned_skipped_)
        std::fprintf(stderr,
                     "tandem: prompt '%s' has %lld tokens, more than data.max_prompt_tokens = "
                     "%lld: skipped (counted as data/prompts_skipped_too_long)\n",
                     ex.id.c_str(), static_cast<long long>(length),
                     static_cast<long long>(job_.data.max_prompt_tokens));
      warned_skipped_ = true;
    }
    TANDEM_CHECK(!prompts.empty() || skipped_here < stream_.size(),
                 "every prompt of the training split is longer than data.max_prompt_tokens = {} "
                 "({})",
                 job_.data.max_prompt_tokens, job_.where("data.max_prompt_tokens"));
  }
  skipped += skipped_here;
  return prompts;
}

// The collect phase: one round of rollout.prompts_per_step prompts, generated and scored; with
// dynamic sampling, refill rounds of more prompts until that many groups carry a reward signal
// (groups past the B-th with signal are dropped too: the batch keeps its configured size).
Collected Job::collect() {
  const ShapingSection& shaping = job_.trainer.shaping;
  const int64_t B = job_.rollout.prompts_per_step;
  Collected c;
  for (int64_t round = 0;; ++round) {
    // A refill draws the missing groups divided by the share of groups kept so far (a full batch
    // while none was), so one round usually suffices; at most B prompts.
    int64_t draw = B;
    if (round > 0) {
      const int64_t need = B - c.groups_kept;
      const auto generated = static_cast<int64_t>(c.groups.size());
      const int64_t kept = std::max<int64_t>(c.groups_kept, 1);
      draw = std::clamp((need * generated + kept - 1) / kept, need, B);
    }
    std::vector<Prompt> prompts = draw_prompts(draw, c.prompts_skipped);
    // Round 0 keeps the seeds of a job without refill; each round gets its own stream of seeds.
    const uint64_t seed = static_cast<uint64_t>(job_.rollout.seed) * 1000003 +
                          static_cast<uint64_t>(state_.step) * 7919 +
                          static_cast<uint64_t>(round) * 0x9e3779b97f4a7c15ull;
    // Every rank drew the same prompts and scores and trains its contiguous share. Each rollout
    // replica generates its ranks' shares (all its ranks the same requests in the same order:
    // the share itself at rollout_tp = 1), and each rank keeps its own groups.
    const auto [first, last] = share(prompts.size(), rank_);
    const auto [gen_first, gen_last] = rollout_->replica_prompts(prompts.size());
    std::vector<Prompt> replica_prompts(prompts.begin() + static_cast<ptrdiff_t>(gen_first),
                                        prompts.begin() + static_cast<ptrdiff_t>(gen_last));
    const auto t0 = Clock::now();
    std::vector<Group> groups;
    if (!replica_prompts.empty())
      groups =
          generate(*engine_, m_, std::move(replica_prompts), job_, static_cast<int>(job_.rollout.n),
                   job_.rollout.temperature, seed, gen_first, remote_.get());
    groups = std::vector<Group>(
        std::make_move_iterator(groups.begin() + static_cast<ptrdiff_t>(first - gen_first)),
        std::make_move_iterator(groups.begin() + static_cast<ptrdiff_t>(last - gen_first)));
    c.rollout_s += seconds_since(t0);

    const auto t1 = Clock::now();
    rewards::RewardBreakdown breakdown;
    if (!groups.empty()) breakdown = score(groups, rewards_, job_);
    if (world_ > 1) groups = exchange(std::move(groups), prompts, breakdown);
    append(c.breakdown, breakdown);
    // Every rank sees every group's rewards: the same groups kept everywhere.
    for (Group& g : groups) {
      g.kept = !shaping.dynamic_sampling || (c.groups_kept < B && has_signal(rewards_of(g)));
      c.groups_kept += g.kept ? 1 : 0;
    }
    c.reward_s += seconds_since(t1);
    c.groups.insert(c.groups.end(), std::make_move_iterator(groups.begin()),
                    std::make_move_iterator(groups.end()));
    if (!shaping.dynamic_sampling || c.groups_kept >= B || round >= shaping.max_refill_rounds)
      break;
    c.refill_rounds = round + 1;
  }
  return c;
}

PublishStats Job::publish() {
  const auto version = static_cast<uint64_t>(state_.weight_version);
  const PublishStats st = rollout_->publish(version);
  engine_->set_weights(rollout_->weights(), version);
  if (remote_) remote_->push(policy_, version);
  return st;
}

std::optional<CanaryResult> Job::check_canary(int64_t step) {
  if (!canary_) return std::nullopt;
  return canary_->check(*engine_, *trainer_, policy_, step,
                        static_cast<uint64_t>(state_.weight_version), remote_.get());
}

// The update and publish phases. The training phase does not need the engine's KV cache and
// activations: with placement.release_memory they are freed for the trainer, and the trainer's
// activations for the rollout and eval that follow.
Updated Job::update_and_publish(const Selected& selected) {
  Updated u;
  if (job_.placement.release_memory) engine_->release_memory();
  if (selected.batch() == 0) return u;
  const auto t0 = Clock::now();
  u.train = trainer_->step(selected.train, comm_ != nullptr ? &selected.shard : nullptr);
  if (job_.placement.release_memory) trainer_->release_activations();
  state_.weight_version += 1;
  const auto t1 = Clock::now();
  u.published = publish();
  u.publish_s = seconds_since(t1);
  u.train_s = seconds_since(t0);
  u.canary = check_canary(state_.step + 1);
  return u;
}

// Held-out prompts: eval.pass_k samples each, all in one batch through the engine; a sample is
// correct when the first reward function gives it at least 1 (e.g. math_match). pass@1 comes
// with its 95% interval over the prompts (trainer/pass_interval.h). Every rank of the first
// rollout replica generates (the engine's ranks make the same calls); the writer scores and
// records.
void Job::evaluate() {
  if (eval_prompts_.empty()) return;
  const auto t0 = Clock::now();
  const int k = static_cast<int>(job_.eval.pass_k);
  std::vector<Group> groups =
      generate(*engine_, m_, eval_prompts_, job_, k, job_.eval.temperature, 424242);
  if (role_ != Role::writer) return;
  const rewards::RewardBreakdown b = score(groups, rewards_, job_);
  double reward_sum = 0, solved = 0;
  std::vector<double> correct_fraction;
  size_t i = 0;
  for (const Group& g : groups) {
    int64_t correct = 0;
    for (size_t j = 0; j < g.samples.size(); ++j, ++i) {
      reward_sum += b.total[i];
      correct += !b.values.empty() && b.values[0][i] >= 1.0 ? 1 : 0;
    }
    solved += correct > 0 ? 1 : 0;
    correct_fraction.push_back(static_cast<double>(correct) /
                               static_cast<double>(g.samples.size()));
  }
  const PassInterval p = pass_at_1(correct_fraction);
  const double passk = solved / static_cast<double>(groups.size());
  const double mean_reward = reward_sum / static_cast<double>(i);
  const double eval_s = seconds_since(t0);
  nlohmann::ordered_json j{{"step", state_.step},
                           {"eval/mean_reward", mean_reward},
                           {"eval/pass@1", p.pass1},
                           {"eval/pass@1_low", p.low},
                           {"eval/pass@1_high", p.high}};
  if (k > 1) j["eval/pass@k"] = passk;  // with one sample per prompt it is pass@1
  j["eval/k"] = job_.eval.pass_k;
  j["eval/prompts"] = p.prompts;
  j["eval/time_s"] = eval_s;
  write_metrics(j);
  const std::string at_k = k > 1 ? fmt::format(", pass@{} {:.3f}", k, passk) : "";
  std::fprintf(stderr,
               "tandem: eval at step %lld: pass@1 %.3f (95%% interval %.3f-%.3f; %lld prompts x "
               "%d)%s, reward %.3f, %.1f s\n",
               static_cast<long long>(state_.step), p.pass1, p.low, p.high,
               static_cast<long long>(p.prompts), k, at_k.c_str(), mean_reward, eval_s);
  write_report((fs::path(job_.logging.dir) / "metrics.jsonl").string(),
               (fs::path(job_.logging.dir) / "report.html").string(),
               fmt::format("tandem: {}", job_.source));
  if (!result_.first_eval) result_.first_eval = p;
  result_.last_eval = p;
}

// One line of metrics.jsonl, and its numbers as TensorBoard scalars.
void Job::write_metrics(const nlohmann::ordered_json& line) {
  metrics_out_->write_line(line.dump());
  if (tensorboard_)
    tensorboard_->write(
        line,
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
}

// Collective on several ranks: each writes its range of the optimizer state, rank 0 the policy,
// the trainer state and, once every part is written, the commit marker.
void Job::checkpoint() {
  state_.extra["stream"] = stream_.state();
  state_.extra["optimizer_steps"] = trainer_->steps_done();
  CheckpointOptions co;
  co.keep_last = static_cast<int>(job_.checkpoint.keep_last);
  co.extra_files = tokenizer_files_;
  co.on_stage = stall_for_tests(rank_, state_.step);
  const std::string dir =
      sharded_ ? save_checkpoint(job_.checkpoint.dir, state_.step, policy_, *sharded_, state_, co)
               : save_checkpoint(job_.checkpoint.dir, state_.step, policy_, *adamw_, state_, co);
  if (role_ == Role::writer) std::fprintf(stderr, "tandem: checkpoint %s\n", dir.c_str());
}

// The record phase: the step's metrics line, the report, the progress line and a sample.
void Job::record(const Collected& c, const Selected& s, const Updated& u, double step_s,
                 Role role) {
  if (role != Role::writer) return;
  const TrainStepMetrics& tm = u.train;
  int64_t samples = 0, tokens = 0, max_len = 0, truncated = 0;
  for (const Group& g : c.groups) {
    for (const Sample& x : g.samples) {
      const auto len = x.length;
      ++samples;
      tokens += len;
      max_len = std::max(max_len, len);
      truncated += x.truncated ? 1 : 0;
    }
  }
  const double n_samples = std::max<double>(static_cast<double>(samples), 1.0);
  nlohmann::ordered_json j;
  j["step"] = state_.step;
  j["loss"] = tm.loss;
  j["reward/mean"] = s.rewards.mean;
  j["reward/std"] = s.rewards.std;
  const nlohmann::json reward_metrics = c.breakdown.metrics();
  for (auto it = reward_metrics.begin(); it != reward_metrics.end(); ++it) j[it.key()] = *it;
  j["advantage/mean"] = s.advantages.advantage_mean;
  j["advantage/std"] = s.advantages.advantage_std;
  j["advantage/min"] = s.advantages.advantage_min;
  j["advantage/max"] = s.advantages.advantage_max;
  j["zero_variance_group_fraction"] = s.rewards.zero_variance_fraction;
  j["pg_clipfrac_low"] = tm.policy.pg_clipfrac_low();
  j["pg_clipfrac_high"] = tm.policy.pg_clipfrac_high();
  j["kl_old"] = tm.policy.approx_kl_old();
  j["kl_ref"] = tm.policy.kl_ref_mean();
  j["entropy"] = tm.policy.entropy_mean();
  j["grad_norm"] = tm.grad_norm;
  j["lr"] = tm.lr;
  j["skipped_steps"] = tm.skipped_steps;
  j["response_length/mean"] = static_cast<double>(tokens) / n_samples;
  j["response_length/max"] = max_len;
  j["response_tokens"] = tokens;
  j["truncation_rate"] = static_cast<double>(truncated) / n_samples;
  j["old_logp_recomputed"] = tm.old_recomputed ? 1 : 0;
  if (tm.old_recomputed) {  // otherwise the old logprobs are the rollout's: nothing to compare
    j["rollout_trainer_logp/max_abs"] = tm.rollout_vs_trainer_max_abs;
    j["rollout_trainer_logp/mean_abs"] = tm.rollout_vs_trainer_mean_abs;
    j["token_mult_prob_error"] = tm.policy.token_mult_prob_error();
  }
  j["samples_trained"] = s.batch();
  j["samples_masked_truncated"] = s.masked_truncated;
  j["samples_dropped_remainder"] = s.dropped_remainder;
  j["data/prompts_skipped_too_long"] = c.prompts_skipped;
  j["packed_tokens"] = tm.packed_tokens;
  j["update_skipped"] = s.batch() == 0 ? 1 : 0;
  j["dynamic_sampling/groups_generated"] = c.groups.size();
  j["dynamic_sampling/groups_kept"] = c.groups_kept;
  j["dynamic_sampling/refill_rounds"] = c.refill_rounds;
  j["memory/peak_rss_mib"] = peak_rss_mib();  // rank 0's
  j["memory/optimizer_state_mib"] =
      static_cast<double>(sharded_
                              ? sharded_->state_bytes()
                              : static_cast<int64_t>(adamw_->m().nbytes() + adamw_->v().nbytes())) /
      (1024.0 * 1024.0);
  j["distributed/ranks"] = world_;
  j["distributed/rollout_tp"] = rollout_->tp();
  j["tokens_per_s"] = static_cast<double>(tokens) / std::max(step_s, 1e-9);
  j["time/rollout_s"] = c.rollout_s;
  j["time/reward_s"] = c.reward_s;
  j["time/train_s"] = u.train_s;
  j["time/old_logp_s"] = tm.seconds_old;
  j["time/ref_logp_s"] = tm.seconds_ref;
  j["time/update_s"] = tm.seconds_update;
  j["weight_sync/bytes"] = u.published.bytes_written;
  j["weight_sync/cast_tensors"] = u.published.cast;
  j["weight_sync/copied_tensors"] = u.published.copied;
  j["weight_sync/shared_tensors"] = u.published.shared;
  j["time/publish_s"] = u.publish_s;
  if (u.canary) {
    j["weight_sync/canary_max_abs"] = u.canary->max_abs;
    j["time/canary_s"] = u.canary->seconds;
  }
  j["time/step_s"] = step_s;
  if (remote_) remote_->add_metrics(j);
  write_metrics(j);
  if (hooks_.on_step) hooks_.on_step(j);
  write_report((fs::path(job_.logging.dir) / "metrics.jsonl").string(),
               (fs::path(job_.logging.dir) / "report.html").string(),
               fmt::format("tandem: {}", job_.source));

  if (s.batch() == 0)
    std::fprintf(stderr,
                 "tandem: step %lld: no sample to train on (%lld groups generated, none with "
                 "reward variance after %lld refill rounds): update skipped\n",
                 static_cast<long long>(state_.step), static_cast<long long>(c.groups.size()),
                 static_cast<long long>(c.refill_rounds));
  if (s.dropped_remainder > 0)
    std::fprintf(stderr,
                 "tandem: step %lld: %lld samples left out so that trainer.minibatches = %lld "
                 "divides the %lld that enter the loss\n",
                 static_cast<long long>(state_.step), static_cast<long long>(s.dropped_remainder),
                 static_cast<long long>(job_.trainer.step.minibatches),
                 static_cast<long long>(s.batch() + static_cast<size_t>(s.dropped_remainder)));
  const double per_step = seconds_since(start_) / static_cast<double>(state_.step - first_step_);
  const std::string groups = job_.trainer.shaping.dynamic_sampling
                                 ? fmt::format(" | groups {}/{} ({} refills)", c.groups_kept,
                                               c.groups.size(), c.refill_rounds)
                                 : "";
  std::fprintf(
      stderr,
      "step %lld/%lld | reward %.3f%s | kl %.4f | entropy %.3f | len %.1f | %.0f tok/s | "
      "%.1fs (rollout %.1f, train %.1f) | eta %s\n",
      static_cast<long long>(state_.step), static_cast<long long>(job_.trainer.steps),
      s.rewards.mean, groups.c_str(), tm.policy.kl_ref_mean(), tm.policy.entropy_mean(),
      j["response_length/mean"].get<double>(), j["tokens_per_s"].get<double>(), step_s, c.rollout_s,
      u.train_s,
      format_eta(per_step * static_cast<double>(job_.trainer.steps - state_.step)).c_str());
  if (job_.logging.samples_every > 0 && state_.step % job_.logging.samples_every == 0 &&
      !c.groups.empty() && !c.groups[0].samples.empty()) {
    const Group& g = c.groups[0];
    samples_out_->write_line(nlohmann::json{
        {"step", state_.step},
        {"prompt", g.prompt.rendered.text},
        {"completion", g.samples[0].text},
        {"answer", g.prompt.example.answer},
        {"reward",
         g.samples[0].reward}}.dump());
  }
}

std::pair<size_t, size_t> Job::share(size_t count, int rank) const {
  const auto n = static_cast<size_t>(world_), r = static_cast<size_t>(rank);
  return {count * r / n, count * (r + 1) / n};
}

bool Job::any_rank(bool mine) {
  if (comm_ == nullptr) return mine;
  const double flag = mine ? 1 : 0;
  for (const double f : gather_doubles(*comm_, std::span<const double>(&flag, 1)))
    if (f != 0) return true;
  return false;
}

// Each sample travels as its reward, its reward functions' total, truncation and length, then
// each function's value and whether it failed: 4 + 2F doubles, all-gathered in rank order.
std::vector<Group> Job::exchange(std::vector<Group> mine, std::vector<Prompt>& prompts,
                                 rewards::RewardBreakdown& breakdown) {
  const size_t F = job_.rewards.size(), K = 4 + 2 * F, G = static_cast<size_t>(job_.rollout.n);
  std::vector<double> out;
  size_t i = 0;
  for (const Group& g : mine) {
    TANDEM_CHECK(g.samples.size() == G, "rollout of prompt '{}' gave {} samples, not {}",
                 g.prompt.example.id, g.samples.size(), G);
    for (const Sample& x : g.samples) {
      out.insert(out.end(), {static_cast<double>(x.reward), breakdown.total[i],
                             x.truncated ? 1.0 : 0.0, static_cast<double>(x.length)});
      for (size_t f = 0; f < F; ++f) out.push_back(breakdown.values[f][i]);
      for (size_t f = 0; f < F; ++f) out.push_back(breakdown.failed[f][i]);
      ++i;
    }
  }
  std::vector<int64_t> counts;
  for (int r = 0; r < world_; ++r) {
    const auto [a, b] = share(prompts.size(), r);
    counts.push_back(static_cast<int64_t>((b - a) * G * K));
  }
  std::vector<double> all(prompts.size() * G * K);
  comm_->all_gather_v(Tensor::wrap(out.data(), {static_cast<int64_t>(out.size())}, DType::i64),
                      Tensor::wrap(all.data(), {static_cast<int64_t>(all.size())}, DType::i64),
                      counts);

  rewards::RewardBreakdown round;
  for (const RewardSpec& r : job_.rewards) round.names.push_back(r.name);
  round.values.resize(F);
  round.failed.resize(F);
  round.call_errors = breakdown.call_errors;
  round.call_errors.resize(F);
  const auto [first, last] = share(prompts.size(), rank_);
  std::vector<Group> groups;
  for (size_t p = 0; p < prompts.size(); ++p) {
    if (p >= first && p < last) {
      groups.push_back(std::move(mine[p - first]));
    } else {
      Group g;
      g.prompt = prompts[p];
      g.local = false;
      groups.push_back(std::move(g));
    }
    for (size_t k = 0; k < G; ++k) {
      const double* x = all.data() + (p * G + k) * K;
      if (!groups.back().local) {
        Sample sample;
        sample.reward = static_cast<float>(x[0]);
        sample.truncated = x[2] != 0;
        sample.length = static_cast<int64_t>(x[3]);
        groups.back().samples.push_back(std::move(sample));
      }
      round.total.push_back(x[1]);
      for (size_t f = 0; f < F; ++f) {
        round.values[f].push_back(x[4 + f]);
        round.failed[f].push_back(static_cast<uint8_t>(x[4 + F + f]));
      }
    }
  }
  breakdown = std::move(round);
  return groups;
}

JobResult Job::run() {
  // The first rollout replica evaluates (the weights are the same on every rank), rank 0 records.
  const bool eval = rollout_->replica() == 0 && job_.eval.every > 0 && !eval_prompts_.empty();
  const bool checkpoints = hooks_.checkpoints;
  if (eval) evaluate();
  while (state_.step < job_.trainer.steps) {
    const auto t0 = Clock::now();
    Collected collected = collect();
    const Selected selected = select(collected, job_);
    const Updated updated = update_and_publish(selected);
    state_.step += 1;
    state_.data_epoch = stream_.epoch();
    state_.data_position = stream_.index();
    record(collected, selected, updated, seconds_since(t0), role_);
    result_.steps_done = state_.step;
    if (eval && state_.step % job_.eval.every == 0) evaluate();
    const bool last = state_.step >= job_.trainer.steps;
    // A signal may reach the ranks in different steps: all stop after the same one.
    const bool stop = any_rank(stop_.load());
    if (checkpoints &&
        (stop || last || (job_.checkpoint.every > 0 && state_.step % job_.checkpoint.every == 0)))
      checkpoint();
    if (stop) {
      result_.interrupted = true;
      break;
    }
  }
  if (eval && state_.step % job_.eval.every != 0) evaluate();
  return result_;
}

}  // namespace

Dataset job_dataset(const JobConfig& job) { return make_data(job); }

JobResult run_job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks) {
  TANDEM_CHECK(job.placement.device == "cpu",
               "placement {} on {} is not available yet: use cpu ({})", job.placement.mode,
               job.placement.device, job.where("placement.mode"));
  TANDEM_CHECK(fs::exists(job.model.path), "model.path '{}' does not exist ({})", job.model.path,
               job.where("model.path"));
  // Process-wide, so that rollout and training compute alike; restored when the job returns.
  const ops::ScopedMatmulPrecision precision(
      job.placement.cpu_matmul == "bf16" ? ops::MatmulPrecision::bf16 : ops::MatmulPrecision::f32);
  if (job.placement.cpu_matmul == "bf16" &&
      ops::matmul_bf16_path() == ops::MatmulBf16Path::f32_kernel)
    spdlog::warn(
        "placement.cpu_matmul = \"bf16\" without AMX-BF16 or AVX512-BF16 on this CPU (or with "
        "TANDEM_CPU_MATMUL_KERNEL=portable): the operands are rounded, then summed by the f32 "
        "kernel (slower than f32)");
  // The data-parallel ranks meet before anything is written; a world the batch does not allow is
  // refused first.
  const rendezvous::RankInfo info = rendezvous::detect_rank_info_from_environment();
  const int64_t world = info.world_size;
  TANDEM_CHECK(job.placement.ranks == 0 || job.placement.ranks == world,
               "placement.ranks = {} but {} rank{} started ({}): start the job with `tandem launch "
               "--nproc {} -- tandem train ...`, or set placement.ranks = 0 ({})",
               job.placement.ranks, world, world == 1 ? " was" : "s were", info.source,
               job.placement.ranks, job.where("placement.ranks"));
  TANDEM_CHECK(job.rollout.prompts_per_step % world == 0,
               "rollout.prompts_per_step = {} is not a multiple of the {} ranks: each rank "
               "generates and trains whole groups, as many as every other; use a multiple of {} "
               "({})",
               job.rollout.prompts_per_step, world, world, job.where("rollout.prompts_per_step"));
  check_rollout_tp(job, world);
  TANDEM_CHECK(world == 1 || job.placement.mode == "colocated",
               "a disaggregated job trains on one rank for now, and {} were started ({}): start "
               "`tandem train` alone ({})",
               world, info.source, job.where("placement.mode"));
  std::unique_ptr<Communicator> comm;
  if (world > 1) {
    CommOptions o;
    o.timeout_s = job.distributed.timeout_s;
    o.store = job.distributed.store;
    o.master = job.distributed.master;
    comm = Communicator::create(info, o);
    verify_same_config(*comm, to_toml(job));
  }
  // The writer (rank 0) checks and locks the run and checkpoint directories for the job's life.
  JobStart started;
  if (comm == nullptr || comm->rank() == 0) started = start_job(job);
  Job running(job, stop, hooks, comm.get());
  return running.run();
}

}  // namespace tandem::trainer
