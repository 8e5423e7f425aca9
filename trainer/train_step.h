// PolicyTrainer: one GRPO training step over scored samples — old and reference logprobs when
// they are needed, then mu epochs over minibatches, each split into micro-batches of packed
// sequences under a token budget, the policy loss's d loss / d logp pushed through the decoder's
// backward, and one AdamW step per minibatch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/comm.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "trainer/grpo.h"
#include "trainer/lr_schedule.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {

// One sampled completion of a prompt, with its advantage (trainer::compute_advantages) and the
// logprobs the rollout engine reported for its tokens.
struct TrainSample {
  std::vector<int32_t> prompt;
  std::vector<int32_t> completion;  // >= 1 token
  std::vector<float> rollout_logp;  // (completion), the engine's logprobs
  float advantage = 0;
  int64_t group = 0;  // the prompt's group: deterministic micro-batches never span two
};

struct TrainStepConfig {
  PolicyLossConfig loss;
  int epochs = 1;                     // mu: passes over the batch
  int minibatches = 1;                // optimizer steps per epoch (the batch split evenly)
  int64_t micro_batch_tokens = 4096;  // packed tokens per forward/backward at most
  float temperature = 1.0f;           // the rollout's sampling temperature
  // Recompute old logprobs with the policy before the first update even when they are not
  // needed (mu = 1 and one minibatch: the rollout's logprobs are then exact on the CPU).
  bool always_recompute_old = false;
  // Pack a group's prompt once for its completions (model::PackedBatch::from_prompts): the same
  // logprobs bitwise, gradients equal up to rounding, fewer tokens through the network. CPU only:
  // on CUDA each sample is packed whole.
  bool share_prompts = true;
  // The same update bitwise whatever the number of data-parallel ranks: micro-batches never span
  // two groups, each one's gradient is added in 2^-40 fixed point (exact, in any order), and the
  // optimizer sums the gradient norm in fixed blocks. Needs a ShardedAdamW (ShardOptions::
  // deterministic), on one rank too.
  bool deterministic = false;
  void validate() const;
};

struct TrainStepMetrics {
  double loss = 0;  // summed over minibatches (each minibatch's loss is normalised on its own)
  PolicyLossMetrics policy;
  int64_t optimizer_steps = 0, skipped_steps = 0;
  float grad_norm = 0;  // of the last optimizer step, before clipping
  float lr = 0;
  // Old logprobs recomputed by the trainer against the rollout's (|delta| over the tokens).
  bool old_recomputed = false;
  double rollout_vs_trainer_max_abs = 0, rollout_vs_trainer_mean_abs = 0;
  int64_t tokens = 0;         // completion tokens of the batch
  int64_t packed_tokens = 0;  // rows the update's forwards and backwards ran (all epochs)
  double seconds_old = 0, seconds_ref = 0, seconds_update = 0;
  // Communication of the sharded optimizer: seconds its collectives ran, and the part the step
  // waited for (the rest overlapped compute). The slowest rank's.
  double comm_s = 0, comm_exposed_s = 0;
};

// This rank's part of a batch trained by several data-parallel ranks: its i-th sample is entry
// positions[i] of the batch (ascending), and `lengths` holds the completion tokens of every sample
// of the batch (the same on every rank), so that minibatch boundaries and loss normalisers are
// the batch's, whichever rank holds a sample.
struct BatchShard {
  std::vector<size_t> positions;
  std::vector<int64_t> lengths;
};

// A trainer rank's place in a DP x TP x PP grid (trainer/parallel/grid.h) beyond its
// data-parallel group, which is the optimizer's: the tensor-parallel group its decoders split the
// heads, the MLP and the vocabulary over (model/tensor_parallel.h; the policy and the reference
// are then this rank's shards, and the optimizer's global norm sums over the group:
// ShardOptions::model_parallel), or the pipeline group whose stage `pp->rank()` it runs (the
// policy and the reference are then the stage's model::ModelPart; micro-batches go through the
// stages under 1F1B, trainer::run_pipeline; the loss and the metrics are the last stage's, sent
// to the others at the end of a step); both: the stage's part of the rank's TP shard. Null: whole
// layers, every layer.
struct ModelParallel {
  Communicator* tp = nullptr;
  Communicator* pp = nullptr;
  // The whole model's num_key_value_heads, which a shard of one KV head cannot tell
  // (DecoderOptions::tp_kv_heads); 0 when the shards hold several.
  int64_t tp_kv_heads = 0;
  // A test hook (JobHooks::before_stage_backward; null: none; it outlives the trainer): called on
  // a pipeline stage before each backward pass of a micro-batch, with the micro-batch's index.
  const std::function<void(int micro_batch)>* before_stage_backward = nullptr;
};

class PolicyTrainer {
 public:
  // optimizer: its compute_weights() are the policy the decoders run (the f32 master weights, or
  // at trainer.shard = "parameters" the units it gathers), and it takes every gradient; on several
  // ranks each trains its share of every batch (optimizer.comm()). reference: frozen weights for
  // the KL term (may be null when loss.kl_beta == 0). Both outlive the trainer.
  PolicyTrainer(Optimizer& optimizer, const model::Weights* reference, const LrSchedule& schedule,
                const TrainStepConfig& config, const ModelParallel& parallel = {});
  ~PolicyTrainer();

  // One training step (mu * minibatches optimizer steps) on these samples. On several ranks
  // `shard` is required and `samples` is this rank's part of the batch: the sharded optimizer sums
  // the gradients over the ranks (every rank takes the same step) and the returned metrics are
  // the batch's.
  TrainStepMetrics step(std::span<const TrainSample> samples, const BatchShard* shard = nullptr);
  // The logprobs of every completion token under `weights` (training forward), concatenated in
  // sample order, and optionally the entropies. With weights = policy() on several ranks of a
  // sharded optimizer, collective (each rank its samples).
  std::vector<float> logprobs(const model::Weights& weights, std::span<const TrainSample> samples,
                              std::vector<float>* entropy = nullptr);
  // Recompute the old logprobs at the next steps (TrainStepConfig::always_recompute_old), or take
  // the rollout's when the policy has not moved since it (one epoch, one minibatch).
  void set_always_recompute_old(bool on) { config_.always_recompute_old = on; }
  // Whether logprobs() returns this rank's values (not the zeros of a pipeline stage before the
  // last).
  bool computes_logprobs() const {
    return parallel_.pp == nullptr || parallel_.pp->rank() == parallel_.pp->size() - 1;
  }
  // Gives the decoders' activation arenas back between steps (the rollout of a colocated job
  // wants the memory); the next step takes them again.
  void release_activations();
  // The policy the decoders compute with (the optimizer's compute_weights()).
  const model::Weights& policy() const { return policy_; }
  // Optimizer steps taken (the LR schedule's position); set it when resuming from a checkpoint.
  int64_t steps_done() const { return optimizer_steps_; }
  void set_steps_done(int64_t steps) { optimizer_steps_ = steps; }

 private:
  // d loss / d theta of one minibatch accumulated into grads_; returns the loss.
  double accumulate(std::span<const TrainSample> samples, std::span<const float> old_logp,
                    std::span<const float> ref_logp, const LossNormalisers& norm,
                    TrainStepMetrics& metrics);

  // accumulate under pipeline parallelism: the micro-batches through the stages under 1F1B.
  double accumulate_pipelined(std::span<const TrainSample> samples, std::span<const float> old_logp,
                              std::span<const float> ref_logp, const LossNormalisers& norm,
                              TrainStepMetrics& metrics);
  // logprobs under pipeline parallelism: each micro-batch through the stages in turn; the last
  // stage returns the values, the others zeros of the same length.
  std::vector<float> pipeline_logprobs(model::Decoder& dec, std::span<const TrainSample> samples,
                                       std::vector<float>* entropy);

  // The passes every rank runs: the most any rank has when the optimizer needs the ranks in step
  // (collective then; a rank runs idle passes after its own), else this rank's `mine`.
  size_t agree_passes(size_t mine, model::UnitPass pass);

  Optimizer& optimizer_;
  const model::Weights& policy_;
  const model::Weights* reference_;
  const LrSchedule& schedule_;
  TrainStepConfig config_;
  ModelParallel parallel_;
  std::unique_ptr<model::Decoder> decoder_;
  std::unique_ptr<model::Decoder> ref_decoder_;  // planned once when there is a reference
  int64_t optimizer_steps_ = 0;
  Communicator* comm_ = nullptr;
  bool share_;  // config_.share_prompts where the device supports it
};

}  // namespace tandem::trainer
