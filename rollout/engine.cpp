// Engine: its public calls and the life of a request (validation, submit, abort, finish), weight
// swaps and memory phases; the scheduler is in engine_schedule.cpp, a step in engine_step.cpp.
#include "rollout/engine.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "rollout/engine_internal.h"

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

bool same_shapes(const model::ModelConfig& a, const model::ModelConfig& b) {
  return a.arch == b.arch && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_layers == b.num_layers &&
         a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim;
}

}  // namespace

Engine::Impl::Impl(const model::Weights& w, const EngineOptions& o, const model::Tokenizer* t,
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
               "engine: max_context must be in [1, {}] (the model's positions), got {}", positions,
               o.max_context);
  decoder = make_decoder(w);
  reserve_scratch();
}

void Engine::Impl::reserve_memory() {
  bm.reserve_memory();
  if (!decoder) decoder = make_decoder(*weights);
}

std::unique_ptr<model::Decoder> Engine::Impl::make_decoder(const model::Weights& w) const {
  // The weights stay as they are until the next set_weights, which refreshes the decoder.
  return std::make_unique<model::Decoder>(
      w, model::DecoderOptions{
             .max_tokens = opt.max_batch_tokens, .pack_weights = true, .tp_group = tp});
}

std::pair<Refusal, std::string> Engine::Impl::refusal_of(const Request& r) const {
  if (ids.count(r.id))
    return {Refusal::duplicate_id, fmt::format("the id '{}' is already in flight", r.id)};
  if (static_cast<int64_t>(waiting.size()) >= opt.max_waiting)
    return {Refusal::queue_full,
            fmt::format("the queue is full ({} waiting; max_waiting)", opt.max_waiting)};
  std::string why = validate(r);
  return {why.empty() ? Refusal::none : Refusal::invalid, std::move(why)};
}

std::string Engine::Impl::validate(const Request& r) const {
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

uint64_t Engine::Impl::submit(Request r) {
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
    out.token_versions.reserve(static_cast<size_t>(max_tokens));
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

void Engine::Impl::finish_group(Group* g, RequestStatus status) {
  g->out.status = status;
  finished.push_back(std::move(g->out));
  ids.erase(g->request.id);
  groups.erase(g->handle);
}

bool Engine::Impl::abort(const std::string& id) {
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

Engine::Engine(const model::Weights& weights, const EngineOptions& options,
               const model::Tokenizer* tokenizer, Communicator* tp_group)
    : impl_(std::make_unique<Impl>(weights, options, tokenizer, tp_group)) {}

Engine::~Engine() = default;

uint64_t Engine::submit(Request request) { return impl_->submit(std::move(request)); }

void Engine::step() {
  impl_->step();
  impl_->swap_when_drained();
}

std::vector<RequestOutput> Engine::poll() {
  std::vector<RequestOutput> out;
  out.swap(impl_->finished);
  return out;
}

bool Engine::abort(const std::string& id) {
  const bool found = impl_->abort(id);
  impl_->swap_when_drained();
  return found;
}

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

void Engine::set_weights(const model::Weights& weights, uint64_t version, Swap swap) {
  Impl& m = *impl_;
  TANDEM_CHECK(same_shapes(weights.config(), m.weights->config()),
               "engine: set_weights needs weights of the same shapes as the current ones");
  TANDEM_CHECK(weights.device() == m.weights->device(),
               "engine: set_weights needs weights on the engine's device");
  if (m.tp != nullptr) m.calls.add(static_cast<uint64_t>(swap));
  m.pending_weights = nullptr;
  if (swap == Swap::after_started && m.any_started()) {
    m.pending_weights = &weights;
    m.pending_version = version;
    return;
  }
  while (!m.running.empty()) m.preempt(m.running.back());
  m.swap_weights(weights, version);
}

void Engine::Impl::swap_weights(const model::Weights& w, uint64_t v) {
  bm.clear_prefix_cache();
  weights = &w;
  // The decoder keeps its activation arena and packs the new values into the memory of its
  // packed copies. A released engine has no decoder: its next step() makes one.
  if (decoder) decoder->set_weights(w);
  version = v;
  if (tp != nullptr) calls.add(v);
}

bool Engine::Impl::any_started() const {
  return !running.empty() || std::any_of(waiting.begin(), waiting.end(),
                                         [](const Sample* s) { return s->admitted_once; });
}

void Engine::Impl::swap_when_drained() {
  if (pending_weights == nullptr || any_started()) return;
  const model::Weights* w = pending_weights;
  pending_weights = nullptr;
  swap_weights(*w, pending_version);
}

bool Engine::swap_pending() const { return impl_->pending_weights != nullptr; }
uint64_t Engine::committed_version() const {
  return swap_pending() ? impl_->pending_version : impl_->version;
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