// The colocated GRPO job behind `tandem train`: rollout → rewards → advantages → (dynamic
// sampling) → update → weight publish → metrics, eval and checkpoints, in one process.
#pragma once

#include <atomic>
#include <string>

#include "trainer/job_config.h"

namespace tandem::trainer {

struct JobResult {
  int64_t steps_done = 0;
  bool interrupted = false;  // stopped by `stop` (Ctrl-C): a checkpoint was written
  double first_eval_accuracy = -1, last_eval_accuracy = -1;  // pass@1; -1 when no eval ran
};

// Runs the job to trainer.steps (resuming from checkpoint.resume), writing
// <logging.dir>/metrics.jsonl, samples.jsonl and checkpoints; prints a progress line per step.
// `stop` (set by a signal handler) ends the run after the current step with a checkpoint.
JobResult run_job(const JobConfig& job, const std::atomic<bool>& stop);

}  // namespace tandem::trainer
