// Engine internals shared by rollout/engine.cpp (requests in and out, weight swaps, memory
// phases), rollout/engine_schedule.cpp (the scheduler) and rollout/engine_step.cpp (a step's
// decoder calls, sampling and output): Engine::Impl, its sequences and what a step reuses.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/tp_sample.h"
#include "rollout/block_manager.h"
#include "rollout/engine.h"

namespace tandem::rollout {

namespace detail {

// FNV-1a, 64 bits: the tensor-parallel check's fingerprint of calls and steps.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(uint64_t x) { h = (h ^ x) * 1099511628211ull; }
  void add(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    add(static_cast<uint64_t>(bits));
  }
  void add(std::string_view text) {
    for (char c : text) add(static_cast<uint64_t>(static_cast<unsigned char>(c)));
    add(static_cast<uint64_t>(text.size()));
  }
  void add(const std::vector<int32_t>& v) {
    for (int32_t x : v) add(static_cast<uint64_t>(static_cast<uint32_t>(x)));
    add(static_cast<uint64_t>(v.size()));
  }
};

}  // namespace detail

struct Engine::Impl {
  struct Group;
  // One sequence: a sample, or before the fork the prompt of the whole group (sample 0).
  struct Sample {
    Group* group = nullptr;
    int index = 0;
    BlockManager::SeqId seq_id = 0;
    std::vector<int32_t> tokens;  // prompt + completion so far
    int64_t num_computed = 0;     // leading tokens whose K/V are in the cache
    bool group_prefill = false;   // the prompt of all n samples, not forked yet
    bool admitted_once = false;
    bool finished = false;
    uint64_t round = 0;  // the scheduling round that last put it in a batch
    int64_t remaining() const { return static_cast<int64_t>(tokens.size()) - num_computed; }
  };
  struct Group {
    uint64_t handle = 0;  // also the arrival order
    Request request;
    RequestOutput out;
    std::vector<std::unique_ptr<Sample>> samples;
    int unfinished = 0;
  };

  const model::Weights* weights;
  EngineOptions opt;
  Communicator* tp;  // the tensor-parallel group, or null
  int64_t V;         // the whole model's vocabulary (the weights hold V / tp rows of it)
  int64_t Vs;        // the logits' width: V, or the V / tp rows of this rank
  const model::Tokenizer* tokenizer;
  std::unique_ptr<model::Decoder> decoder;
  BlockManager bm;
  uint64_t version = 0;
  // An after_started swap waiting for the samples started on the current weights to finish.
  const model::Weights* pending_weights = nullptr;
  uint64_t pending_version = 0;
  uint64_t next_handle = 1;
  uint64_t round = 0;  // scheduling rounds so far
  BlockManager::SeqId next_seq = 1;
  EngineStats stats;
  std::unordered_map<uint64_t, std::unique_ptr<Group>> groups;  // in flight, by handle
  std::unordered_map<std::string, uint64_t> ids;                // in flight, id -> handle
  std::vector<Sample*> running;                                 // holds blocks; oldest first
  std::deque<Sample*> waiting;                                  // holds no blocks; oldest first
  std::vector<RequestOutput> finished;

  Impl(const model::Weights& w, const EngineOptions& o, const model::Tokenizer* t,
       Communicator* tp_group);

  // Requests in and out, memory, weight swaps (engine.cpp).
  void reserve_memory();
  void swap_weights(const model::Weights& w, uint64_t v);
  // Whether a sample has started and not finished (running, or preempted after it ran).
  bool any_started() const;
  // The pending swap, once no started sample is left.
  void swap_when_drained();
  std::unique_ptr<model::Decoder> make_decoder(const model::Weights& w) const;
  // Why the request cannot be served and the kind of refusal; kind none when it can.
  std::pair<Refusal, std::string> refusal_of(const Request& r) const;
  // Why the request itself cannot be served, or "" when it can.
  std::string validate(const Request& r) const;
  uint64_t submit(Request r);
  void finish_group(Group* g, RequestStatus status);
  bool abort(const std::string& id);

  // The scheduler (engine_schedule.cpp).
  static bool older(const Sample* a, const Sample* b);
  int64_t running_width() const;
  void remove_running(Sample* s);
  void insert_sorted(std::vector<Sample*>& v, Sample* s);
  void preempt(Sample* s);
  // Fills decodes.items and prefills.items for this round.
  void schedule();

  // A step: the decoder calls, sampling and output (engine_step.cpp).
  struct Item {
    Sample* s;
    int64_t begin, count;
  };

  // One decoder call of a step (the decodes, or the prefill chunks): its items and the inputs
  // built from them. Kept across steps: the vectors are reserved once for the largest call the
  // options allow (reserve()), so a step refills them without allocating.
  struct Call {
    std::vector<Item> items;
    std::vector<int32_t> tokens, positions, cu_seqlens;  // (T), (T), (B + 1)
    // The paged cache view of the call (kernels/ops.h's layout): kv_indptr (B + 1), kv_indices,
    // kv_last_len (B), slot_mapping (T); their device copies when not on the CPU.
    std::vector<int32_t> indptr, indices, last_len, slots;
    Tensor indptr_d, indices_d, last_len_d, slots_d;
    model::KvCacheView kv;
    Tensor logits;  // (rows, Vs): the first B rows are this step's

    void reserve(const EngineOptions& o, int64_t blocks_per_seq) {
      const auto T = static_cast<size_t>(o.max_batch_tokens), B = static_cast<size_t>(o.max_seqs);
      items.reserve(B);
      tokens.reserve(T);
      positions.reserve(T);
      cu_seqlens.reserve(B + 1);
      indptr.reserve(B + 1);
      indices.reserve(B * static_cast<size_t>(blocks_per_seq));
      last_len.reserve(B);
      slots.reserve(T);
    }
    void clear() {
      items.clear();
      tokens.clear();
      positions.clear();
      cu_seqlens.clear();
      indptr.clear();
      indices.clear();
      last_len.clear();
      slots.clear();
    }
  };

  // One row to sample: a sequence whose tokens are all computed (a group's prompt gives one row
  // per sample), its logits, and the sample that receives the token (a fork, for a group's
  // samples after the first).
  struct Row {
    Sample* s;
    int index;      // the sample's index in its request
    Tensor logits;  // (1, Vs), a row of a call's logits
    Sample* target = nullptr;
  };

  // The per-row settings of ops::sample on the host, with their device copies.
  struct SamplingRows {
    std::vector<float> temperature, top_p, min_p;
    std::vector<int32_t> top_k;
    std::vector<int64_t> seed, offset;
    Tensor staging[6];

    void reserve(size_t n) {
      temperature.reserve(n);
      top_p.reserve(n);
      min_p.reserve(n);
      top_k.reserve(n);
      seed.reserve(n);
      offset.reserve(n);
    }
    void clear() {
      temperature.clear();
      top_p.clear();
      min_p.clear();
      top_k.clear();
      seed.clear();
      offset.clear();
    }
    void push(const SamplingParams& p, uint64_t key, int64_t step) {
      temperature.push_back(p.temperature);
      top_k.push_back(p.top_k);
      top_p.push_back(p.top_p);
      min_p.push_back(p.min_p);
      seed.push_back(static_cast<int64_t>(key));
      offset.push_back(step);
    }
    ops::SamplingTensors on(Device d);
  };

  // What step() reuses from one step to the next (STYLE.md: no allocation on the decode path).
  Call decodes, prefills;
  std::vector<Row> rows;
  SamplingRows sampling;
  Tensor logits, token, logprob;    // (R, Vs), (R, 1), (R, 1): grown to the most rows seen
  std::vector<int32_t> host_token;  // (R) (not on the CPU)
  std::vector<float> host_logprob;  // (R) (not on the CPU)
  // Tensor parallelism: the sampler over the ranks' vocabulary rows, and the whole rows of the
  // requests that want top_logprobs (gathered; their index in full_rows, else -1).
  model::TpSampler tp_sampler;
  Tensor full_rows;               // (rows with top_logprobs, V) on the CPU
  std::vector<int64_t> full_row;  // (R)

  void reserve_scratch();
  // Fills call.kv from call.items: each item's blocks after this step's tokens.
  void build_view(Call& call);
  // The decoder's inputs of a call: one token per decode item, every chunk token of a prefill.
  void build_inputs(Call& call);
  // After a call: its tokens are computed; every sequence now complete gives its rows.
  void collect_rows(const Call& call, const Tensor& call_logits);
  // The sample that receives row's token: for a group's prompt, sample 0 itself and a new fork
  // for every other sample.
  Sample* fork_target(const Row& row);
  void step();
  // Tensor parallelism: this step's rows sampled over the ranks' (R, V/tp) logits
  // (model/tp_sample.h: a few floats per row between the ranks, not the rows), and the whole
  // rows of the requests that want top_logprobs gathered (R' V f32, those rows only). Every
  // rank gets the same tokens and logprobs. CPU sampling: other devices copy the shard over.
  void sample_shards(const Tensor& shard, Tensor tok, Tensor lp);
  // The k most likely tokens of one logits row (1, V), their logprobs computed by the trainer's
  // op (logprob_gather) under the sampling temperature (1 when greedy).
  std::vector<TokenLogprob> top_logprobs(const Tensor& row, int k, float temperature) const;
  void finish_sample(Sample* s, FinishReason reason);
  // Appends a sampled token and retires the sample when it is finished.
  void append_token(Sample* s, int32_t token, float logprob, std::vector<TokenLogprob> top);

  // The tensor-parallel check (engine_schedule.cpp).
  // Tensor parallelism: every rank of the group runs its own scheduler on the same requests, which
  // is deterministic, so the ranks form the same steps without exchanging them. This check makes a
  // divergence (a rank given other requests, or an abort on one rank only) an error naming the
  // ranks before the decoder's collectives would mismatch: a hash of the step's decoder inputs,
  // all-gathered (8 bytes per rank per step).
  // The fingerprint also covers every call made since (calls: submitted requests with their
  // settings, aborts, weight versions), so settings that differ (a seed) are caught at the next
  // step, not only once they changed a token.
  detail::Fnv calls;
  Tensor plan_hash, plan_hashes;  // (1), (tp) i64
  void add_call(const Request& r);
  void check_same_plan();
};

}  // namespace tandem::rollout
