// The colocated GRPO loop in phases: collect (rollout and refills, scored round by round),
// select (masks, dynamic sampling, advantages once), update, publish, record; on one rank or on
// several data-parallel ranks, each generating and training its share of every round's groups.
// Here: the job's construction, the collect, update, publish, eval and checkpoint phases and the
// loop; the step's structs and stateless phase work are in trainer/job_step.h, the ranks'
// exchange in trainer/job_parallel.cpp, the record phase in trainer/job_record.cpp.
#include "trainer/job.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "core/comm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/memory_available.h"
#include "kernels/ops.h"
#include "model/loader.h"
#include "rewards/factory.h"
#include "rewards/reward_set.h"
#include "rollout/engine.h"
#include "rollout/engine_memory.h"
#include "trainer/append_file.h"
#include "trainer/canary.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_grid.h"
#include "trainer/data.h"
#include "trainer/disaggregated.h"
#include "trainer/grpo.h"
#include "trainer/job_runner.h"
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

}  // namespace

namespace job_detail {

namespace {

// The optimizer, chosen once: AdamW for one rank's non-deterministic job (whole state; any
// ShardedAdamW at trainer.shard's level (on one rank too when deterministic). device), else
// ShardedAdamW at trainer.shard's level (on one rank too when deterministic); a grid trainer's over
// its data-parallel group, with the grid's options.
std::unique_ptr<Optimizer> make_optimizer(const JobConfig& job, model::Weights& policy,
                                          Communicator* comm, const JobGrid* grid,
                                          const JobHooks& hooks) {
  if (comm == nullptr && !job.trainer.step.deterministic)
    return std::make_unique<AdamW>(policy, job.trainer.optimizer);
  ShardOptions o = job.trainer.shard;
  o.deterministic = job.trainer.step.deterministic;
  o.bucket_bytes = job.trainer.comm_bucket_mb << 20;
  if (hooks.before_gather) o.before_gather = &hooks.before_gather;
  if (grid != nullptr)
    return std::make_unique<ShardedAdamW>(policy, grid->dp(), job.trainer.optimizer,
                                          grid->shard_options(o));
  return std::make_unique<ShardedAdamW>(policy, comm, job.trainer.optimizer, o);
}

}  // namespace

Job::Job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks,
         Communicator* comm, JobGrid* grid, model::LoadedModel m)
    : job_(job),
      stop_(stop),
      hooks_(hooks),
      comm_(comm),
      grid_(grid),
      rank_(comm != nullptr ? comm->rank() : 0),
      world_(comm != nullptr ? comm->size() : 1),
      role_(rank_ == 0 ? Role::writer : Role::worker),
      m_(std::move(m)),
      part_(grid != nullptr ? grid->cut(*m_.weights) : nullptr),
      policy_(part_ ? part_.get() : m_.weights.get()),
      data_(make_data(job)),
      format_(prompt_format(m_.tok(), job.model.chat_template, job.data.system_prompt)),
      stream_(data_.train, static_cast<uint64_t>(job.data.seed), job.data.shuffle),
      rewards_(make_rewards(job)),
      optimizer_(make_optimizer(job, *policy_, comm, grid, hooks)),
      sharded_(dynamic_cast<ShardedAdamW*>(optimizer_.get())),
      schedule_(schedule_config(job)),
      step_config_(train_step_config(job)) {
  TANDEM_CHECK(!data_.train.empty(), "the training split is empty ({})", job.where("data.source"));
  if (job.trainer.grpo.loss.kl_beta > 0) {
    reference_ = std::make_unique<model::Weights>(policy_->config(), policy_->part(), DType::f32);
    reference_->copy_from(*policy_);
  }
  if (grid_ != nullptr) {
    // The whole loaded weights go (their table stays for the config); the engines are filled
    // from every rank's part, or at trainer.shard = "parameters" from its pieces of it (the part
    // goes too).
    m_.weights = model::Weights::unbound(m_.config(), DType::f32);
    const weight_sync::Layout layout = grid_->layout();
    std::vector<Tensor> from;
    if (grid_->sharded_params()) {
      from = weight_sync::bind_local(layout, rank_, sharded_->local_params());
      part_ = nullptr;
      policy_ = nullptr;
    } else {
      from = weight_sync::bind(layout, rank_, params_of(*policy_));
    }
    rollout_ = std::make_unique<RolloutGroup>(job, m_.config(), layout, std::move(from), comm);
  } else if (sharded_ != nullptr && sharded_->options().level == ShardLevel::parameters) {
    // ZeRO-3: the optimizer holds this rank's pieces; the loaded whole weights go (their table
    // stays for the config) and the rollout engines are filled from the pieces.
    m_.weights = model::Weights::unbound(policy_->config(), DType::f32);
    policy_ = nullptr;
    rollout_ = std::make_unique<RolloutGroup>(job, m_.config(), sharded_->layout(),
                                              sharded_->local_params(), comm);
  } else {
    rollout_ = std::make_unique<RolloutGroup>(job, *policy_, comm);
  }
  const rollout::EngineOptions eo = engine_options(job, m_.config());
  rollout::check_engine_memory(
      rollout_->weights().config(), eo, memory_available(rollout_->weights().device()),
      {fmt::format("rollout.num_blocks ({})", job.where("rollout.num_blocks")),
       fmt::format("rollout.max_batch_tokens ({})", job.where("rollout.max_batch_tokens"))});
  engine_ =
      std::make_unique<rollout::Engine>(rollout_->weights(), eo, &m_.tok(), rollout_->tp_group());
  // pi_old is the trainer's policy: an engine sampling from other-precision weights, or splitting
  // its sums over tensor-parallel shards other than the trainer's, reports logprobs that are not
  // the trainer's bitwise, so an engine with its own weights has the trainer compute its own and
  // log the difference (rollout_trainer_logp/*: 0 where the two compute alike).
  if (!rollout_->zero_copy() || rollout_->tp() > 1) step_config_.always_recompute_old = true;
  // Disaggregated: the workers' engines sample; update_and_publish decides each step whether the
  // trainer recomputes pi_old (and logs how far the workers' logprobs are from it) or takes theirs.
  ModelParallel parallel;
  if (grid_ != nullptr) parallel = grid_->model_parallel();
  if (hooks.before_stage_backward) {
    before_stage_backward_ = [this](int micro) { hooks_.before_stage_backward(rank_, micro); };
    parallel.before_stage_backward = &before_stage_backward_;
  }
  trainer_ = std::make_unique<PolicyTrainer>(*optimizer_, reference_.get(), schedule_, step_config_,
                                             parallel);
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
  local_ = std::make_unique<LocalRollout>(*engine_, *rollout_);
  // Resumed: the engine samples from the checkpoint's version, which resume published into its
  // weights before it was the job's rollout (its samples are stamped with it).
  if (state_.weight_version != 0) local_->publish(static_cast<uint64_t>(state_.weight_version));
  train_rollout_ = local_.get();
  published_ = {local_.get()};
  if (job.placement.mode == "disaggregated") {
    start_remote();
    train_rollout_ = remote_.get();
    published_.push_back(remote_.get());
  }
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

// Rank 0 connects to the workers and pushes them its weights; on several ranks every other rank
// then connects too, told rank 0's version offset, and generates its share from what rank 0
// pushed. A rank 0 that fails tells the others, which stop too.
void Job::start_remote() {
  const auto version = static_cast<uint64_t>(state_.weight_version);
  int64_t offset = -1;
  std::string failure;
  if (rank_ == 0) {
    try {
      remote_ = std::make_unique<RemoteRollout>(job_, m_, rollout_->whole_policy(), version);
      offset = remote_->offset();
    } catch (const std::exception& e) {
      if (comm_ == nullptr) throw;
      failure = e.what();
    }
  }
  if (comm_ == nullptr) return;
  comm_->broadcast(Tensor::wrap(&offset, {1}, DType::i64), 0);
  if (!failure.empty()) TANDEM_FAIL("{}", failure);
  TANDEM_CHECK(offset >= 0,
               "rank 0 could not start the rollout workers of placement.workers (its error says "
               "why; {})",
               job_.where("placement.workers"));
  if (rank_ != 0) remote_ = std::make_unique<RemoteRollout>(job_, m_, offset, version);
}

void Job::resume() {
  std::string from = job_.checkpoint.resume;
  if (from == "auto") from = agreed_latest_checkpoint();
  if (from == "none") from.clear();
  if (from.empty()) return;
  // Any number of ranks wrote it: this rank reads the pieces that overlap its own (the policy is
  // the optimizer's weights).
  if (grid_ != nullptr)
    load_grid_checkpoint(from, *sharded_, *grid_, state_);
  else
    load_checkpoint(from, *optimizer_, state_);
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
Collected Job::collect(int64_t step) {
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
                          static_cast<uint64_t>(step) * 7919 +
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
    rollout_busy_.begin();
    try {
      if (!replica_prompts.empty())
        groups =
            generate(*train_rollout_, m_, std::move(replica_prompts), job_,
                     static_cast<int>(job_.rollout.n), job_.rollout.temperature, seed, gen_first);
    } catch (...) {
      rollout_busy_.end();
      throw;
    }
    rollout_busy_.end();
    groups = std::vector<Group>(
        std::make_move_iterator(groups.begin() + static_cast<ptrdiff_t>(first - gen_first)),
        std::make_move_iterator(groups.begin() + static_cast<ptrdiff_t>(last - gen_first)));
    c.rollout_s += seconds_since(t0);

    const auto t1 = Clock::now();
    rewards::RewardBreakdown breakdown;
    if (!groups.empty()) {
      std::lock_guard lock(rewards_mutex_);
      breakdown = score(groups, rewards_, job_);
    }
    Communicator* comm = queue_comm_ ? queue_comm_.get() : comm_;
    if (world_ > 1) groups = exchange(*comm, std::move(groups), prompts, breakdown);
    if (grid_ != nullptr) share_samples(*comm, groups);
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
  c.stream_state = stream_.state();
  c.data_epoch = stream_.epoch();
  c.data_position = stream_.index();
  return c;
}

PublishStats Job::publish() {
  const auto version = static_cast<uint64_t>(state_.weight_version);
  const PublishStats st = rollout_->publish(version);
  if (hooks_.after_publish) hooks_.after_publish(rank_, version, rollout_->own_weights());
  std::string failure;
  for (Rollout* r : published_) {
    if (r != remote_.get() || comm_ == nullptr) {
      r->publish(version);
      continue;
    }
    // Rank 0 pushes to the workers; the other ranks generate again only once it has.
    try {
      r->publish(version);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (any_rank(!failure.empty())) {
      if (!failure.empty()) TANDEM_FAIL("{}", failure);
      TANDEM_FAIL(
          "rank 0 could not push weight version {} to the rollout workers (its error "
          "says why; {})",
          version, job_.where("placement.workers"));
    }
  }
  return st;
}

std::optional<CanaryResult> Job::check_canary(int64_t step) {
  if (!canary_) return std::nullopt;
  CanaryResult r = canary_->check(*engine_, *trainer_, trainer_->policy(), step,
                                  static_cast<uint64_t>(state_.weight_version), remote_.get());
  if (remote_) {
    exact_version_ = r.max_abs == 0 ? state_.weight_version : -1;
    exact_rejoins_ = remote_->rejoins();
  }
  return r;
}

bool Job::workers_logp_exact() const {
  return remote_ && exact_version_ == state_.weight_version && remote_->rejoins() == exact_rejoins_;
}

// The update and publish phases. The training phase does not need the engine's KV cache and
// activations: with placement.release_memory they are freed for the trainer, and the trainer's
// activations for the rollout and eval that follow.
Updated Job::update_and_publish(const Selected& selected) {
  Updated u;
  u.version = state_.weight_version;
  if (job_.placement.release_memory) engine_->release_memory();
  if (selected.batch() == 0) return u;
  const int64_t k = job_.rollout.max_staleness;
  for (const int64_t v : selected.versions)  // the rollout queue's bound (trainer/rollout_queue.h)
    TANDEM_CHECK(v <= u.version && u.version - v <= k,
                 "a sample of weight version {} is in the update of version {}: more than "
                 "rollout.max_staleness = {} behind ({})",
                 v, u.version, k, job_.where("rollout.max_staleness"));
  const auto t0 = Clock::now();
  if (remote_ && !job_.trainer.step.always_recompute_old) {
    // rollout.max_staleness > 0: the old logprobs are the behaviour policy's, the ones the
    // workers recorded for each token under the version that sampled it (the ratio is policy /
    // behaviour), not the trainer's at a version the samples may not come from. At 0 the
    // workers' logprobs are the trainer's bitwise when the canary measured 0 on every worker
    // after the push they sampled from, and no worker came back unprobed since.
    // (Every rank decides alike: a rank whose pool brought a worker back counts for all.)
    const bool recompute = k == 0 && any_rank(!workers_logp_exact());
    trainer_->set_always_recompute_old(recompute);
    const int decision = k > 0 ? 2 : recompute ? 1 : 0;
    const bool multipass = job_.trainer.step.epochs > 1 || job_.trainer.step.minibatches > 1;
    if (role_ == Role::writer && recompute_logged_ != decision)
      std::fprintf(stderr, "tandem: old logprobs: %s\n",
                   decision == 2
                       ? (multipass ? "recomputed by the trainer at the version it updates "
                                      "(trainer.epochs or trainer.minibatches above 1), the "
                                      "workers' behaviour logprobs in the importance weight "
                                      "(rollout.max_staleness above 0)"
                                    : "the workers' behaviour logprobs, recorded under the "
                                      "version that sampled each token (rollout.max_staleness "
                                      "above 0: the ratio is policy / behaviour)")
                   : recompute ? "recomputed by the trainer (the workers' are not known to be its "
                                 "own: weight_sync.canary off, above 0, or a worker came back)"
                               : "the workers' (the canary found them the trainer's bitwise at "
                                 "this weight version)");
    recompute_logged_ = decision;
  }
  u.train =
      trainer_->step(selected.train, optimizer_->comm() != nullptr ? &selected.shard : nullptr);
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
      generate(*local_, m_, eval_prompts_, job_, k, job_.eval.temperature, 424242);
  if (role_ != Role::writer) return;
  rewards::RewardBreakdown b;
  {
    std::lock_guard lock(rewards_mutex_);
    b = score(groups, rewards_, job_);
  }
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

// Collective on several ranks: each writes its range of the optimizer state, rank 0 the policy,
// the trainer state and, once every part is written, the commit marker.
void Job::checkpoint() {
  // The stream after the last trained step's prompts: a resumed job draws the prompts of batches
  // generated ahead of it again.
  state_.extra["stream"] = stream_state_.is_null() ? stream_.state() : stream_state_;
  state_.extra["optimizer_steps"] = trainer_->steps_done();
  CheckpointOptions co;
  co.keep_last = static_cast<int>(job_.checkpoint.keep_last);
  co.extra_files = tokenizer_files_;
  if (hooks_.on_checkpoint_stage)
    co.on_stage = [this](const std::string& stage) {
      hooks_.on_checkpoint_stage(rank_, state_.step, stage);
    };
  const std::string dir =
      grid_ != nullptr ? save_grid_checkpoint(job_.checkpoint.dir, state_.step, *sharded_, *grid_,
                                              *comm_, state_, co, sync_options(job_.weight_sync))
                       : save_checkpoint(job_.checkpoint.dir, state_.step, *optimizer_, state_, co);
  if (role_ == Role::writer) std::fprintf(stderr, "tandem: checkpoint %s\n", dir.c_str());
}

JobResult Job::run() {
  // The first rollout replica evaluates (the weights are the same on every rank), rank 0 records.
  const bool eval = rollout_->replica() == 0 && job_.eval.every > 0 && !eval_prompts_.empty();
  const bool checkpoints = hooks_.checkpoints;
  if (eval) evaluate();
  // rollout.max_staleness = k > 0: the batches of up to k steps ahead are generated on the queue's
  // thread while this one trains (a disaggregated job; the queue's destructor waits for the batch
  // in the making).
  std::unique_ptr<RolloutQueue<Collected>> ahead;
  if (job_.rollout.max_staleness > 0 && comm_ != nullptr && !queue_comm_) {
    std::vector<int> ranks(static_cast<size_t>(world_));
    std::iota(ranks.begin(), ranks.end(), 0);
    queue_comm_ = comm_->split("rollout-queue", ranks);
  }
  if (job_.rollout.max_staleness > 0)
    ahead = std::make_unique<RolloutQueue<Collected>>(
        state_.step, job_.trainer.steps, job_.rollout.max_staleness,
        [this](int64_t step) { return collect(step); });
  while (state_.step < job_.trainer.steps) {
    const auto t0 = Clock::now();
    const double busy0 = rollout_busy_.busy_s();
    double wait_s = 0;
    Collected collected = ahead ? ahead->take(state_.step, &wait_s) : collect(state_.step);
    if (!ahead) wait_s = collected.rollout_s;  // the workers generate, the trainer waits
    const Selected selected = select(collected, job_);
    const Updated updated = update_and_publish(selected);
    if (ahead) ahead->finished(state_.step);
    state_.step += 1;
    state_.data_epoch = collected.data_epoch;
    state_.data_position = collected.data_position;
    stream_state_ = std::move(collected.stream_state);
    const double step_s = seconds_since(t0);
    if (remote_) {
      collected.trainer_idle_s = wait_s;
      collected.rollout_idle_s = std::max(0.0, step_s - (rollout_busy_.busy_s() - busy0));
    }
    record(collected, selected, updated, step_s, role_);
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

}  // namespace job_detail

Dataset job_dataset(const JobConfig& job) { return make_data(job); }

JobResult run_job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks) {
  TANDEM_CHECK(job.placement.device == "cpu",
               "placement {} on {} is not available yet: use cpu ({})", job.placement.mode,
               job.placement.device, job.where("placement.mode"));
  TANDEM_CHECK(fs::exists(job.model.path), "model.path '{}' does not exist ({})", job.model.path,
               job.where("model.path"));
  // Process-wide, so that rollout and training compute alike; restored when the job returns.
  const ops::ScopedMatmulSettings matmul({job.placement.cpu_matmul, job.placement.cpu_matmul_kernel,
                                          job.placement.cpu_matmul_backward});
  if (job.placement.cpu_matmul == ops::MatmulPrecision::bf16 &&
      ops::matmul_bf16_path() == ops::MatmulBf16Path::f32_kernel)
    spdlog::warn(
        "placement.cpu_matmul = \"bf16\" without AMX-BF16 or AVX512-BF16 on this CPU (or with "
        "placement.cpu_matmul_kernel = \"portable\"): the operands are rounded, then summed by "
        "the f32 kernel (slower than f32)");
  // The data-parallel ranks meet before anything is written; a world the batch does not allow is
  // refused first.
  const rendezvous::RankInfo info = rendezvous::detect_rank_info_from_environment();
  const int64_t world = info.world_size;
  TANDEM_CHECK(job.placement.ranks == 0 || job.placement.ranks == world,
               "placement.ranks = {} but {} rank{} started ({}): start the job with `tandem launch "
               "--nproc {} -- tandem train ...`, or set placement.ranks = 0 ({})",
               job.placement.ranks, world, world == 1 ? " was" : "s were", info.source,
               job.placement.ranks, job.where("placement.ranks"));
  // (A grid trainer's data-parallel replicas are fewer: check_trainer_grid checks those.)
  TANDEM_CHECK(job.trainer.tp * job.trainer.pp > 1 || job.rollout.prompts_per_step % world == 0,
               "rollout.prompts_per_step = {} is not a multiple of the {} ranks: each rank "
               "generates and trains whole groups, as many as every other; use a multiple of {} "
               "({})",
               job.rollout.prompts_per_step, world, world, job.where("rollout.prompts_per_step"));
  check_job_dirs(job);  // before the model's load, which takes a while
  // placement.rank_memory_limit_gb: from here every arena of the job counts against it.
  const memory_ledger::ScopedLimit memory_cap(rank_memory_limit(job));
  // Read once, here: the rollout's tensor-parallel split is checked against it before anything
  // is written or connected, and the job trains it.
  model::LoadedModel m = model::load_model(job.model.path, DType::f32);
  check_rollout_tp(job, world, m.config());
  check_trainer_grid(job, world, m.config());
  std::unique_ptr<Communicator> comm;
  if (world > 1) {
    comm = Communicator::create(info, comm_options(job.distributed));
    verify_same_config(*comm, to_toml(job));
  }
  std::unique_ptr<JobGrid> grid;
  if (job.trainer.tp * job.trainer.pp > 1) {
    grid = std::make_unique<JobGrid>(job, *comm, m.config());
    if (comm->rank() == 0)
      std::fprintf(stderr, "tandem: trainer grid: %s\n", grid->grid().describe().c_str());
  }
  // The writer (rank 0) checks and locks the run and checkpoint directories for the job's life.
  JobStart started;
  if (comm == nullptr || comm->rank() == 0) started = start_job(job);
  job_detail::Job running(job, stop, hooks, comm.get(), grid.get(), std::move(m));
  return running.run();
}

}  // namespace tandem::trainer
