// The tandem job's config: the schema of a GRPO job's TOML file (model, data, rollout, trainer,
// rewards, checkpoint, logging, eval, placement, distributed, weight_sync), its typed form
// JobConfig, loading with dotted overrides and the cross-field checks, and printing the resolved
// job back as TOML.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/comm.h"
#include "core/config.h"
#include "core/memory_ledger.h"
#include "kernels/ops.h"
#include "trainer/grpo.h"
#include "trainer/lr_schedule.h"
#include "trainer/optimizer.h"
#include "trainer/train_step.h"

namespace tandem::trainer {

struct ModelSection {
  std::string path;                    // a GGUF file or an HF model directory (required)
  std::string chat_template = "auto";  // "auto" (the model's), "none", or a template file path
};

struct DataSection {
  std::string source = "synthetic";  // "synthetic" or "jsonl"
  std::string task = "arithmetic";   // synthetic: "arithmetic" or "format"
  int64_t difficulty = 1;            // synthetic arithmetic: 1 (one-digit) .. 5
  int64_t synthetic_size = 4096;     // synthetic: prompts generated
  std::string path;                  // jsonl: the dataset file
  std::string eval_path;             // jsonl: a separate held-out file (split_fraction unused)
  std::string prompt_field = "prompt";
  std::string messages_field;  // jsonl: chat messages field (instead of prompt_field)
  std::string answer_field = "answer";
  bool require_answer = true;             // jsonl: a line without the answer is an error
  std::string id_field = "id";            // jsonl: optional example id
  std::vector<std::string> extra_fields;  // passed to the rewards
  std::string system_prompt;
  int64_t max_prompt_tokens = 512;
  int64_t seed = 0;     // shuffling and the eval split
  bool shuffle = true;  // a new order every epoch (false: file order)
};

struct RolloutSection {
  int64_t prompts_per_step = 8;  // B
  int64_t n = 8;                 // G: samples per prompt
  int64_t max_new_tokens = 48;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  double min_p = 0.0;
  int64_t seed = 0;
  int64_t block_size = 16;
  int64_t num_blocks = 1024;
  int64_t max_batch_tokens = 2048;
  int64_t max_seqs = 256;
  // The engine's weights: "f32" reads the trainer's master weights in place; "bf16" keeps a copy
  // that every publish casts from them (the trainer then recomputes the old logprobs).
  std::string dtype = "f32";
  // k: how many weight versions a sample may lag the weights it is trained on (counted from the
  // version its first token was sampled from); 0: each step's batch is generated after the
  // previous update (the sequential job). Above 0 (a disaggregated job) the next steps' batches
  // are generated while the trainer updates (trainer/rollout_queue.h).
  int64_t max_staleness = 0;
  // Samples generating when new weights arrive go on under them from the engine's next step, each
  // token tagged with its version (a partial rollout; true), or finish under the old weights
  // while samples not started wait (false).
  bool partial = true;
};

struct ShapingSection {
  bool dynamic_sampling = false;  // drop groups whose rewards are all equal, draw more prompts
  int64_t max_refill_rounds = 3;  // dynamic sampling: rounds of more prompts per step at most
  bool mask_truncated = false;    // leave samples cut by max_new_tokens out of the loss
  int64_t overlong_buffer = 0;    // DAPO soft overlong penalty; 0 with factor 0: off
  double overlong_factor = 0.0;
  int64_t downsample = 0;  // PODS: the samples of each group trained on (max variance); 0: all
};

struct TrainerSection {
  int64_t steps = 100;  // GRPO steps of the run
  GrpoConfig grpo;
  TrainStepConfig step;  // its .loss is grpo.loss; temperature comes from the rollout
  ShapingSection shaping;
  AdamWConfig optimizer;
  ShardOptions shard;  // .deterministic is step.deterministic, .bucket_bytes comm_bucket_mb's
  int64_t comm_bucket_mb = 32;
  // The trainer's ranks as a data x tensor x pipeline parallel grid (trainer/parallel/grid.h,
  // docs/distributed.md "Tensor and pipeline parallelism"): tp ranks split each layer, pp stages
  // split the layers, the rest of the world is data parallel.
  int64_t tp = 1;
  int64_t pp = 1;
  bool optimizer_offload = false;  // moments to host during rollout (CUDA); cpu: already there
  LrScheduleConfig schedule;       // total_steps = steps * epochs * minibatches when 0
  std::string dtype = "f32";       // master weights
};

struct RewardSpec {
  std::string name;
  std::string kind = "builtin";  // builtin | plugin | remote
  double weight = 1.0;
  double fallback = 0.0;  // the score of a sample whose reward failed (threw, NaN, timed out)
  int64_t max_consecutive_failures = 8;
  std::string function;       // builtin: math_match | exact_match | regex_format | length_penalty
  std::string pattern;        // builtin regex_format: the PCRE2 pattern
  int64_t target_length = 0;  // builtin length_penalty: tokens without penalty
  std::string path;           // plugin: the shared library
  std::string config;         // plugin: the string given to init
  bool isolate = true;        // plugin: run it in a child process (a crash fails one batch)
  std::string address;        // remote: host:port
  int64_t timeout_ms = 10000;
  int64_t retries = 2;
  int64_t max_concurrency = 4;
  int64_t batch_size = 64;  // remote: samples per request at most
  std::string token_env;    // remote: the environment variable holding the shared token
};

struct CheckpointSection {
  std::string dir = "runs/default/checkpoints";
  int64_t every = 50;  // steps; 0: only at the end and on Ctrl-C
  int64_t keep_last = 2;
  std::string resume = "auto";  // "auto" (latest in dir if any), "none", or a checkpoint path
  // Resume although the checkpoint was written under another config (trainer/job_start.h says
  // which keys count).
  bool allow_config_change = false;
};

struct LoggingSection {
  std::string dir = "runs/default";  // metrics.jsonl, report.html, samples
  int64_t every = 1;
  int64_t samples_every = 10;  // 0: never
  std::string level = "info";
  bool tensorboard = true;  // TensorBoard event file in dir
};

struct EvalSection {
  int64_t every = 10;  // steps; 0: off
  double split_fraction = 0.1;
  int64_t max_prompts = 64;
  int64_t pass_k = 4;  // pass@k: k samples per prompt
  double temperature = 1.0;
};

struct PlacementSection {
  std::string mode = "colocated";
  std::string device = "cpu";  // "cpu" or "cuda"
  // Each phase frees the other's memory: the engine's KV cache and activations during the
  // update, the trainer's activations during rollout and eval.
  bool release_memory = true;
  // The CPU matmuls, rollout and training alike (kernels/ops.h): their arithmetic (f32, or bf16
  // operands with f32 sums), inner kernel and f32 backward products.
  ops::MatmulPrecision cpu_matmul = ops::MatmulPrecision::f32;
  ops::MatmulKernel cpu_matmul_kernel = ops::MatmulKernel::automatic;
  ops::MatmulBackward cpu_matmul_backward = ops::MatmulBackward::outer;
  // Data-parallel ranks, each a trainer with its own rollout engine (colocated); 0: as many as
  // the launcher started (tandem launch --nproc, mpirun, srun, torchrun; 1 without one).
  int64_t ranks = 0;
  // Ranks of one rollout engine (tensor parallel; colocated: world / rollout_tp replicas of
  // consecutive ranks). It divides the ranks and the model's heads, MLP width and vocabulary.
  int64_t rollout_tp = 1;
  // A cap on the arena memory of each rank, GiB (0: none): rank_memory_limit() below.
  double rank_memory_limit_gb = 0;
  // Disaggregated (docs/serve.md "A disaggregated job"): the rollout workers (`tandem serve`)
  // that generate every step's samples, and how the job calls them.
  std::vector<std::string> workers;  // host:port of each
  // How the weights reach them after each step: "wire" (pushed in buckets over the rollout
  // service) or "directory" (an HF directory in logging.dir that the workers read).
  std::string weights = "wire";
  std::string token_env;                // the environment variable holding their token ("": none)
  int64_t request_timeout_ms = 300000;  // a group's deadline on one worker
  int64_t attempts = 4;                 // workers a group is tried on before the step fails
  int64_t max_in_flight_per_worker = 8;
  double connect_timeout_s = 30;  // start-up: how long to wait for every worker to answer
  // A worker that misses a health check's deadline (or a call's) is set aside until it answers
  // one again and has taken the latest weights.
  double health_check_interval_s = 5;
  double health_check_timeout_s = 10;
};

// The publish of the trainer's weights into the rollout engines' after each step
// (docs/weight-sync.md): weight_sync::SyncOptions and the logprob canary (trainer/canary.h).
struct WeightSyncSection {
  int64_t bucket_mb = 64;  // MiB a rank sends, and receives, in one round at most
  bool staged = true;      // write the engines' weights only once every byte has arrived
  bool checksums = false;  // compare a checksum of every piece stream between ranks
  bool canary = false;     // score a fixed probe by every engine and by the trainer after each sync
  int64_t canary_tokens = 16;  // greedy tokens of the probe
  // The largest |engine - trainer| logprob of a probe token that passes; 0: by rollout.dtype
  // (kCanaryToleranceF32 or kCanaryToleranceBf16, set when the config is loaded).
  double canary_tolerance = 0.0;
};

// The canary's tolerances by the engine weights' dtype (docs/weight-sync.md, "The logprob
// canary"): f32 engine weights give the trainer's logprobs bitwise on one rank and within about
// 1e-6 when a tensor-parallel engine sums its shards in another order; bf16 weights lose the
// updates below their rounding step, and moved a greedy token's logprob by up to 0.78 in the
// first steps of configs/default.toml.
constexpr double kCanaryToleranceF32 = 1e-3;
constexpr double kCanaryToleranceBf16 = 2.0;

// Multi-rank jobs (docs/distributed.md): the Communicator's store, coordinator, timeout and
// emulated link.
struct DistributedSection {
  double timeout_s = 300;         // bound of the rendezvous, the store and every collective
  std::string store = "tcp";      // "tcp" (rank 0 serves it) or "file:/shared/dir"
  std::string master;             // "HOST:PORT" of the coordinator over the launcher's variables
  double emulated_link_gbps = 0;  // EmulatedLink::gbps; 0: the real transport only
  double emulated_link_latency_us = 0;  // EmulatedLink::latency_us
};

// The options of the job's world Communicator (on the CPU).
CommOptions comm_options(const DistributedSection& d);

struct JobConfig {
  ModelSection model;
  DataSection data;
  RolloutSection rollout;
  TrainerSection trainer;
  std::vector<RewardSpec> rewards;
  CheckpointSection checkpoint;
  LoggingSection logging;
  EvalSection eval;
  PlacementSection placement;
  DistributedSection distributed;
  WeightSyncSection weight_sync;
  std::string source;  // the file it came from
  // Where each key's value came from ("job.toml:4:8", "override 'model.path=x'", or
  // "job.toml (default)"), for errors found later: "model.path 'x' does not exist (job.toml:4:8)".
  std::map<std::string, std::string, std::less<>> origins;
  std::string where(std::string_view key) const;
};

// The schema of a job file: every key, its type, default (from JobConfig's defaults), range and
// documentation.
std::shared_ptr<const config::Schema> job_schema();

// Reads a job file, applies "key.sub=value" overrides, validates every key and then the
// cross-field rules (batch sizes that divide, rewards' kind-specific keys, trainer.grpo's and the
// optimizer's own validate()). Throws one tandem::Error naming file:line:column or the override.
JobConfig load_job_config(const std::string& path, std::span<const std::string> overrides = {});
// The same from TOML text named `source`.
JobConfig parse_job_config(std::string_view text, const std::string& source,
                           std::span<const std::string> overrides = {});

// The resolved job as TOML (every key, defaults included); parse_job_config of it gives it back.
std::string to_toml(const JobConfig& job);
// docs/config.md's reference section, generated from the schema.
std::string job_config_markdown();
// placement.rank_memory_limit_gb as the cap of core/memory_ledger.h, naming the key and where it
// was set.
memory_ledger::Limit rank_memory_limit(const JobConfig& job);

}  // namespace tandem::trainer
