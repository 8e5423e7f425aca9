// The GRPO job behind `tandem train`: rollout → rewards → advantages → (dynamic
// sampling) → update → weight publish → metrics, eval and checkpoints, on one rank or several
// data-parallel ranks (docs/distributed.md), or beside rollout workers (docs/serve.md).
#pragma once

#include <atomic>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "model/weights.h"
#include "trainer/data.h"
#include "trainer/job_config.h"
#include "trainer/pass_interval.h"

namespace tandem::trainer {

struct JobResult {
  int64_t steps_done = 0;
  bool interrupted = false;  // stopped by `stop` (Ctrl-C): a checkpoint was written
  std::optional<PassInterval> first_eval, last_eval;  // held-out pass@1; none when no eval ran
};

// What a caller other than `tandem train` (the step benchmark, the tests' job worker) asks of the
// job.
struct JobHooks {
  // Called after every step with its metrics line, as written to metrics.jsonl.
  std::function<void(const nlohmann::ordered_json& metrics)> on_step;
  bool checkpoints = true;  // false: never write one (not even at the end or on `stop`)
  // Faults the tests inject (tests/workers/job_worker.cpp):
  // - on_checkpoint_stage: on every rank, after each part of a checkpoint's save is written
  //   (CheckpointOptions::on_stage: "policy", "trainer_state", "optimizer", "committed"), with
  //   the rank and the step; e.g. to stop a rank there and kill it.
  // - after_publish: on every rank, after each publish of the trainer's weights into its rollout
  //   engine's and before the engine takes them, with the rank, the weight version and the
  //   engine's own weights (null when the engine reads the trainer's tensors: rollout.dtype f32
  //   at rollout_tp 1); e.g. to corrupt them as a bad shard would.
  // - before_gather: at trainer.shard = "parameters", on every rank's communication thread before
  //   each all-gather of a unit's weights, with the rank and the unit's index (ShardOptions::
  //   before_gather); e.g. to kill a rank in the middle of a step's gathers.
  std::function<void(int rank, int64_t step, const std::string& stage)> on_checkpoint_stage;
  std::function<void(int rank, uint64_t version, model::Weights* engine_weights)> after_publish;
  std::function<void(int rank, size_t unit)> before_gather;
  // - before_stage_backward: with trainer.pp > 1, on every rank before each backward pass of a
  //   micro-batch through its pipeline stage (ModelParallel::before_stage_backward), with the rank
  //   and the micro-batch's index in its minibatch; e.g. to kill a stage mid-schedule.
  std::function<void(int rank, int micro_batch)> before_stage_backward;
};

// Runs the job to trainer.steps (resuming from checkpoint.resume), writing
// <logging.dir>/metrics.jsonl, samples.jsonl and checkpoints; prints a progress line per step.
// `stop` (set by a signal handler) ends the run after the current step with a checkpoint.
JobResult run_job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks = {});

// The job's prompts: the training and eval splits as run_job makes them (its PromptStream then
// visits the training split in an order drawn from data.seed).
Dataset job_dataset(const JobConfig& job);

}  // namespace tandem::trainer
