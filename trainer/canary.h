// The logprob canary of a job (weight_sync.canary): after a publish every rollout
// engine generates a fixed probe greedily, the trainer scores the same tokens under its own
// weights, and a difference above weight_sync.canary_tolerance stops the job before it trains on
// that engine's samples (docs/weight-sync.md, "The logprob canary").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "model/weights.h"
#include "rollout/engine.h"
#include "trainer/train_step.h"

namespace tandem::trainer {

struct JobConfig;
class RemoteRollout;

struct CanaryResult {
  double max_abs = 0;  // the largest |engine - trainer| logprob of a probe token, over every rank
  double seconds = 0;  // this rank's generate, score and exchange
};

class Canary {
 public:
  // probe: the prompt's token ids, the same on every rank (cut to data.max_prompt_tokens here).
  // world: the job's ranks (null: one process); tp: the ranks of each rollout replica
  // (placement.rollout_tp, replica r being ranks r*tp .. r*tp + tp - 1).
  Canary(const JobConfig& job, std::vector<int32_t> probe, Communicator* world, int tp);

  // Generates weight_sync.canary_tokens tokens of the probe with `engine` (the top token at each
  // step, no stop token, its logprob under rollout.temperature as every sample's), gathers every
  // rollout replica's probe on every rank, scores them all with trainer.logprobs under `policy`
  // (every rank the same call, so that a trainer split over tensor-parallel ranks, pipeline
  // stages or data-parallel replicas runs it as it runs its old logprobs) and gathers the ranks'
  // differences. Every rank calls it after the same publish (the engine's ranks make the same
  // engine calls, and the exchanges are collectives over world). step: the training step that
  // made `version` (0: the weights the job started or resumed with). workers (disaggregated, on
  // every rank): the same probe on each rollout worker that holds the weights pushed last, sent
  // by rank 0 and scored alike by every rank. Throws tandem::Error on every rank when a replica's
  // or a worker's difference is above the tolerance (or not a number), or a replica generated no
  // probe, naming the step, the version, each such replica with its ranks or worker, and the
  // difference.
  CanaryResult check(rollout::Engine& engine, PolicyTrainer& trainer, const model::Weights& policy,
                     int64_t step, uint64_t version, RemoteRollout* workers = nullptr);

 private:
  std::vector<double> differences(std::span<const rollout::SampleOutput> outs,
                                  PolicyTrainer& trainer, const model::Weights& policy) const;
  // The workers' answers to `request` on every rank, and their names.
  std::pair<std::vector<std::string>, std::vector<rollout::SampleOutput>> worker_probes(
      RemoteRollout& workers, const rollout::Request& request) const;

  const JobConfig& job_;
  std::vector<int32_t> probe_;
  Communicator* world_;
  const int tp_;
};

}  // namespace tandem::trainer
