// The tandem job's config schema and its binding to JobConfig: each key is declared once, with
// the member it fills, so the schema, the defaults (JobConfig's own), loading, printing and the
// generated docs cannot drift apart.
#include "trainer/job_config.h"

#include <fmt/format.h>

#include <functional>
#include <limits>
#include <set>
#include <type_traits>
#include <utility>

#include "core/error.h"

namespace tandem::trainer {

namespace {

using config::Config;
using config::Field;
using config::Value;

// A float's shortest decimal form as a double, so that 1e-6f prints as 1e-06 and reads back equal.
double float_as_double(float f) { return std::stod(fmt::format("{}", f)); }

template <class S>
struct Binding {
  Field field;
  std::function<void(const Config&, S&)> load;
  std::function<Value(const S&)> save;

  Binding& range(std::optional<double> lo, std::optional<double> hi) {
    field.range(lo, hi);
    return *this;
  }
  Binding& above(double lo) {
    field.above(lo);
    return *this;
  }
  Binding& one_of(std::vector<std::string> names) {
    field.one_of(std::move(names));
    return *this;
  }
  Binding& must_set() {
    field.must_set();
    return *this;
  }
};

// A key bound to the member acc(s) returns (a bool, integer, floating-point or string member).
template <class S, class Acc>
Binding<S> bind(std::string key, Acc acc, std::string doc) {
  using T = std::remove_cvref_t<decltype(acc(std::declval<S&>()))>;
  static const S defaults{};
  const T& def = acc(defaults);
  Binding<S> b;
  if constexpr (std::is_same_v<T, bool>) {
    b.field = config::boolean(key, def, std::move(doc));
    b.load = [key, acc](const Config& c, S& s) { acc(s) = c.get_bool(key); };
    b.save = [acc](const S& s) { return Value{acc(s)}; };
  } else if constexpr (std::is_integral_v<T>) {
    b.field = config::integer(key, def, std::move(doc));
    b.field.range(static_cast<double>(std::numeric_limits<T>::min()),
                  static_cast<double>(std::numeric_limits<T>::max()));
    b.load = [key, acc](const Config& c, S& s) { acc(s) = static_cast<T>(c.get_int(key)); };
    b.save = [acc](const S& s) { return Value{static_cast<int64_t>(acc(s))}; };
  } else if constexpr (std::is_same_v<T, float>) {
    b.field = config::real(key, float_as_double(def), std::move(doc));
    b.load = [key, acc](const Config& c, S& s) { acc(s) = static_cast<float>(c.get_float(key)); };
    b.save = [acc](const S& s) { return Value{float_as_double(acc(s))}; };
  } else if constexpr (std::is_same_v<T, double>) {
    b.field = config::real(key, def, std::move(doc));
    b.load = [key, acc](const Config& c, S& s) { acc(s) = c.get_float(key); };
    b.save = [acc](const S& s) { return Value{acc(s)}; };
  } else if constexpr (std::is_same_v<T, std::string>) {
    b.field = config::text(key, def, std::move(doc));
    b.load = [key, acc](const Config& c, S& s) { acc(s) = c.get_string(key); };
    b.save = [acc](const S& s) { return Value{acc(s)}; };
  } else {
    static_assert(std::is_same_v<T, std::vector<std::string>>);
    b.field = config::text_list(key, def, std::move(doc));
    b.load = [key, acc](const Config& c, S& s) { acc(s) = c.get_strings(key); };
    b.save = [acc](const S& s) { return Value{acc(s)}; };
  }
  return b;
}

// A key naming one of an enum's values, by the enum's name table.
template <class S, class E, size_t N, class Acc>
Binding<S> choice(std::string key, Acc acc, const NamedValue<E> (&names)[N], std::string doc) {
  static const S defaults{};
  Binding<S> b;
  b.field = config::text(key, std::string(name_of(names, acc(defaults))), std::move(doc));
  b.field.one_of(names_of(names));
  // The schema admits only the table's names, so the lookup finds one.
  b.load = [key, acc, &names](const Config& c, S& s) {
    acc(s) = value_of(names, c.get_string(key)).value();
  };
  b.save = [acc, &names](const S& s) { return Value{std::string(name_of(names, acc(s)))}; };
  return b;
}

#define TANDEM_MEMBER(expr) \
  [](auto& s) -> auto& { return s.expr; }

const std::vector<Binding<RewardSpec>>& reward_bindings() {
  static const std::vector<Binding<RewardSpec>> b = [] {
    using R = RewardSpec;
    std::vector<Binding<R>> v;
    v.push_back(bind<R>("name", TANDEM_MEMBER(name), "Name in the metrics (unique).").must_set());
    v.push_back(bind<R>("kind", TANDEM_MEMBER(kind), "Where the function lives.")
                    .one_of({"builtin", "plugin", "remote"}));
    v.push_back(bind<R>("weight", TANDEM_MEMBER(weight), "Weight in the summed reward."));
    v.push_back(bind<R>("fallback", TANDEM_MEMBER(fallback),
                        "Score of a sample whose reward threw, returned NaN or timed out."));
    v.push_back(bind<R>("max_consecutive_failures", TANDEM_MEMBER(max_consecutive_failures),
                        "This many failed batches in a row stop the run.")
                    .range(1, 1e6));
    v.push_back(bind<R>("function", TANDEM_MEMBER(function), "builtin: the function.")
                    .one_of({"", "math_match", "exact_match", "regex_format", "length_penalty"}));
    v.push_back(bind<R>("pattern", TANDEM_MEMBER(pattern),
                        "builtin regex_format: the PCRE2 pattern a completion must match."));
    v.push_back(bind<R>("target_length", TANDEM_MEMBER(target_length),
                        "builtin length_penalty: completion tokens without penalty.")
                    .range(0, 1e9));
    v.push_back(bind<R>("path", TANDEM_MEMBER(path),
                        "plugin: the shared library exporting tandem_reward_v1."));
    v.push_back(bind<R>("config", TANDEM_MEMBER(config), "plugin: the string given to its init."));
    v.push_back(bind<R>("isolate", TANDEM_MEMBER(isolate),
                        "plugin: run it in a child process, so that a crash fails one batch "
                        "(fallback scores) instead of the job."));
    v.push_back(
        bind<R>("address", TANDEM_MEMBER(address), "remote: the Thrift server, host:port."));
    v.push_back(bind<R>("timeout_ms", TANDEM_MEMBER(timeout_ms),
                        "remote: send and receive timeout of one request.")
                    .range(1, 3.6e6));
    v.push_back(bind<R>("retries", TANDEM_MEMBER(retries),
                        "remote: retries of a request after a transport error or Overloaded.")
                    .range(0, 100));
    v.push_back(bind<R>("max_concurrency", TANDEM_MEMBER(max_concurrency),
                        "remote: requests in flight at most.")
                    .range(1, 1024));
    v.push_back(bind<R>("batch_size", TANDEM_MEMBER(batch_size),
                        "remote: samples per request at most (a step's batch is split).")
                    .range(1, 1e6));
    v.push_back(bind<R>("token_env", TANDEM_MEMBER(token_env),
                        "remote: the environment variable holding the server's shared token "
                        "(\"\": none)."));
    return v;
  }();
  return b;
}

std::vector<Binding<JobConfig>> make_job_bindings() {
  using J = JobConfig;
  std::vector<Binding<J>> v;
  auto add = [&](Binding<J> b) -> Binding<J>& { return v.emplace_back(std::move(b)); };

  // model
  add(bind<J>("model.path", TANDEM_MEMBER(model.path),
              "A GGUF file or a Hugging Face model directory."))
      .must_set();
  add(bind<J>("model.chat_template", TANDEM_MEMBER(model.chat_template),
              "\"auto\" (the model's own), \"none\" (raw prompts), \"chatml\", \"llama3\", "
              "\"plain\", or a ChatML or Llama 3 Jinja template file."));
  // data
  add(bind<J>("data.source", TANDEM_MEMBER(data.source), "Where prompts come from."))
      .one_of({"synthetic", "jsonl"});
  add(bind<J>("data.task", TANDEM_MEMBER(data.task), "synthetic: the generated task."))
      .one_of({"arithmetic", "format"});
  add(bind<J>("data.difficulty", TANDEM_MEMBER(data.difficulty),
              "synthetic arithmetic: operand digits and terms grow with it."))
      .range(1, 5);
  add(bind<J>("data.synthetic_size", TANDEM_MEMBER(data.synthetic_size),
              "synthetic: prompts generated (train and eval)."))
      .range(2, 1e9);
  add(bind<J>("data.path", TANDEM_MEMBER(data.path), "jsonl: the dataset file."));
  add(bind<J>("data.eval_path", TANDEM_MEMBER(data.eval_path),
              "jsonl: a separate held-out file; when set, eval.split_fraction is not used."));
  add(bind<J>("data.prompt_field", TANDEM_MEMBER(data.prompt_field),
              "jsonl: the field holding the prompt text."));
  add(bind<J>("data.messages_field", TANDEM_MEMBER(data.messages_field),
              "jsonl: a field of chat messages used instead of prompt_field (\"\": none)."));
  add(bind<J>("data.answer_field", TANDEM_MEMBER(data.answer_field),
              "jsonl: the reference answer given to the rewards."));
  add(bind<J>("data.require_answer", TANDEM_MEMBER(data.require_answer),
              "jsonl: a line without the answer field is an error (false: the answer is \"\")."));
  add(bind<J>("data.id_field", TANDEM_MEMBER(data.id_field),
              "jsonl: the optional example id; without one the id is <file name>:<line>."));
  add(bind<J>("data.extra_fields", TANDEM_MEMBER(data.extra_fields),
              "jsonl: more fields passed to the rewards."));
  add(bind<J>("data.system_prompt", TANDEM_MEMBER(data.system_prompt),
              "A system message put before each prompt (\"\": none)."));
  add(bind<J>("data.max_prompt_tokens", TANDEM_MEMBER(data.max_prompt_tokens),
              "Longer prompts are skipped."))
      .range(1, 1e7);
  add(bind<J>("data.seed", TANDEM_MEMBER(data.seed),
              "Seed of generation, shuffling and the split."))
      .range(0, std::nullopt);
  add(bind<J>("data.shuffle", TANDEM_MEMBER(data.shuffle),
              "Visit the training prompts in a new order every epoch (false: file order)."));
  // rollout
  add(bind<J>("rollout.prompts_per_step", TANDEM_MEMBER(rollout.prompts_per_step),
              "B: prompts per GRPO step."))
      .range(1, 1e6);
  add(bind<J>("rollout.n", TANDEM_MEMBER(rollout.n), "G: samples per prompt (a group)."))
      .range(2, 4096);
  add(bind<J>("rollout.max_new_tokens", TANDEM_MEMBER(rollout.max_new_tokens),
              "Completion tokens per sample at most."))
      .range(1, 1e6);
  add(bind<J>("rollout.temperature", TANDEM_MEMBER(rollout.temperature),
              "Sampling temperature (also divides the trainer's logits)."))
      .above(0);
  add(bind<J>("rollout.top_p", TANDEM_MEMBER(rollout.top_p), "Nucleus sampling; 1: off."))
      .above(0)
      .range(0, 1);
  add(bind<J>("rollout.top_k", TANDEM_MEMBER(rollout.top_k), "Top-k sampling; 0: off."))
      .range(0, 1e7);
  add(bind<J>("rollout.min_p", TANDEM_MEMBER(rollout.min_p), "Min-p sampling; 0: off."))
      .range(0, 1);
  add(bind<J>("rollout.seed", TANDEM_MEMBER(rollout.seed), "Seed of the sampler."))
      .range(0, std::nullopt);
  add(bind<J>("rollout.block_size", TANDEM_MEMBER(rollout.block_size), "Tokens per KV block."))
      .range(1, 4096);
  add(bind<J>("rollout.num_blocks", TANDEM_MEMBER(rollout.num_blocks), "KV blocks in the arena."))
      .range(1, 1e9);
  add(bind<J>("rollout.max_batch_tokens", TANDEM_MEMBER(rollout.max_batch_tokens),
              "Tokens computed per engine step."))
      .range(1, 1e9);
  add(bind<J>("rollout.max_seqs", TANDEM_MEMBER(rollout.max_seqs), "Sequences per engine step."))
      .range(1, 1e7);
  add(bind<J>("rollout.dtype", TANDEM_MEMBER(rollout.dtype),
              "Weights the engine samples from: \"f32\" reads the trainer's master weights in "
              "place (publishing moves no bytes); \"bf16\" keeps a bf16 copy that each publish "
              "casts from them, and the trainer then recomputes the old logprobs."))
      .one_of({"f32", "bf16"});
  add(bind<J>("rollout.max_staleness", TANDEM_MEMBER(rollout.max_staleness),
              "k: weight versions a sample may lag the weights it is trained on (from the "
              "version of its first token). 0: each step's batch is generated after the previous "
              "update. Above 0 (placement.mode = \"disaggregated\" only): the workers generate "
              "the next steps' batches while the trainer updates, and the loss's old logprobs "
              "are the rollout's (behaviour) ones (docs/train.md, \"Asynchronous rollouts\")."))
      .range(0, 1000);
  add(bind<J>("rollout.partial", TANDEM_MEMBER(rollout.partial),
              "Partial rollouts: samples still generating when new weights reach an engine go on "
              "under them from its next step, each token tagged with the version that produced it "
              "(true), or finish under the weights they started on while samples not started "
              "wait for them (false). Matters where weights arrive during generation "
              "(rollout.max_staleness above 0)."));
  // trainer
  add(bind<J>("trainer.steps", TANDEM_MEMBER(trainer.steps), "GRPO steps of the run."))
      .range(1, 1e9);
  add(bind<J>("trainer.lr", TANDEM_MEMBER(trainer.schedule.lr), "Peak learning rate.")).range(0, 1);
  add(bind<J>("trainer.epochs", TANDEM_MEMBER(trainer.step.epochs),
              "mu: passes over each step's batch."))
      .range(1, 1000);
  add(bind<J>("trainer.minibatches", TANDEM_MEMBER(trainer.step.minibatches),
              "Optimizer steps per epoch; must divide prompts_per_step * n."))
      .range(1, 1e6);
  add(bind<J>("trainer.micro_batch_tokens", TANDEM_MEMBER(trainer.step.micro_batch_tokens),
              "Packed tokens per forward/backward at most."))
      .range(1, 1e9);
  add(bind<J>("trainer.deterministic", TANDEM_MEMBER(trainer.step.deterministic),
              "The same update bitwise on any number of data-parallel ranks: micro-batches never "
              "span two groups, gradients summed in fixed point, the sharded optimizer on one rank "
              "too (docs/distributed.md). Costs 8 bytes a parameter and a pass over the gradients "
              "per micro-batch."));
  add(choice<J>("trainer.shard", TANDEM_MEMBER(trainer.shard.level), kShardLevelNames,
                "What the data-parallel ranks split (ZeRO): \"optimizer\" the AdamW moments "
                "(ZeRO-1), \"gradients\" and the gradients, reduce-scattered as backward "
                "finishes each layer (ZeRO-2), \"parameters\" and the f32 weights, each layer's "
                "gathered before use (ZeRO-3, FSDP). One non-deterministic rank: whole AdamW "
                "(docs/distributed.md)."));
  add(bind<J>("trainer.overlap_comm", TANDEM_MEMBER(trainer.shard.overlap),
              "Run the sharded optimizer's collectives on a thread of their own while the "
              "decoder computes; false: each one waited for as it is issued."));
  add(bind<J>("trainer.comm_bucket_mb", TANDEM_MEMBER(trainer.comm_bucket_mb),
              "MiB of f32 one collective of the sharded optimizer carries at most (a layer's "
              "larger ones go in pieces)."))
      .range(1, 4096);
  add(bind<J>(
          "trainer.tp", TANDEM_MEMBER(trainer.tp),
          "Tensor-parallel trainer ranks: each layer's heads, MLP width and vocabulary split "
          "over tp consecutive ranks (per block one all-gather added in rank order forward, one "
          "all-reduce backward). Must "
          "divide the model's query and key-value heads, MLP width and vocabulary; "
          "independent of placement.rollout_tp (docs/distributed.md)."))
      .range(1, 4096);
  add(bind<J>("trainer.pp", TANDEM_MEMBER(trainer.pp),
              "Pipeline stages of the trainer: the layers in pp contiguous stages (the embedding "
              "on the first, the head on the last), micro-batches under 1F1B. trainer.tp x "
              "trainer.pp divides the ranks; the rest are data-parallel (docs/distributed.md)."))
      .range(1, 4096);
  add(bind<J>("trainer.always_recompute_old", TANDEM_MEMBER(trainer.step.always_recompute_old),
              "Recompute old logprobs even when the rollout's are exact (mu = 1, one minibatch); "
              "on whenever rollout.dtype differs from trainer.dtype."));
  add(bind<J>("trainer.share_prompts", TANDEM_MEMBER(trainer.step.share_prompts),
              "Pack a group's prompt once for its n completions (the same logprobs, fewer "
              "tokens through forward and backward); CPU only, each sample whole on CUDA."));
  add(bind<J>("trainer.dtype", TANDEM_MEMBER(trainer.dtype), "Master weights' type."))
      .one_of({"f32"});
  // trainer.algorithm
  add(choice<J>("trainer.algorithm.advantage_baseline",
                TANDEM_MEMBER(trainer.grpo.advantage.baseline), kAdvantageBaselineNames,
                "Subtracted from each reward: the group's mean (GRPO) or the others' (RLOO)."));
  add(choice<J>("trainer.algorithm.advantage_scale", TANDEM_MEMBER(trainer.grpo.advantage.scale),
                kAdvantageScaleNames, "What the centred reward is divided by (none: Dr. GRPO)."));
  add(bind<J>("trainer.algorithm.advantage_eps", TANDEM_MEMBER(trainer.grpo.advantage.eps),
              "Added to the std; > 0 when dividing by a std."))
      .range(0, 1);
  add(choice<J>("trainer.algorithm.ratio_level", TANDEM_MEMBER(trainer.grpo.loss.ratio_level),
                kRatioLevelNames, "Importance ratio per token (PPO/GRPO) or per sequence (GSPO)."));
  add(bind<J>("trainer.algorithm.clip", TANDEM_MEMBER(trainer.grpo.loss.clip),
              "Clip the ratio (trust region); false: l = -A * ratio."));
  add(bind<J>("trainer.algorithm.eps_low", TANDEM_MEMBER(trainer.grpo.loss.eps_low),
              "Ratio clipped below at 1 - eps_low."))
      .range(0, 0.999999);
  add(bind<J>("trainer.algorithm.eps_high", TANDEM_MEMBER(trainer.grpo.loss.eps_high),
              "Ratio clipped above at 1 + eps_high (clip-higher, DAPO, when > eps_low)."))
      .range(0, 1e6);
  add(bind<J>("trainer.algorithm.dual_clip_c", TANDEM_MEMBER(trainer.grpo.loss.dual_clip_c),
              "Dual clip: loss <= -A * c for A < 0; 0: off, else > 1."))
      .range(0, 1e6);
  add(choice<J>("trainer.algorithm.loss_aggregation", TANDEM_MEMBER(trainer.grpo.loss.aggregation),
                kLossAggregationNames,
                "How per-token losses become one number (see docs/grpo.md)."));
  add(bind<J>("trainer.algorithm.seq_sum_norm", TANDEM_MEMBER(trainer.grpo.loss.seq_sum_norm),
              "seq-mean-token-sum-norm's constant; 0: rollout.max_new_tokens."))
      .range(0, 1e9);
  add(choice<J>("trainer.algorithm.kl_estimator", TANDEM_MEMBER(trainer.grpo.loss.kl_estimator),
                kKlEstimatorNames, "Estimator of the KL to the reference policy."));
  add(bind<J>("trainer.algorithm.kl_beta", TANDEM_MEMBER(trainer.grpo.loss.kl_beta),
              "Weight of the KL term; 0: no reference model."))
      .range(0, 1e6);
  add(bind<J>("trainer.algorithm.entropy_coef", TANDEM_MEMBER(trainer.grpo.loss.entropy_coef),
              "Entropy bonus weight."))
      .range(0, 1e6);
  add(choice<J>("trainer.algorithm.is_level", TANDEM_MEMBER(trainer.grpo.loss.is_level),
                kImportanceLevelNames,
                "Rollout/trainer mismatch correction exp(old - rollout): off, per token or per "
                "sequence."));
  add(choice<J>("trainer.algorithm.is_mode", TANDEM_MEMBER(trainer.grpo.loss.is_mode),
                kImportanceModeNames, "Weights above is_cap: truncated to it (TIS) or set to 0."));
  add(bind<J>("trainer.algorithm.is_cap", TANDEM_MEMBER(trainer.grpo.loss.is_cap),
              "Cap of the importance weight."))
      .above(0);
  add(bind<J>("trainer.algorithm.dynamic_sampling", TANDEM_MEMBER(trainer.shaping.dynamic_sampling),
              "Drop groups whose rewards are all equal and draw more prompts in their place "
              "(DAPO)."));
  add(bind<J>("trainer.algorithm.max_refill_rounds",
              TANDEM_MEMBER(trainer.shaping.max_refill_rounds),
              "dynamic_sampling: rounds of more prompts while fewer than prompts_per_step groups "
              "have reward variance; then the step trains on what it has (0: no refill)."))
      .range(0, 1000);
  add(bind<J>("trainer.algorithm.downsample", TANDEM_MEMBER(trainer.shaping.downsample),
              "PODS max-variance down-sampling: of the rollout.n samples of each group, train on "
              "this many, the lowest and highest rewards whose variance is largest (advantages "
              "over them); 0: all. Rollout is cheap beside the update where it generates many "
              "samples at once (docs/train.md)."))
      .range(0, 65536);
  add(bind<J>("trainer.algorithm.mask_truncated", TANDEM_MEMBER(trainer.shaping.mask_truncated),
              "Leave samples cut by max_new_tokens out of the loss."));
  add(bind<J>("trainer.algorithm.overlong_buffer", TANDEM_MEMBER(trainer.shaping.overlong_buffer),
              "DAPO soft overlong penalty: tokens before max_new_tokens where it starts."))
      .range(0, 1e6);
  add(bind<J>("trainer.algorithm.overlong_factor", TANDEM_MEMBER(trainer.shaping.overlong_factor),
              "DAPO soft overlong penalty at max_new_tokens; 0: off."))
      .range(0, 1e6);
  // trainer.optimizer
  add(bind<J>("trainer.optimizer.beta1", TANDEM_MEMBER(trainer.optimizer.beta1), "AdamW beta1."))
      .range(0, 0.999999);
  add(bind<J>("trainer.optimizer.beta2", TANDEM_MEMBER(trainer.optimizer.beta2), "AdamW beta2."))
      .range(0, 0.999999);
  add(bind<J>("trainer.optimizer.eps", TANDEM_MEMBER(trainer.optimizer.eps), "AdamW epsilon."))
      .above(0)
      .range(0, 1);
  add(bind<J>("trainer.optimizer.weight_decay", TANDEM_MEMBER(trainer.optimizer.weight_decay),
              "Decoupled weight decay."))
      .range(0, 10);
  add(bind<J>("trainer.optimizer.decay_norms", TANDEM_MEMBER(trainer.optimizer.decay_norms),
              "Decay the norm weights too."));
  add(bind<J>("trainer.optimizer.decay_biases", TANDEM_MEMBER(trainer.optimizer.decay_biases),
              "Decay the biases too."));
  add(bind<J>("trainer.optimizer.decay_embeddings",
              TANDEM_MEMBER(trainer.optimizer.decay_embeddings),
              "Decay the embeddings (and an untied lm_head)."));
  add(bind<J>("trainer.optimizer.max_grad_norm", TANDEM_MEMBER(trainer.optimizer.max_grad_norm),
              "Global-norm clipping threshold; <= 0: off."))
      .range(-1e9, 1e9);
  add(bind<J>("trainer.optimizer.max_consecutive_skips",
              TANDEM_MEMBER(trainer.optimizer.max_consecutive_skips),
              "Non-finite gradient steps in a row that stop the run."))
      .range(1, 1e6);
  add(bind<J>("trainer.optimizer.offload", TANDEM_MEMBER(trainer.optimizer_offload),
              "Keep the AdamW moments in host memory while the rollout runs (CUDA placement). "
              "On cpu nothing to do: they are in host memory already."));
  // trainer.schedule
  add(choice<J>("trainer.schedule.kind", TANDEM_MEMBER(trainer.schedule.kind), kLrScheduleKindNames,
                "Learning-rate schedule (warmup is linear)."));
  add(bind<J>("trainer.schedule.warmup_steps", TANDEM_MEMBER(trainer.schedule.warmup_steps),
              "Warmup optimizer steps (or warmup_ratio, not both)."))
      .range(0, 1e9);
  add(bind<J>("trainer.schedule.warmup_ratio", TANDEM_MEMBER(trainer.schedule.warmup_ratio),
              "Warmup as a fraction of total_steps."))
      .range(0, 1);
  add(bind<J>("trainer.schedule.total_steps", TANDEM_MEMBER(trainer.schedule.total_steps),
              "Optimizer steps of the schedule; 0: steps * epochs * minibatches."))
      .range(0, 1e12);
  add(bind<J>("trainer.schedule.min_lr_ratio", TANDEM_MEMBER(trainer.schedule.min_lr_ratio),
              "cosine and linear end at min_lr_ratio * lr."))
      .range(0, 1);
  add(bind<J>("trainer.schedule.num_cycles", TANDEM_MEMBER(trainer.schedule.num_cycles),
              "cosine: 0.5 is one half-wave."))
      .above(0)
      .range(0, 1e6);
  // rewards
  {
    auto items = std::make_shared<config::Schema>();
    for (const auto& rb : reward_bindings()) items->add(rb.field);
    Binding<J> b;
    b.field = config::table_array("rewards", items,
                                  "Reward functions, summed with their weights; at least one.");
    b.load = [](const Config& c, J& j) {
      j.rewards.clear();
      for (const auto& item : c.get_tables("rewards")) {
        RewardSpec r;
        for (const auto& rb : reward_bindings()) rb.load(item, r);
        j.rewards.push_back(std::move(r));
      }
    };
    add(std::move(b));  // saved by to_toml through the item bindings
  }
  // checkpoint
  add(bind<J>("checkpoint.dir", TANDEM_MEMBER(checkpoint.dir), "Where checkpoints go."));
  add(bind<J>("checkpoint.every", TANDEM_MEMBER(checkpoint.every),
              "Steps between checkpoints; 0: only at the end and on Ctrl-C."))
      .range(0, 1e9);
  add(bind<J>("checkpoint.keep_last", TANDEM_MEMBER(checkpoint.keep_last),
              "Checkpoints kept (older ones are deleted)."))
      .range(1, 1e6);
  add(bind<J>("checkpoint.resume", TANDEM_MEMBER(checkpoint.resume),
              "\"auto\" (the latest in dir, if any), \"none\", or a checkpoint path."));
  add(bind<J>("checkpoint.allow_config_change", TANDEM_MEMBER(checkpoint.allow_config_change),
              "Resume from a checkpoint written under another config (the differing keys are "
              "listed; without this the job is refused). Give it as an override for the one run "
              "that changes the config."));
  // logging
  add(bind<J>("logging.dir", TANDEM_MEMBER(logging.dir),
              "Run directory: metrics.jsonl, report.html, samples."));
  add(bind<J>("logging.every", TANDEM_MEMBER(logging.every), "Steps between progress lines."))
      .range(1, 1e9);
  add(bind<J>("logging.samples_every", TANDEM_MEMBER(logging.samples_every),
              "Steps between logged sample completions; 0: never."))
      .range(0, 1e9);
  add(bind<J>("logging.level", TANDEM_MEMBER(logging.level),
              "Log level of the job (TANDEM_LOG_LEVEL, when set, wins: for debugging a run "
              "without editing its file)."))
      .one_of({"trace", "debug", "info", "warn", "error"});
  add(bind<J>("logging.tensorboard", TANDEM_MEMBER(logging.tensorboard),
              "Write every scalar of metrics.jsonl into a TensorBoard event file in dir "
              "(tensorboard --logdir runs/)."));
  // eval
  add(bind<J>("eval.every", TANDEM_MEMBER(eval.every), "Steps between evaluations; 0: off."))
      .range(0, 1e9);
  add(bind<J>("eval.split_fraction", TANDEM_MEMBER(eval.split_fraction),
              "Share of the data held out for evaluation."))
      .range(0, 0.9);
  add(bind<J>("eval.max_prompts", TANDEM_MEMBER(eval.max_prompts),
              "Held-out prompts evaluated at most, in one batch through the rollout engine; the "
              "95% interval of pass@1 is over these prompts (about +-0.09 at 128 prompts)."))
      .range(1, 1e9);
  add(bind<J>("eval.pass_k", TANDEM_MEMBER(eval.pass_k),
              "k of pass@k: samples per held-out prompt (pass@1 from the same samples; 1 with "
              "temperature 0 is greedy eval)."))
      .range(1, 1024);
  add(bind<J>("eval.temperature", TANDEM_MEMBER(eval.temperature),
              "Sampling temperature of eval; 0: greedy."))
      .range(0, 100);
  // placement
  add(bind<J>(
          "placement.mode", TANDEM_MEMBER(placement.mode),
          "Rollout and trainer placement: colocated (each rank trains and runs a rollout engine), "
          "or disaggregated (rollout workers started by `tandem serve`, placement.workers, "
          "generate every step's samples; the job trains, evaluates and pushes the new weights "
          "to them after each step; docs/serve.md)."))
      .one_of({"colocated", "disaggregated"});
  add(bind<J>("placement.device", TANDEM_MEMBER(placement.device), "Where the job runs."))
      .one_of({"cpu", "cuda"});
  add(bind<J>("placement.release_memory", TANDEM_MEMBER(placement.release_memory),
              "Colocated: free the rollout engine's KV cache and activations during the update, "
              "and the trainer's activations during rollout; each phase takes its memory again."));
  add(choice<J>("placement.cpu_matmul", TANDEM_MEMBER(placement.cpu_matmul),
                ops::kMatmulPrecisionNames,
                "Arithmetic of every CPU matmul (rollout and training): \"f32\", or \"bf16\": "
                "operands rounded to bf16 and summed in f32, the mixed precision of the CUDA "
                "matmuls, on AMX tiles where the CPU has them (about 3x the f32 rate there), "
                "else on AVX512-BF16 (vdpbf16ps, AMD Zen 4); without either slower than f32. "
                "Weights, optimizer and all other ops stay f32."));
  add(choice<J>("placement.cpu_matmul_kernel", TANDEM_MEMBER(placement.cpu_matmul_kernel),
                ops::kMatmulKernelNames,
                "Inner kernel of the CPU matmuls: \"auto\" (the best this CPU has), "
                "\"avx512bf16\" (the bf16 precision skips AMX and takes AVX512-BF16: the path "
                "of a CPU without AMX) or \"portable\" (the plain f32 kernel, bitwise the "
                "AVX-512 one; with bf16 it runs on the rounded operands). For measurements and "
                "tests of one path (docs/kernels-matmul.md)."));
  add(choice<J>("placement.cpu_matmul_backward", TANDEM_MEMBER(placement.cpu_matmul_backward),
                ops::kMatmulBackwardNames,
                "The f32 CPU backward products: \"outer\" (the outer-product kernel) or "
                "\"transpose\" (the operands transposed, then the forward's kernel: the earlier "
                "path, other bits; docs/kernels-matmul.md). bf16 takes neither."));
  add(bind<J>("placement.ranks", TANDEM_MEMBER(placement.ranks),
              "Data-parallel ranks (colocated: each trains and runs a rollout engine), started by "
              "`tandem launch --nproc N` (or mpirun, srun, torchrun); 0: as many as the launcher "
              "started. rollout.prompts_per_step must be a multiple of it (docs/distributed.md)."))
      .range(0, 4096);
  add(bind<J>("placement.rollout_tp", TANDEM_MEMBER(placement.rollout_tp),
              "Ranks of one tensor-parallel rollout engine. Colocated: ranks/rollout_tp replicas "
              "of consecutive ranks, each rank's engine holding its shard of the weights and "
              "generating its replica's prompts. Must divide the ranks and the model's query "
              "heads, MLP width and vocabulary (checked at start-up; docs/weight-sync.md)."))
      .range(1, 4096);
  add(bind<J>("placement.rank_memory_limit_gb", TANDEM_MEMBER(placement.rank_memory_limit_gb),
              "The most memory, GiB, that each rank's arenas may hold together (weights, "
              "gradients, optimizer state, activations, KV cache); a reserve past it stops the "
              "job with an error naming the class and what each holds. 0: no cap. What it counts "
              "and what it does not: \"Per-rank memory cap\" above."))
      .range(0, 1e6);
  add(bind<J>("placement.workers", TANDEM_MEMBER(placement.workers),
              "Disaggregated: the rollout workers, \"host:port\" each (`tandem serve`); each group "
              "of a step goes to the one with the fewest calls in flight."));
  add(bind<J>("placement.weights", TANDEM_MEMBER(placement.weights),
              "Disaggregated: how the new weights reach the workers after each step: \"wire\" "
              "(pushed over the rollout service in checksummed buckets of at most "
              "weight_sync.bucket_mb, cast to each worker's dtype, swapped in at the commit) or "
              "\"directory\" (an HF directory written into logging.dir that every worker "
              "loads: the workers must see it at the same path, e.g. a shared file system; "
              "docs/serve.md)."))
      .one_of({"wire", "directory"});
  add(bind<J>("placement.token_env", TANDEM_MEMBER(placement.token_env),
              "Disaggregated: the environment variable holding the workers' shared token "
              "(\"\": none, for workers on a loopback address)."));
  add(bind<J>("placement.request_timeout_ms", TANDEM_MEMBER(placement.request_timeout_ms),
              "Disaggregated: the deadline of one group's generate call on one worker; past it "
              "the group goes to another worker."))
      .range(1, 3.6e7);
  add(bind<J>("placement.attempts", TANDEM_MEMBER(placement.attempts),
              "Disaggregated: workers a group is tried on (a dead, overloaded or stale worker "
              "passes it to the next) before the step fails."))
      .range(1, 1000);
  add(bind<J>("placement.max_in_flight_per_worker",
              TANDEM_MEMBER(placement.max_in_flight_per_worker),
              "Disaggregated: generate calls sent to one worker at once (at most the worker's "
              "limits.max_in_flight)."))
      .range(1, 1048576);
  add(bind<J>("placement.connect_timeout_s", TANDEM_MEMBER(placement.connect_timeout_s),
              "Disaggregated: at start, how long the job waits for every worker to answer before "
              "it fails naming the one that did not."))
      .above(0);
  add(bind<J>("placement.health_check_interval_s", TANDEM_MEMBER(placement.health_check_interval_s),
              "Disaggregated: seconds between health checks of each worker (a weight_version "
              "call, answered off the worker's engine). A worker set aside is checked at this "
              "interval until it answers, then brought to the latest weights before it serves "
              "again."))
      .range(0.001, 86400);
  add(bind<J>("placement.health_check_timeout_s", TANDEM_MEMBER(placement.health_check_timeout_s),
              "Disaggregated: the deadline of a health check. A worker that misses it, or whose "
              "generate call misses placement.request_timeout_ms, is set aside: its groups in "
              "flight go to the other workers at once and pushes skip it until it is back."))
      .range(0.001, 86400);
  // distributed
  add(bind<J>("distributed.timeout_s", TANDEM_MEMBER(distributed.timeout_s),
              "Seconds that bound the rendezvous, every store wait and every collective: a dead "
              "or stuck rank becomes an error naming the collective and the peer."))
      .above(0);
  add(bind<J>("distributed.store", TANDEM_MEMBER(distributed.store),
              "Where ranks meet: \"tcp\" (a key-value store served by rank 0 at the "
              "coordinator) or \"file:/shared/dir\" (a fresh directory every rank sees)."));
  add(bind<J>("distributed.master", TANDEM_MEMBER(distributed.master),
              "HOST:PORT of the coordinator (rank 0), over the launcher's MASTER_ADDR/"
              "MASTER_PORT or Slurm node list; empty: from the launcher."));
  add(bind<J>("distributed.emulated_link_gbps", TANDEM_MEMBER(distributed.emulated_link_gbps),
              "Emulate a network of this many Gbit/s: each collective and send/recv returns no "
              "sooner than a ring over such a link would have moved this rank's bytes, sleeping "
              "the difference without spending CPU (for benchmarks and tests of overlap on one "
              "machine; docs/distributed.md). 0: off."))
      .range(0, std::nullopt);
  add(bind<J>("distributed.emulated_link_latency_us",
              TANDEM_MEMBER(distributed.emulated_link_latency_us),
              "Latency of the emulated link, in microseconds, added once per ring step; used "
              "when distributed.emulated_link_gbps > 0."))
      .range(0, std::nullopt);
  // weight_sync
  add(bind<J>("weight_sync.bucket_mb", TANDEM_MEMBER(weight_sync.bucket_mb),
              "MiB a rank sends, and receives, in one round of a publish at most (its two send "
              "and two receive buffers are this size). Only bytes between ranks go through "
              "buckets: a colocated job's pieces are all within the rank."))
      .range(1, 1 << 20);
  add(bind<J>("weight_sync.staged", TANDEM_MEMBER(weight_sync.staged),
              "Receive into a staging buffer and write the engines' weights only once every rank "
              "has received everything (and the checksums match): a failed publish leaves every "
              "engine on its old version. false: receive straight into the weights (less "
              "memory)."));
  add(bind<J>("weight_sync.checksums", TANDEM_MEMBER(weight_sync.checksums),
              "Compare a checksum of every piece stream between two ranks before the weights are "
              "written (one hash per element on both sides); pieces within a rank are not "
              "summed."));
  add(bind<J>("weight_sync.canary", TANDEM_MEMBER(weight_sync.canary),
              "After each publish every rollout engine generates a fixed probe greedily and the "
              "trainer scores the same tokens: the largest logprob difference is logged "
              "(weight_sync/canary_max_abs) and, above canary_tolerance, the job stops before "
              "training on that engine's samples (docs/weight-sync.md)."));
  add(bind<J>("weight_sync.canary_tokens", TANDEM_MEMBER(weight_sync.canary_tokens),
              "Tokens of the canary's probe (at most rollout.max_new_tokens)."))
      .range(1, 4096);
  add(bind<J>("weight_sync.canary_tolerance", TANDEM_MEMBER(weight_sync.canary_tolerance),
              "The largest |engine - trainer| logprob of a probe token that passes; 0: by "
              "rollout.dtype, 1e-3 for f32 (bitwise 0 on one rank, about 1e-6 with rollout_tp > "
              "1) and 2 for bf16 (up to 0.78 measured: a bf16 copy loses the updates below its "
              "rounding step)."))
      .range(0, 1e6);
  return v;
}

#undef TANDEM_MEMBER

const std::vector<Binding<JobConfig>>& job_bindings() {
  static const std::vector<Binding<JobConfig>> b = make_job_bindings();
  return b;
}

std::shared_ptr<const config::Schema> make_schema() {
  auto s = std::make_shared<config::Schema>();
  s->describe("model", "The policy model (also the reference and the rollout engine's).");
  s->describe("data", "Prompts: a synthetic task or a JSONL dataset.");
  s->describe("rollout", "Sampling of G completions per prompt by the rollout engine.");
  s->describe("trainer", "The GRPO update: steps, batch split and learning rate.");
  s->describe("trainer.algorithm",
              "Advantages, the policy loss and sample shaping (docs/grpo.md).");
  s->describe("trainer.optimizer", "AdamW (docs/trainer-optimizer.md).");
  s->describe("trainer.schedule", "Learning-rate schedule; the peak is trainer.lr.");
  s->describe("rewards", "Reward functions ([[rewards]] entries).");
  s->describe("checkpoint", "Checkpoints and resuming.");
  s->describe("logging", "Progress, metrics, report and samples.");
  s->describe("eval",
              "Held-out evaluation: mean reward, pass@1 with its 95% Wilson interval over the "
              "prompts, pass@k.");
  s->describe("placement", "Where rollout and training run.");
  s->describe("distributed",
              "Multi-rank jobs: rendezvous, timeouts and an emulated link (docs/distributed.md).");
  s->describe("weight_sync",
              "The publish of the trainer's weights into the rollout engines' after each step, "
              "and its checks (docs/weight-sync.md).");
  for (const auto& b : job_bindings()) s->add(b.field);
  return s;
}

// Cross-field rules, each error at the key that should change.
void check_job(const Config& c, JobConfig& j) {
  const auto& ro = j.rollout;
  auto& t = j.trainer;
  const int64_t down = t.shaping.downsample;
  if (down != 0 && (down < 2 || down > ro.n))
    c.fail("trainer.algorithm.downsample",
           fmt::format("expected 0 (off) or 2 to rollout.n = {} samples of a group, found {} ({})",
                       ro.n, down, c.where("rollout.n")));
  // The samples of a group that are trained on, and so the batch the minibatches divide.
  const int64_t group = down != 0 ? down : ro.n;
  const std::string group_key = down != 0 ? "trainer.algorithm.downsample" : "rollout.n";
  int64_t batch = ro.prompts_per_step * group;
  if (batch % t.step.minibatches != 0)
    c.fail("trainer.minibatches",
           fmt::format("{} does not divide the batch rollout.prompts_per_step * {} = {} * {} "
                       "= {} ({}, {})",
                       t.step.minibatches, group_key, ro.prompts_per_step, group, batch,
                       c.where("rollout.prompts_per_step"), c.where(group_key)));
  if (t.step.minibatches > 1 && (batch / t.step.minibatches) % group != 0)
    c.fail("trainer.minibatches",
           fmt::format("each minibatch of {} samples must hold whole groups of {} = {}",
                       batch / t.step.minibatches, group_key, group));
  if (t.grpo.loss.dual_clip_c != 0 && t.grpo.loss.dual_clip_c <= 1)
    c.fail("trainer.algorithm.dual_clip_c",
           fmt::format("expected 0 (off) or a number > 1, found {}", t.grpo.loss.dual_clip_c));
  if (t.grpo.advantage.scale != AdvantageScale::kNone && t.grpo.advantage.eps <= 0)
    c.fail("trainer.algorithm.advantage_eps",
           "expected > 0 when advantage_scale divides by a std, found 0");
  if (t.grpo.loss.aggregation == LossAggregation::kSeqMeanTokenSumNorm &&
      t.grpo.loss.seq_sum_norm == 0)
    t.grpo.loss.seq_sum_norm = static_cast<double>(ro.max_new_tokens);
  if (t.schedule.warmup_steps != 0 && t.schedule.warmup_ratio != 0)
    c.fail("trainer.schedule.warmup_ratio", "set warmup_steps or warmup_ratio, not both");
  int64_t optimizer_steps = t.steps * t.step.epochs * t.step.minibatches;
  if (t.schedule.total_steps == 0) t.schedule.total_steps = optimizer_steps;
  if (t.schedule.warmup_steps > t.schedule.total_steps)
    c.fail("trainer.schedule.warmup_steps",
           fmt::format("{} is more than the schedule's {} optimizer steps", t.schedule.warmup_steps,
                       t.schedule.total_steps));
  if (j.data.source == "jsonl" && j.data.path.empty())
    c.fail("data.path", "required when data.source = \"jsonl\"");
  if (j.data.prompt_field.empty() && j.data.messages_field.empty())
    c.fail("data.prompt_field", "set prompt_field or messages_field");
  if (j.eval.every > 0 && j.eval.split_fraction <= 0)
    c.fail("eval.split_fraction", "expected > 0 when eval.every > 0 (nothing to evaluate on)");
  if (j.distributed.store != "tcp" &&
      (j.distributed.store.rfind("file:", 0) != 0 || j.distributed.store.size() == 5))
    c.fail(
        "distributed.store",
        fmt::format("expected \"tcp\" or \"file:/shared/dir\", found \"{}\"", j.distributed.store));
  if (j.distributed.emulated_link_latency_us > 0 && j.distributed.emulated_link_gbps == 0)
    c.fail("distributed.emulated_link_latency_us",
           fmt::format("{} us is used only with an emulated bandwidth: set "
                       "distributed.emulated_link_gbps > 0 too, or the latency to 0",
                       j.distributed.emulated_link_latency_us));
  const PlacementSection& pl = j.placement;
  if (pl.mode == "disaggregated") {
    if (pl.workers.empty())
      c.fail("placement.workers",
             "placement.mode = \"disaggregated\" needs at least one rollout worker, e.g. "
             "workers = [\"127.0.0.1:9100\"] (start one with `tandem serve configs/serve.toml`)");
    if (pl.device != "cpu")
      c.fail("placement.device", "a disaggregated job trains on cpu only for now");
    // The workers generate; the trainer's own engine only evaluates and probes, and rank 0's
    // pushes the whole weights.
    if (pl.rollout_tp > 1)
      c.fail("placement.rollout_tp",
             "a disaggregated job's rollout runs on its workers: set placement.rollout_tp = 1 (a "
             "worker's own tensor-parallel split is its business)");
    std::set<std::string> seen;
    for (const std::string& w : pl.workers) {
      const auto colon = w.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == w.size() ||
          w.find_first_not_of("0123456789", colon + 1) != std::string::npos)
        c.fail("placement.workers", fmt::format("expected \"host:port\", found \"{}\"", w));
      if (!seen.insert(w).second)
        c.fail("placement.workers", fmt::format("\"{}\" is listed twice", w));
    }
  } else if (!pl.workers.empty()) {
    c.fail("placement.workers",
           fmt::format("workers are used by placement.mode = \"disaggregated\" only, and the "
                       "mode is \"{}\" ({})",
                       pl.mode, c.where("placement.mode")));
  }

  if (ro.max_staleness > 0) {
    if (pl.mode != "disaggregated")
      c.fail("rollout.max_staleness",
             fmt::format("{} needs placement.mode = \"disaggregated\" ({}): a colocated job "
                         "does not generate ahead of its updates (its engine and its trainer "
                         "share the same cores; docs/train.md, \"Asynchronous rollouts\"); set "
                         "rollout.max_staleness = 0",
                         ro.max_staleness, c.where("placement.mode")));
    // Recomputed old logprobs are the trainer's at the version it updates, not the behaviour
    // policy's that sampled up to k versions earlier: only the importance weight carries those.
    const bool recomputes =
        t.step.always_recompute_old || t.step.epochs > 1 || t.step.minibatches > 1;
    if (recomputes && t.grpo.loss.is_level == ImportanceLevel::kNone)
      c.fail("rollout.max_staleness",
             fmt::format("{} with old logprobs the trainer recomputes (trainer.epochs = {}, "
                         "trainer.minibatches = {}, trainer.always_recompute_old = {}) needs the "
                         "importance weight that corrects them to the behaviour policy of the "
                         "stale samples: set trainer.algorithm.is_level = \"token\" ({}), or "
                         "epochs = minibatches = 1 and always_recompute_old = false so that the "
                         "old logprobs are the rollout's",
                         ro.max_staleness, t.step.epochs, t.step.minibatches,
                         t.step.always_recompute_old, c.where("trainer.algorithm.is_level")));
  }

  if (t.tp * t.pp > 1) {
    const std::string key = t.tp > 1 ? "trainer.tp" : "trainer.pp";
    if (pl.device != "cpu")
      c.fail(key, fmt::format("tensor- and pipeline-parallel training runs on cpu only for now, "
                              "and placement.device is \"{}\" ({})",
                              pl.device, c.where("placement.device")));
  }

  WeightSyncSection& ws = j.weight_sync;
  if (ws.canary && ws.canary_tokens > ro.max_new_tokens)
    c.fail("weight_sync.canary_tokens",
           fmt::format("{} is more than rollout.max_new_tokens = {} ({}): the probe is one "
                       "completion of the rollout engine",
                       ws.canary_tokens, ro.max_new_tokens, c.where("rollout.max_new_tokens")));
  if (ws.canary_tolerance == 0)
    ws.canary_tolerance = ro.dtype == "bf16" ? kCanaryToleranceBf16 : kCanaryToleranceF32;

  const auto& items = c.get_tables("rewards");
  if (items.empty())
    c.fail("rewards",
           "at least one [[rewards]] entry is needed (e.g. kind = \"builtin\", "
           "function = \"math_match\")");
  std::set<std::string> names;
  for (size_t i = 0; i < j.rewards.size(); ++i) {
    const auto& r = j.rewards[i];
    const auto& item = items[i];
    auto fail = [&](const char* key, const std::string& msg) {
      throw Error(fmt::format("{}: rewards[{}].{}: {}",
                              item.is_set(key) ? item.where(key) : c.where("rewards"), i, key,
                              msg));
    };
    if (!names.insert(r.name).second) fail("name", fmt::format("'{}' is used twice", r.name));
    if (r.kind == "builtin") {
      if (r.function.empty()) fail("function", "required for kind = \"builtin\"");
      if (r.function == "regex_format" && r.pattern.empty())
        fail("pattern", "required for function = \"regex_format\"");
    } else if (r.kind == "plugin") {
      if (r.path.empty()) fail("path", "required for kind = \"plugin\" (the shared library)");
    } else if (r.kind == "remote") {
      auto colon = r.address.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == r.address.size() ||
          r.address.find_first_not_of("0123456789", colon + 1) != std::string::npos)
        fail("address",
             fmt::format("expected host:port for kind = \"remote\", found \"{}\"", r.address));
    }
  }

  // The trainer's own checks, as a backstop of the ranges above.
  t.step.loss = t.grpo.loss;
  t.step.temperature = static_cast<float>(ro.temperature);
  try {
    validate(t.grpo, static_cast<int>(ro.n));
    t.step.validate();
    t.optimizer.validate();
    t.schedule.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("{}: trainer: {}", c.source(), e.what()));
  }
}

JobConfig from_config(const Config& c) {
  JobConfig j;
  for (const auto& b : job_bindings()) b.load(c, j);
  j.source = c.source();
  for (const auto& f : c.schema().fields()) j.origins[f.key] = c.where(f.key);
  check_job(c, j);
  return j;
}

}  // namespace

std::shared_ptr<const config::Schema> job_schema() {
  static const std::shared_ptr<const config::Schema> s = make_schema();
  return s;
}

JobConfig load_job_config(const std::string& path, std::span<const std::string> overrides) {
  return from_config(config::load(job_schema(), path, overrides));
}

JobConfig parse_job_config(std::string_view text, const std::string& source,
                           std::span<const std::string> overrides) {
  return from_config(config::parse(job_schema(), text, source, overrides));
}

CommOptions comm_options(const DistributedSection& d) {
  CommOptions o;
  o.timeout_s = d.timeout_s;
  o.store = d.store;
  o.master = d.master;
  o.link = {d.emulated_link_gbps, d.emulated_link_latency_us};
  return o;
}

std::string to_toml(const JobConfig& job) {
  Config c = Config::defaults(job_schema(), job.source.empty() ? "<job>" : job.source);
  for (const auto& b : job_bindings())
    if (b.save) c.set(b.field.key, b.save(job));
  auto items_schema = job_schema()->find("rewards")->items;
  std::vector<Config> items;
  for (const auto& r : job.rewards) {
    Config item = Config::defaults(items_schema);
    for (const auto& rb : reward_bindings()) item.set(rb.field.key, rb.save(r));
    items.push_back(std::move(item));
  }
  c.set_tables("rewards", std::move(items));
  return config::print_toml(c);
}

std::string JobConfig::where(std::string_view key) const {
  auto it = origins.find(key);
  return it != origins.end() ? it->second : (source.empty() ? "<job>" : source) + " (default)";
}

std::string job_config_markdown() { return config::markdown(*job_schema()); }

memory_ledger::Limit rank_memory_limit(const JobConfig& job) {
  constexpr const char* kKey = "placement.rank_memory_limit_gb";
  return {static_cast<size_t>(job.placement.rank_memory_limit_gb * 1024 * 1024 * 1024), kKey,
          job.where(kKey)};
}

}  // namespace tandem::trainer
