// Engine: the rollout engine — requests of n samples each, continuous batching under a token
// budget over a paged KV cache with shared prompts and a prefix cache, chunked prefill,
// preemption by recomputation, per-sample Philox streams, stop ids and stop strings, abort,
// and weight swaps between steps (see docs/rollout.md).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/decoder.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "rollout/block_manager.h"

namespace tandem::rollout {

struct SamplingParams {
  int n = 1;                            // G: samples of the prompt, prefilled once and forked
  float temperature = 1.0f;             // 0: greedy
  float top_p = 1.0f;                   // in (0, 1]
  float min_p = 0.0f;                   // in [0, 1]
  int top_k = 0;                        // 0: off
  int max_tokens = 128;                 // completion tokens per sample, >= 1
  std::vector<int32_t> stop_token_ids;  // the sample ends after one of these (it is kept)
  std::vector<std::string> stop;        // stop strings (need a tokenizer; see docs/rollout.md)
  uint64_t seed = 0;     // sample i draws from Philox key seed + i (see sample_seed())
  bool logprobs = true;  // report each sampled token's logprob
  int top_logprobs = 0;  // the k most likely tokens at each step, k in [0, kMaxTopLogprobs]
};

constexpr int kMaxTopLogprobs = 20;

struct Request {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams params;
};

enum class FinishReason { stop, length, abort };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort"

// done: every sample finished (stop or length); aborted: abort() ended it (finished samples
// keep their reason, the others have abort); error: refused at submit().
enum class RequestStatus { done, aborted, error };
const char* request_status_name(RequestStatus s);  // "done", "aborted", "error"

// Why submit() refused a request (status error): the request itself is bad and will never be
// served as it is (invalid), the engine's queue is full and a later try may succeed (queue_full),
// or another request with the same id is in flight (duplicate_id).
enum class Refusal { none, invalid, queue_full, duplicate_id };
const char* refusal_name(Refusal r);  // "none", "invalid", "queue_full", "duplicate_id"

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;  // the same definition as the sampled token's (see docs/rollout.md)
};

struct SampleOutput {
  int index = 0;                // i in [0, n)
  std::vector<int32_t> tokens;  // completion token ids
  std::string text;             // completion text (with a tokenizer; stop string cut off)
  std::vector<float> logprobs;  // per token (empty when params.logprobs is false)
  // Per token, the params.top_logprobs most likely tokens, most likely first (ties to the
  // lower id); empty when params.top_logprobs is 0.
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  FinishReason finish_reason = FinishReason::length;
  std::string stop_string;            // the stop string that ended it, if one did
  uint64_t weight_version = 0;        // weights that produced the last token
  uint64_t first_weight_version = 0;  // weights that produced the first token
  // Per token, the weights that produced it (its logprob is under those weights): a sample
  // running across set_weights continues on the new version (a partial rollout), so its tokens
  // carry two or more versions, in order.
  std::vector<uint64_t> token_versions;
};

struct RequestOutput {
  uint64_t handle = 0;  // what submit() returned
  std::string id;
  std::vector<int32_t> prompt;
  std::vector<SampleOutput> samples;  // n of them (none when the request was refused)
  RequestStatus status = RequestStatus::done;
  std::string error;  // why the request was refused (status error); samples is then empty
  Refusal refusal = Refusal::none;       // the kind of refusal (status error)
  int64_t num_cached_prompt_tokens = 0;  // prompt tokens found in the prefix cache
};

struct EngineOptions {
  int64_t block_size = 16;          // P: tokens per KV block
  int64_t num_blocks = 1024;        // KV blocks in the arena (per layer a K and a V tensor, f32)
  int64_t max_batch_tokens = 2048;  // tokens computed per step (prefill chunks + decodes)
  int64_t max_seqs = 256;           // sequences per step; also the cap on n and on running samples
  int64_t max_context = 4096;       // prompt + max_tokens, at most the model's positions
  int64_t max_waiting = 65536;      // requests queued; more are refused with an error
  // Full blocks of computed tokens are kept findable for later prompts that start with the same
  // tokens; false: every prompt is computed in full (benchmarks of prefill).
  bool prefix_cache = true;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;  // tokens computed in prefill chunks (including recomputation)
  int64_t decode_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // prompt tokens served from the prefix cache
  int64_t preemptions = 0;
  int64_t forks = 0;
  // Tensor parallelism: bytes the sampling's collectives delivered to this rank (model/
  // tp_sample.h; the whole rows gathered for top_logprobs included).
  int64_t sampling_bytes = 0;
};

// The Philox key of sample i of a request with params.seed = seed: seed + i (mod 2^64).
uint64_t sample_seed(uint64_t seed, int i);

class Engine {
 public:
  // Keeps references to weights and tokenizer (both must outlive the engine, or until
  // set_weights). Without a tokenizer, samples have no text and stop strings are refused.
  //
  // Tensor parallelism: with tp_group (kept; it must outlive the engine), the weights are rank
  // tp_group->rank()'s shard of tp_group->size() (model::cut_tp_shard, or a weight sync into
  // tp_shard_config's layout), and the group's ranks together are one engine: each rank makes
  // the same calls (submit, step, abort, set_weights, release_memory) in the same order with
  // the same arguments, its deterministic scheduler forms the same steps (checked every step),
  // and every rank returns the same outputs. See docs/rollout.md, "Tensor parallelism".
  Engine(const model::Weights& weights, const EngineOptions& options = {},
         const model::Tokenizer* tokenizer = nullptr, Communicator* tp_group = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request and returns its handle. A bad request (empty prompt, token out of the
  // vocabulary, prompt + max_tokens beyond the context, n outside [1, max_seqs], top_p outside
  // (0, 1], temperature < 0, ...) or a full queue or an id already in flight is not queued: its
  // RequestOutput, status error with the reason (error) and its kind (refusal), is ready at the
  // next poll().
  uint64_t submit(Request request);
  // One scheduler iteration: forms a batch, runs the decoder once for its decodes and once for
  // its prefill chunks, samples, and retires finished samples. Does nothing without work.
  void step();
  // Requests finished since the last poll, in the order they finished.
  std::vector<RequestOutput> poll();
  // Ends request `id` (queued or running): every block it holds is freed and its unfinished
  // samples finish with reason abort; its output comes through poll(). False if unknown.
  bool abort(const std::string& id);
  // Whether any request is queued or running (poll() may still hold results when false).
  bool has_work() const;
  // Sequences waiting for blocks (new groups, and preempted samples), and sequences holding them.
  int64_t num_waiting() const;
  int64_t num_running() const;
  // Submits every request, steps until all are done and returns their outputs in the order of
  // `requests` (refused ones included, with finish_reason error).
  std::vector<RequestOutput> generate(std::vector<Request> requests);

  // Swaps the weights between steps: the prefix cache is flushed and the weight version becomes
  // `version`. The config must match the current weights' shapes. The decoder is kept and
  // refreshed in place (its packed weight copies repacked into the same memory): nothing is
  // allocated when nothing is running. What happens to samples already started (running, or
  // preempted after they ran) is `swap`'s:
  //   partial: they are preempted (recomputed under the new weights, keeping the tokens they
  //     have) and go on under the new version, their later tokens tagged with it (a partial
  //     rollout); the swap happens now.
  //   after_started: they finish on the current weights; no sample that has not started is
  //     admitted until they have, and the swap happens then, at the start or the end of a step
  //     (now when none has started). The current weights must stay valid until
  //     weight_version() is `version`; a later set_weights replaces a swap still pending.
  enum class Swap { partial, after_started };
  void set_weights(const model::Weights& weights, uint64_t version, Swap swap = Swap::partial);
  uint64_t weight_version() const;
  // Whether an after_started swap waits for started samples.
  bool swap_pending() const;
  // The version of the last set_weights: weight_version(), or the pending swap's.
  uint64_t committed_version() const;

  // Memory phases of a colocated job: release_memory() gives the KV arena and the decoder's
  // activation arena back to the device while the trainer runs (nothing may be in flight; the
  // prefix cache is forgotten). The next step() with work, or reserve_memory(), takes them
  // again: the cache zeroed, its blocks handed out as by a new engine.
  void release_memory();
  void reserve_memory();
  bool memory_reserved() const;

  const EngineOptions& options() const;
  const EngineStats& stats() const;
  const BlockManager& blocks() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::rollout
