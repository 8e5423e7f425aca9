// A GRPO step's plain structs (a prompt's group of scored samples; what the collect, select and
// update phases give) and the phase work that needs no job state: generating and scoring groups,
// and selecting the batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/loader.h"
#include "model/prompt.h"
#include "rewards/reward_set.h"
#include "rollout/engine.h"
#include "trainer/canary.h"
#include "trainer/data.h"
#include "trainer/disaggregated.h"
#include "trainer/grpo.h"
#include "trainer/job_config.h"
#include "trainer/rollout.h"
#include "trainer/rollout_group.h"
#include "trainer/train_step.h"

namespace tandem::trainer::job_detail {

// One completion and its score.
struct Sample {
  std::vector<int32_t> tokens;  // (n) completion ids
  std::vector<float> logprobs;  // (n) the engine's
  std::string text;
  bool truncated = false;  // stopped by rollout.max_new_tokens, not by an end token
  float reward = 0;        // the reward functions' weighted sum plus the overlong penalty
  int64_t length = 0;      // completion tokens (tokens.size() where this rank generated it)
  // The weight version its first token was sampled from, the oldest of its tokens (the job's
  // numbering, state.weight_version's).
  int64_t version = 0;
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
  // Trained by this rank: samples hold tokens and logprobs (and text where this rank generated
  // it). Another rank's group holds only each sample's reward, truncation and length. Generated
  // by this rank, except in a grid trainer, where every rank of a data-parallel replica trains
  // the replica's groups (Job::share_samples).
  bool local = true;
};

// The collect phase's result: every group generated in a step, round after round.
struct Collected {
  std::vector<Group> groups;
  rewards::RewardBreakdown breakdown;  // of every sample, in group order
  int64_t groups_kept = 0, refill_rounds = 0;
  int64_t prompts_skipped = 0;  // longer than data.max_prompt_tokens
  double rollout_s = 0, reward_s = 0;
  // The prompt stream just after this step's prompts were drawn (PromptStream::state, epoch and
  // index): what a checkpoint after this step records, though later steps' batches may be drawn.
  nlohmann::json stream_state;
  int64_t data_epoch = 0, data_position = 0;
  // A disaggregated job: the seconds of the step the trainer waited for this batch, and the
  // seconds the workers had no request of the job (-1: not measured, a colocated job).
  double trainer_idle_s = -1, rollout_idle_s = -1;
};

// The select phase's result: what the update trains on, and the statistics of the batch.
struct Selected {
  std::vector<TrainSample> train;  // this rank's share
  std::vector<int64_t> versions;   // (train) each one's Sample::version
  BatchShard shard;                // where they lie in the batch of every rank's samples
  RewardStats rewards;             // of every generated group
  AdvantageStats advantages;       // of the kept groups
  int64_t masked_truncated = 0;    // kept samples left out by trainer.shaping.mask_truncated
  int64_t downsampled = 0;         // kept groups' samples left out by trainer.shaping.downsample
  int64_t dropped_remainder = 0;   // left out so that trainer.minibatches divides the batch
  size_t batch() const { return shard.lengths.size(); }
};

// The update and publish phases' result.
struct Updated {
  int64_t version = 0;  // of the weights the update started from (state.weight_version then)
  TrainStepMetrics train;
  PublishStats published;
  std::optional<CanaryResult> canary;  // with weight_sync.canary
  double train_s = 0, publish_s = 0;
};

// Appends the scores of a later round (the same functions) to `b`.
void append(rewards::RewardBreakdown& b, const rewards::RewardBreakdown& more);

// Generates n samples for each prompt, the i-th prompt's from seed + 7919 (first + i): `first` is
// the index of prompts[0] in its round, so that a prompt's samples do not depend on the rank.
std::vector<Group> generate(Rollout& rollout, const model::LoadedModel& m,
                            std::vector<Prompt> prompts, const JobConfig& job, int n,
                            double temperature, uint64_t seed, size_t first = 0);

// Scores every sample of `groups` (setting Sample::reward) and returns the breakdown.
rewards::RewardBreakdown score(std::span<Group> groups, rewards::RewardSet& reward_set,
                               const JobConfig& job);

std::vector<float> rewards_of(const Group& g);

// The select phase: of each kept group the samples trained on (all, or PODS's max-variance
// trainer.shaping.downsample of them), their advantages computed once over them (the reward
// statistics describe every generated sample); the samples that enter the loss; a remainder that
// trainer.minibatches does not divide dropped and counted.
Selected select(Collected& c, const JobConfig& job);

}  // namespace tandem::trainer::job_detail
