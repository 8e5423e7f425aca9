// The running job that run_job drives, shared by its files: construction and the collect, update,
// publish, eval and checkpoint phases in trainer/job.cpp, what data-parallel ranks exchange in
// trainer/job_parallel.cpp, the record phase in trainer/job_record.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "core/comm.h"
#include "trainer/append_file.h"
#include "trainer/checkpoint.h"
#include "trainer/job.h"
#include "trainer/job_step.h"
#include "trainer/lr_schedule.h"
#include "trainer/optimizer.h"
#include "trainer/tensorboard.h"

namespace tandem::trainer::job_detail {

// A running job: the model, data, rewards, rollout engine, trainer and outputs of one process,
// and the phases of a step.
class Job {
 public:
  // comm: the data-parallel ranks (null: this process alone); m: job.model.path, loaded.
  Job(const JobConfig& job, const std::atomic<bool>& stop, const JobHooks& hooks,
      Communicator* comm, model::LoadedModel m);
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
  // The loaded whole f32 weights the optimizer updates; null at trainer.shard = "parameters",
  // where the optimizer keeps this rank's pieces only.
  model::Weights* policy_;
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
  // Chosen once (make_optimizer): AdamW on one rank, else ShardedAdamW at trainer.shard's level.
  std::unique_ptr<Optimizer> optimizer_;
  ShardedAdamW* sharded_ = nullptr;  // optimizer_ when it is the sharded one
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

}  // namespace tandem::trainer::job_detail
