// Engine: the scheduler (continuous batching, chunked prefill, group forks, preemption), the
// decoder calls of one step, sampling with per-sample Philox streams, and stop handling.
#include "rollout/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/tp_sample.h"

namespace tandem::rollout {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop:
      return "stop";
    case FinishReason::length:
      return "length";
    case FinishReason::abort:
      return "abort";
  }
  return "?";
}

const char* request_status_name(RequestStatus s) {
  switch (s) {
    case RequestStatus::done:
      return "done";
    case RequestStatus::aborted:
      return "aborted";
    case RequestStatus::error:
      return "error";
  }
  return "?";
}

const char* refusal_name(Refusal r) {
  switch (r) {
    case Refusal::none:
      return "none";
    case Refusal::invalid:
      return "invalid";
    case Refusal::queue_full:
      return "queue_full";
    case Refusal::duplicate_id:
      return "duplicate_id";
  }
  return "?";
}

uint64_t sample_seed(uint64_t seed, int i) { return seed + static_cast<uint64_t>(i); }

namespace {

template <class T>
Tensor device_tensor(const std::vector<T>& v, DType dtype, Device device) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, dtype);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(T));
  return device.is_cpu() ? t : t.to(device);
}

// A host array as a tensor on `device` without allocating in the steady state: the host memory
// itself on the CPU; elsewhere a copy in `staging`, sized to the array's capacity (reserved once
// for the largest batch the options allow) and grown only when the array outgrew it.
template <class T>
Tensor staged(const std::vector<T>& host, DType dtype, Device device, Tensor& staging) {
  const int64_t n = static_cast<int64_t>(host.size());
  const Tensor src = Tensor::wrap(const_cast<T*>(host.data()), {n}, dtype);
  if (device.is_cpu()) return src;
  if (!staging.defined() || staging.numel() < n)
    staging =
        Tensor::empty({static_cast<int64_t>(std::max<size_t>(host.capacity(), 1))}, dtype, device);
  Tensor t = staging.narrow(0, n);
  if (n > 0) t.copy_from(src);
  return t;
}

// The first `rows` rows of a (rows, cols) scratch tensor that grows only when a step has more
// rows than any before.
Tensor grown_rows(Tensor& buf, int64_t rows, int64_t cols, DType dtype, Device device) {
  if (!buf.defined() || buf.size(0) < rows) buf = Tensor::empty({rows, cols}, dtype, device);
  return buf.narrow(0, rows);
}

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

bool same_shapes(const model::ModelConfig& a, const model::ModelConfig& b) {
  return a.arch == b.arch && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_layers == b.num_layers &&
         a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim;
}

}  // namespace

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
       Communicator* tp_group)
      : weights(&w),
        opt(o),
        tp(tp_group),
        V(w.config().vocab_size * (tp_group ? tp_group->size() : 1)),
        Vs(w.config().vocab_size),
        tokenizer(t),
        bm(w.config(), o.block_size, o.num_blocks, w.device()) {
    const int64_t positions = w.config().max_position_embeddings;
    TANDEM_CHECK(o.max_batch_tokens > 0 && o.max_seqs > 0 && o.max_waiting > 0,
                 "engine: max_batch_tokens, max_seqs and max_waiting must be positive, got {}, "
                 "{} and {}",
                 o.max_batch_tokens, o.max_seqs, o.max_waiting);
    TANDEM_CHECK(o.max_context > 0 && (positions <= 0 || o.max_context <= positions),
                 "engine: max_context must be in [1, {}] (the model's positions), got {}",
                 positions, o.max_context);
    decoder = make_decoder(w);
    reserve_scratch();
  }

  void reserve_memory() {
    bm.reserve_memory();
    if (!decoder) decoder = make_decoder(*weights);
  }

  std::unique_ptr<model::Decoder> make_decoder(const model::Weights& w) const {
    // The weights stay as they are until the next set_weights, which refreshes the decoder.
    return std::make_unique<model::Decoder>(
        w, model::DecoderOptions{
               .max_tokens = opt.max_batch_tokens, .pack_weights = true, .tp_group = tp});
  }

  static bool older(const Sample* a, const Sample* b) {
    if (a->group->handle != b->group->handle) return a->group->handle < b->group->handle;
    return a->index < b->index;
  }

  int64_t running_width() const {
    int64_t w = 0;
    for (const Sample* s : running) w += s->group_prefill ? s->group->request.params.n : 1;
    return w;
  }

  // Why the request cannot be served and the kind of refusal; kind none when it can.
  std::pair<Refusal, std::string> refusal_of(const Request& r) const {
    if (ids.count(r.id))
      return {Refusal::duplicate_id, fmt::format("the id '{}' is already in flight", r.id)};
    if (static_cast<int64_t>(waiting.size()) >= opt.max_waiting)
      return {Refusal::queue_full,
              fmt::format("the queue is full ({} waiting; max_waiting)", opt.max_waiting)};
    std::string why = validate(r);
    return {why.empty() ? Refusal::none : Refusal::invalid, std::move(why)};
  }

  // Why the request itself cannot be served, or "" when it can.
  std::string validate(const Request& r) const {
    const SamplingParams& p = r.params;
    const int64_t n = static_cast<int64_t>(r.prompt.size());
    if (r.prompt.empty()) return "the prompt is empty";
    for (size_t i = 0; i < r.prompt.size(); ++i)
      if (r.prompt[i] < 0 || r.prompt[i] >= V)
        return fmt::format("prompt token {} is {}, outside the vocabulary [0, {})", i, r.prompt[i],
                           V);
    if (p.n < 1 || p.n > opt.max_seqs)
      return fmt::format("n must be in [1, {}] (max_seqs), got {}", opt.max_seqs, p.n);
    if (p.max_tokens < 1) return fmt::format("max_tokens must be at least 1, got {}", p.max_tokens);
    if (n + p.max_tokens > opt.max_context)
      return fmt::format("prompt ({} tokens) + max_tokens ({}) exceed the context of {}", n,
                         p.max_tokens, opt.max_context);
    if (bm.blocks_for(n + p.max_tokens) > bm.num_blocks())
      return fmt::format("prompt + max_tokens ({} tokens) need {} KV blocks, the cache has {}",
                         n + p.max_tokens, bm.blocks_for(n + p.max_tokens), bm.num_blocks());
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
      return fmt::format("temperature must be finite and >= 0, got {}", p.temperature);
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
      return fmt::format("top_p must be in (0, 1], got {}", p.top_p);
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
      return fmt::format("min_p must be in [0, 1], got {}", p.min_p);
    if (p.top_k < 0) return fmt::format("top_k must be >= 0, got {}", p.top_k);
    for (size_t i = 0; i < p.stop_token_ids.size(); ++i)
      if (p.stop_token_ids[i] < 0 || p.stop_token_ids[i] >= V)
        return fmt::format("stop_token_ids[{}] is {}, outside the vocabulary [0, {})", i,
                           p.stop_token_ids[i], V);
    for (size_t i = 0; i < p.stop.size(); ++i)
      if (p.stop[i].empty()) return fmt::format("stop[{}] is an empty string", i);
    if (!p.stop.empty() && !tokenizer)
      return "stop strings need a tokenizer (the engine was made without one)";
    if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs || p.top_logprobs > V)
      return fmt::format("top_logprobs must be in [0, {}], got {}",
                         std::min<int64_t>(kMaxTopLogprobs, V), p.top_logprobs);
    return "";
  }

  uint64_t submit(Request r) {
    if (tp != nullptr) add_call(r);
    const uint64_t handle = next_handle++;
    auto [refusal, why] = refusal_of(r);
    if (refusal != Refusal::none) {
      RequestOutput out;
      out.handle = handle;
      out.status = RequestStatus::error;
      out.refusal = refusal;
      out.error = fmt::format("request '{}': {}", r.id, why);
      out.id = std::move(r.id);
      out.prompt = std::move(r.prompt);
      finished.push_back(std::move(out));
      return handle;
    }
    auto g = std::make_unique<Group>();
    g->handle = handle;
    g->out.handle = handle;
    g->out.id = r.id;
    g->out.prompt = r.prompt;
    g->out.samples.resize(static_cast<size_t>(r.params.n));
    for (int i = 0; i < r.params.n; ++i) g->out.samples[static_cast<size_t>(i)].index = i;
    g->unfinished = r.params.n;
    g->request = std::move(r);
    // Every token vector holds its longest length from the start: appending allocates nothing.
    const int max_tokens = g->request.params.max_tokens;
    for (SampleOutput& out : g->out.samples) {
      out.tokens.reserve(static_cast<size_t>(max_tokens));
      if (g->request.params.logprobs) out.logprobs.reserve(static_cast<size_t>(max_tokens));
    }
    auto s = std::make_unique<Sample>();
    s->group = g.get();
    s->seq_id = next_seq++;
    s->tokens.reserve(g->request.prompt.size() + static_cast<size_t>(max_tokens));
    s->tokens = g->request.prompt;
    s->group_prefill = true;
    waiting.push_back(s.get());
    g->samples.push_back(std::move(s));
    ids.emplace(g->request.id, handle);
    groups.emplace(handle, std::move(g));
    return handle;
  }

  void remove_running(Sample* s) { running.erase(std::find(running.begin(), running.end(), s)); }

  void insert_sorted(std::vector<Sample*>& v, Sample* s) {
    v.insert(std::upper_bound(v.begin(), v.end(), s, older), s);
  }

  void preempt(Sample* s) {
    bm.free(s->seq_id);
    s->num_computed = 0;
    remove_running(s);
    waiting.insert(std::upper_bound(waiting.begin(), waiting.end(), s, older), s);
    ++stats.preemptions;
  }

  void finish_group(Group* g, RequestStatus status) {
    g->out.status = status;
    finished.push_back(std::move(g->out));
    ids.erase(g->request.id);
    groups.erase(g->handle);
  }

  void finish_sample(Sample* s, FinishReason reason) {
    s->finished = true;
    s->group->out.samples[static_cast<size_t>(s->index)].finish_reason = reason;
    bm.free(s->seq_id);
    remove_running(s);
    Group* g = s->group;
    if (--g->unfinished == 0) finish_group(g, RequestStatus::done);
  }

  // Appends a sampled token and retires the sample when it is finished.
  void append_token(Sample* s, int32_t token, float logprob, std::vector<TokenLogprob> top) {
    const SamplingParams& p = s->group->request.params;
    SampleOutput& out = s->group->out.samples[static_cast<size_t>(s->index)];
    if (out.tokens.empty()) out.first_weight_version = version;
    out.weight_version = version;
    s->tokens.push_back(token);
    out.tokens.push_back(token);
    if (p.logprobs) out.logprobs.push_back(logprob);
    if (p.top_logprobs > 0) out.top_logprobs.push_back(std::move(top));
    if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
        p.stop_token_ids.end())
      return finish_sample(s, FinishReason::stop);
    if (tokenizer) {
      const size_t before = out.text.size();
      if (token < tokenizer->vocab_size()) out.text += tokenizer->token_to_piece(token);
      // The earliest stop string that ends in the new bytes (it may start in earlier tokens).
      size_t best = std::string::npos;
      const std::string* best_stop = nullptr;
      for (const std::string& stop : p.stop) {
        const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
        const size_t at = out.text.find(stop, from);
        if (at != std::string::npos && at < best) best = at, best_stop = &stop;
      }
      if (best_stop) {
        out.text.resize(best);
        out.stop_string = *best_stop;
        return finish_sample(s, FinishReason::stop);
      }
    }
    if (static_cast<int64_t>(out.tokens.size()) >= p.max_tokens)
      return finish_sample(s, FinishReason::length);
  }

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
    ops::SamplingTensors on(Device d) {
      return {staged(temperature, DType::f32, d, staging[0]),
              staged(top_k, DType::i32, d, staging[1]),
              staged(top_p, DType::f32, d, staging[2]),
              staged(min_p, DType::f32, d, staging[3]),
              staged(seed, DType::i64, d, staging[4]),
              staged(offset, DType::i64, d, staging[5])};
    }
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

  void reserve_scratch() {
    const int64_t blocks_per_seq = bm.blocks_for(opt.max_context);
    decodes.reserve(opt, blocks_per_seq);
    prefills.reserve(opt, blocks_per_seq);
    rows.reserve(static_cast<size_t>(opt.max_seqs));
    sampling.reserve(static_cast<size_t>(opt.max_seqs));
  }

  // Fills call.kv from call.items: each item's blocks after this step's tokens.
  void build_view(Call& call) {
    const int64_t P = bm.block_size();
    call.indptr.push_back(0);
    for (const Item& it : call.items) {
      const int64_t len = it.begin + it.count, nb = bm.blocks_for(len);
      const auto& table = bm.block_table(it.s->seq_id);
      call.indices.insert(call.indices.end(), table.begin(), table.begin() + nb);
      call.indptr.push_back(static_cast<int32_t>(call.indices.size()));
      call.last_len.push_back(static_cast<int32_t>(len - (nb - 1) * P));
      for (int64_t p = it.begin; p < len; ++p) call.slots.push_back(bm.slot(it.s->seq_id, p));
    }
    const Device d = weights->device();
    call.kv.k_cache = bm.k_cache();  // reuses the vectors' memory
    call.kv.v_cache = bm.v_cache();
    call.kv.kv_indptr = staged(call.indptr, DType::i32, d, call.indptr_d);
    call.kv.kv_indices = staged(call.indices, DType::i32, d, call.indices_d);
    call.kv.kv_last_len = staged(call.last_len, DType::i32, d, call.last_len_d);
    call.kv.slot_mapping = staged(call.slots, DType::i32, d, call.slots_d);
  }

  // The decoder's inputs of a call: one token per decode item, every chunk token of a prefill.
  void build_inputs(Call& call) {
    call.cu_seqlens.push_back(0);
    for (const Item& it : call.items) {
      for (int64_t p = it.begin; p < it.begin + it.count; ++p) {
        call.tokens.push_back(it.s->tokens[static_cast<size_t>(p)]);
        call.positions.push_back(static_cast<int32_t>(p));
      }
      call.cu_seqlens.push_back(static_cast<int32_t>(call.tokens.size()));
    }
    build_view(call);
  }

  // After a call: its tokens are computed; every sequence now complete gives its rows.
  void collect_rows(const Call& call, const Tensor& call_logits) {
    for (size_t r = 0; r < call.items.size(); ++r) {
      Sample* s = call.items[r].s;
      s->num_computed += call.items[r].count;
      if (opt.prefix_cache) bm.mark_computed(s->seq_id, s->tokens, s->num_computed);
      if (s->remaining() != 0) continue;
      const Tensor row = call_logits.narrow(static_cast<int64_t>(r), 1);
      const int n = s->group_prefill ? s->group->request.params.n : 1;
      for (int i = 0; i < n; ++i) rows.push_back({s, s->group_prefill ? i : s->index, row});
    }
  }

  // The sample that receives row's token: for a group's prompt, sample 0 itself and a new fork
  // for every other sample.
  Sample* fork_target(const Row& row) {
    Sample* s = row.s;
    if (!s->group_prefill || row.index == 0) return s;
    Group* g = s->group;
    auto child = std::make_unique<Sample>();
    child->group = g;
    child->index = row.index;
    child->seq_id = next_seq++;
    child->tokens.reserve(s->tokens.capacity());
    child->tokens.assign(s->tokens.begin(), s->tokens.end());
    child->num_computed = s->num_computed;
    child->admitted_once = true;
    bm.fork(s->seq_id, child->seq_id);
    insert_sorted(running, child.get());
    Sample* target = child.get();
    g->samples.push_back(std::move(child));
    ++stats.forks;
    return target;
  }

  // Fills decodes.items and prefills.items for this round.
  void schedule() {
    int64_t budget = opt.max_batch_tokens, seqs_left = opt.max_seqs;
    const int64_t preemptions_before = stats.preemptions;
    ++round;
    // 1. Running decodes, oldest first; when blocks run out the youngest running sequences are
    //    preempted (possibly the one being scheduled).
    for (size_t i = 0; i < running.size() && budget > 0 && seqs_left > 0; ++i) {
      Sample* s = running[i];
      if (s->remaining() != 1) continue;
      const int64_t len = static_cast<int64_t>(s->tokens.size());
      bool preempted_self = false;
      while (!bm.append_slots(s->seq_id, len)) {
        Sample* victim = running.back();
        preempt(victim);
        if (victim == s) {
          preempted_self = true;
          break;
        }
      }
      if (preempted_self) break;
      s->round = round;
      decodes.items.push_back({s, len - 1, 1});
      --budget, --seqs_left;
    }
    // 2. Running prefills (chunks of prompts or of recomputations), oldest first; when blocks
    //    run out, younger sequences not in this batch are preempted (else this one waits).
    for (size_t i = 0; i < running.size() && budget > 0 && seqs_left > 0; ++i) {
      Sample* s = running[i];
      if (s->remaining() <= 1) continue;
      const int64_t chunk = std::min(s->remaining(), budget);
      bool ok = bm.append_slots(s->seq_id, s->num_computed + chunk);
      while (!ok) {
        Sample* victim = nullptr;
        for (size_t j = running.size(); j-- > i + 1 && !victim;)
          if (running[j]->round != round) victim = running[j];
        if (!victim) break;
        preempt(victim);
        ok = bm.append_slots(s->seq_id, s->num_computed + chunk);
      }
      if (!ok) continue;
      s->round = round;
      prefills.items.push_back({s, s->num_computed, chunk});
      budget -= chunk, --seqs_left;
    }
    // Sequences were just preempted for want of blocks: admit nobody new this step.
    if (stats.preemptions != preemptions_before) return;
    // 3. Waiting sequences, oldest first, while blocks, budget and sequence slots last.
    int64_t width = running_width();
    while (!waiting.empty() && budget > 0 && seqs_left > 0) {
      Sample* s = waiting.front();
      const int64_t w = s->group_prefill ? s->group->request.params.n : 1;
      if (width + w > opt.max_seqs && !running.empty()) break;
      const int64_t cached = bm.allocate(s->seq_id, s->tokens,
                                         static_cast<int64_t>(s->group->request.prompt.size()) +
                                             s->group->request.params.max_tokens);
      const int64_t chunk = std::min(static_cast<int64_t>(s->tokens.size()) - cached, budget);
      if (!bm.append_slots(s->seq_id, cached + chunk)) {
        bm.free(s->seq_id);
        break;
      }
      if (!s->admitted_once) {
        s->admitted_once = true;
        if (s->group_prefill) s->group->out.num_cached_prompt_tokens = cached;
        stats.cached_prompt_tokens += cached;
      }
      s->num_computed = cached;
      s->round = round;
      waiting.pop_front();
      insert_sorted(running, s);
      prefills.items.push_back({s, cached, chunk});
      budget -= chunk, --seqs_left;
      width += w;
    }
  }

  void step() {
    if (running.empty() && waiting.empty()) return;
    reserve_memory();
    decodes.clear();
    prefills.clear();
    rows.clear();
    sampling.clear();
    schedule();
    // The oldest sequence always fits alone (submit() checks), so a round always runs something.
    TANDEM_CHECK(!decodes.items.empty() || !prefills.items.empty(),
                 "engine: the scheduler found nothing to run with {} sequences running and {} "
                 "waiting and {} of {} blocks free (a bug in the engine)",
                 running.size(), waiting.size(), bm.num_free_blocks(), bm.num_blocks());
    ++stats.steps;
    const Device d = weights->device();

    // The decoder: one call for the decodes, one for the prefill chunks.
    if (!decodes.items.empty()) build_inputs(decodes);
    if (!prefills.items.empty()) build_inputs(prefills);
    if (tp != nullptr) check_same_plan();
    Tensor decode_logits, prefill_logits;
    if (!decodes.items.empty()) {
      decode_logits =
          grown_rows(decodes.logits, static_cast<int64_t>(decodes.items.size()), Vs, DType::f32, d);
      decoder->decode(decodes.tokens, decodes.positions, decodes.kv, decode_logits);
      stats.decode_tokens += static_cast<int64_t>(decodes.items.size());
    }
    if (!prefills.items.empty()) {
      prefill_logits = grown_rows(prefills.logits, static_cast<int64_t>(prefills.items.size()), Vs,
                                  DType::f32, d);
      decoder->prefill(prefills.tokens, prefills.positions, prefills.cu_seqlens, prefills.kv,
                       prefill_logits);
      stats.prefill_tokens += static_cast<int64_t>(prefills.tokens.size());
    }

    // Rows to sample, each with its own seed and offset (the token's index in the completion).
    collect_rows(decodes, decode_logits);
    collect_rows(prefills, prefill_logits);
    if (rows.empty()) return;
    const int64_t R = static_cast<int64_t>(rows.size());
    const Tensor all_logits = grown_rows(logits, R, Vs, DType::f32, d);
    for (int64_t r = 0; r < R; ++r) {
      const Row& row = rows[static_cast<size_t>(r)];
      const Request& q = row.s->group->request;
      all_logits.narrow(r, 1).copy_from(row.logits);
      sampling.push(
          q.params, sample_seed(q.params.seed, row.index),
          row.s->group_prefill ? 0 : static_cast<int64_t>(row.s->tokens.size() - q.prompt.size()));
    }
    const Tensor tok = grown_rows(token, R, 1, DType::i32, d).view({R});
    const Tensor lp = grown_rows(logprob, R, 1, DType::f32, d).view({R});
    if (tp == nullptr) {
      ops::sample(all_logits, sampling.on(d), tok, lp);
    } else {
      sample_shards(all_logits, tok, lp);
    }
    const int32_t* sampled = tok.data_as<int32_t>();
    const float* sampled_lp = lp.data_as<float>();
    if (!d.is_cpu()) {
      host_token.resize(static_cast<size_t>(R));
      host_logprob.resize(static_cast<size_t>(R));
      Tensor::wrap(host_token.data(), {R}, DType::i32).copy_from(tok);
      Tensor::wrap(host_logprob.data(), {R}, DType::f32).copy_from(lp);
      sampled = host_token.data();
      sampled_lp = host_logprob.data();
    }

    // Fork groups whose prompt is done, then append every token.
    for (Row& row : rows) row.target = fork_target(row);
    for (const Row& row : rows) row.s->group_prefill = false;
    for (int64_t r = 0; r < R; ++r) {
      const Row& row = rows[static_cast<size_t>(r)];
      const SamplingParams& p = row.s->group->request.params;
      const Tensor whole = tp == nullptr ? all_logits.narrow(r, 1)
                           : full_row[static_cast<size_t>(r)] < 0
                               ? Tensor()
                               : full_rows.narrow(full_row[static_cast<size_t>(r)], 1);
      append_token(row.target, sampled[r], sampled_lp[r],
                   top_logprobs(whole, p.top_logprobs, p.temperature));
    }
  }

  // Tensor parallelism: this step's rows sampled over the ranks' (R, V/tp) logits
  // (model/tp_sample.h: a few floats per row between the ranks, not the rows), and the whole
  // rows of the requests that want top_logprobs gathered (R' V f32, those rows only). Every
  // rank gets the same tokens and logprobs. CPU sampling: other devices copy the shard over.
  void sample_shards(const Tensor& shard, Tensor tok, Tensor lp) {
    const int64_t R = shard.size(0);
    const Device d = shard.device();
    const Tensor host = d.is_cpu() ? shard : shard.to(Device::cpu());
    if (!d.is_cpu()) {
      host_token.resize(static_cast<size_t>(R));
      host_logprob.resize(static_cast<size_t>(R));
    }
    const Tensor token_out = d.is_cpu() ? tok : Tensor::wrap(host_token.data(), {R}, DType::i32);
    const Tensor lp_out = d.is_cpu() ? lp : Tensor::wrap(host_logprob.data(), {R}, DType::f32);
    model::sample_over_shards(*tp, tp_sampler, host, sampling.on(Device::cpu()), token_out, lp_out);
    stats.sampling_bytes += tp_sampler.step_bytes();
    if (!d.is_cpu()) {
      tok.copy_from(token_out);
      lp.copy_from(lp_out);
    }
    full_row.assign(static_cast<size_t>(R), -1);
    int64_t n = 0;
    for (int64_t r = 0; r < R; ++r)
      if (rows[static_cast<size_t>(r)].s->group->request.params.top_logprobs > 0)
        full_row[static_cast<size_t>(r)] = n++;
    if (n == 0) return;
    Tensor wanted = Tensor::empty({n, Vs}, DType::f32);
    for (int64_t r = 0; r < R; ++r)
      if (full_row[static_cast<size_t>(r)] >= 0)
        wanted.narrow(full_row[static_cast<size_t>(r)], 1).copy_from(host.narrow(r, 1));
    full_rows = model::gather_vocab_rows(*tp, wanted);
    stats.sampling_bytes += n * V * static_cast<int64_t>(sizeof(float));
  }

  // Tensor parallelism: every rank of the group runs its own scheduler on the same requests, which
  // is deterministic, so the ranks form the same steps without exchanging them. This check makes a
  // divergence (a rank given other requests, or an abort on one rank only) an error naming the
  // ranks before the decoder's collectives would mismatch: a hash of the step's decoder inputs,
  // all-gathered (8 bytes per rank per step).
  // The fingerprint also covers every call made since (calls: submitted requests with their
  // settings, aborts, weight versions), so settings that differ (a seed) are caught at the next
  // step, not only once they changed a token.
  Fnv calls;
  Tensor plan_hash, plan_hashes;  // (1), (tp) i64
  void add_call(const Request& r) {
    calls.add(r.id);
    calls.add(r.prompt);
    const SamplingParams& p = r.params;
    for (int64_t x : {int64_t{p.n}, int64_t{p.top_k}, int64_t{p.max_tokens}, int64_t{p.logprobs},
                      int64_t{p.top_logprobs}})
      calls.add(static_cast<uint64_t>(x));
    for (float x : {p.temperature, p.top_p, p.min_p}) calls.add(x);
    calls.add(p.seed);
    calls.add(p.stop_token_ids);
    for (const std::string& stop : p.stop) calls.add(stop);
  }
  void check_same_plan() {
    Fnv h = calls;
    for (const Call* call : {&decodes, &prefills}) {
      h.add(call->tokens);
      h.add(call->positions);
      h.add(call->cu_seqlens);
      h.add(call->indices);
      h.add(call->slots);
    }
    if (!plan_hash.defined()) {
      plan_hash = Tensor::empty({1}, DType::i64);
      plan_hashes = Tensor::empty({tp->size()}, DType::i64);
    }
    plan_hash.data_as<int64_t>()[0] = static_cast<int64_t>(h.h);
    tp->all_gather(plan_hash, plan_hashes);  // tp x 8 bytes
    const int64_t* all = plan_hashes.data_as<int64_t>();
    for (int r = 1; r < tp->size(); ++r)
      TANDEM_CHECK(all[r] == all[0],
                   "engine: the ranks of tensor-parallel group '{}' formed different steps (step "
                   "{}: rank {} differs from rank 0): every rank of the group must submit the same "
                   "requests in the same order, abort the same ones and swap weights together",
                   tp->name(), stats.steps, r);
  }

  // The k most likely tokens of one logits row (1, V), their logprobs computed by the trainer's
  // op (logprob_gather) under the sampling temperature (1 when greedy).
  std::vector<TokenLogprob> top_logprobs(const Tensor& row, int k, float temperature) const {
    if (k <= 0) return {};
    const Tensor host = row.device().is_cpu() ? row : row.to(Device::cpu());
    const int64_t V = host.size(1);
    const float* x = host.data_as<float>();
    std::vector<int32_t> ids(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) ids[static_cast<size_t>(v)] = static_cast<int32_t>(v);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    const Device d = row.device();
    Tensor repeated = Tensor::empty({k, V}, DType::f32, d);
    for (int i = 0; i < k; ++i) repeated.narrow(i, 1).copy_from(row);
    std::vector<int32_t> targets(ids.begin(), ids.begin() + k);
    Tensor lp = Tensor::empty({k}, DType::f32, d), lse = Tensor::empty({k}, DType::f32, d);
    ops::logprob_gather(repeated, device_tensor(targets, DType::i32, d), lp, lse, Tensor(),
                        temperature > 0.0f ? temperature : 1.0f);
    const Tensor host_lp = d.is_cpu() ? lp : lp.to(Device::cpu());
    std::vector<TokenLogprob> out;
    for (int i = 0; i < k; ++i)
      out.push_back({targets[static_cast<size_t>(i)], host_lp.data_as<float>()[i]});
    return out;
  }

  bool abort(const std::string& id) {
    if (tp != nullptr) calls.add(std::string_view(id));
    auto it = ids.find(id);
    if (it == ids.end()) return false;
    Group* g = groups.at(it->second).get();
    for (auto& s : g->samples) {
      if (s->finished) continue;
      bm.free(s->seq_id);
      auto r = std::find(running.begin(), running.end(), s.get());
      if (r != running.end()) running.erase(r);
      auto w = std::find(waiting.begin(), waiting.end(), s.get());
      if (w != waiting.end()) waiting.erase(w);
      // Unfinished samples end with abort; finished ones keep their reason. A prompt not yet
      // forked stands for every sample.
      if (s->group_prefill) {
        for (SampleOutput& out : g->out.samples) out.finish_reason = FinishReason::abort;
      } else {
        g->out.samples[static_cast<size_t>(s->index)].finish_reason = FinishReason::abort;
      }
    }
    finish_group(g, RequestStatus::aborted);
    return true;
  }
};

Engine::Engine(const model::Weights& weights, const EngineOptions& options,
               const model::Tokenizer* tokenizer, Communicator* tp_group)
    : impl_(std::make_unique<Impl>(weights, options, tokenizer, tp_group)) {}

Engine::~Engine() = default;

uint64_t Engine::submit(Request request) { return impl_->submit(std::move(request)); }

void Engine::step() { impl_->step(); }

std::vector<RequestOutput> Engine::poll() {
  std::vector<RequestOutput> out;
  out.swap(impl_->finished);
  return out;
}

bool Engine::abort(const std::string& id) { return impl_->abort(id); }

bool Engine::has_work() const { return !impl_->running.empty() || !impl_->waiting.empty(); }

int64_t Engine::num_waiting() const { return static_cast<int64_t>(impl_->waiting.size()); }

int64_t Engine::num_running() const { return static_cast<int64_t>(impl_->running.size()); }

std::vector<RequestOutput> Engine::generate(std::vector<Request> requests) {
  std::unordered_map<uint64_t, size_t> slot;
  for (size_t i = 0; i < requests.size(); ++i) slot.emplace(submit(std::move(requests[i])), i);
  std::vector<RequestOutput> results(requests.size());
  size_t done = 0;
  auto collect = [&] {
    for (RequestOutput& r : poll()) {
      auto it = slot.find(r.handle);
      if (it == slot.end()) {
        impl_->finished.push_back(std::move(r));  // not ours: left for the caller's poll()
        continue;
      }
      results[it->second] = std::move(r);
      ++done;
    }
  };
  collect();
  while (done < requests.size()) {
    TANDEM_CHECK(has_work(), "engine: generate lost {} requests", requests.size() - done);
    step();
    collect();
  }
  return results;
}

void Engine::set_weights(const model::Weights& weights, uint64_t version) {
  Impl& m = *impl_;
  TANDEM_CHECK(same_shapes(weights.config(), m.weights->config()),
               "engine: set_weights needs weights of the same shapes as the current ones");
  TANDEM_CHECK(weights.device() == m.weights->device(),
               "engine: set_weights needs weights on the engine's device");
  while (!m.running.empty()) m.preempt(m.running.back());
  m.bm.clear_prefix_cache();
  m.weights = &weights;
  // The decoder keeps its activation arena and packs the new values into the memory of its
  // packed copies. A released engine has no decoder: its next step() makes one.
  if (m.decoder) m.decoder->set_weights(weights);
  m.version = version;
  if (m.tp != nullptr) m.calls.add(version);
}

void Engine::release_memory() {
  Impl& m = *impl_;
  TANDEM_CHECK(!has_work(),
               "engine: cannot release memory with {} sequences running and {} waiting: finish "
               "or abort them first",
               m.running.size(), m.waiting.size());
  m.decoder.reset();
  m.bm.release_memory();
}

void Engine::reserve_memory() { impl_->reserve_memory(); }

bool Engine::memory_reserved() const { return impl_->bm.memory_reserved(); }

uint64_t Engine::weight_version() const { return impl_->version; }
const EngineOptions& Engine::options() const { return impl_->opt; }
const EngineStats& Engine::stats() const { return impl_->stats; }
const BlockManager& Engine::blocks() const { return impl_->bm; }

}  // namespace tandem::rollout
