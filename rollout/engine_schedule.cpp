// Engine's scheduler: which sequences a step runs (decodes, prefill chunks, admissions under the
// token budget and the sequence cap), preemption by recompute, and the tensor-parallel check
// that every rank formed the same step.
#include <algorithm>

#include "core/error.h"
#include "rollout/engine_internal.h"

namespace tandem::rollout {

bool Engine::Impl::older(const Sample* a, const Sample* b) {
  if (a->group->handle != b->group->handle) return a->group->handle < b->group->handle;
  return a->index < b->index;
}

int64_t Engine::Impl::running_width() const {
  int64_t w = 0;
  for (const Sample* s : running) w += s->group_prefill ? s->group->request.params.n : 1;
  return w;
}

void Engine::Impl::remove_running(Sample* s) {
  running.erase(std::find(running.begin(), running.end(), s));
}

void Engine::Impl::insert_sorted(std::vector<Sample*>& v, Sample* s) {
  v.insert(std::upper_bound(v.begin(), v.end(), s, older), s);
}

void Engine::Impl::preempt(Sample* s) {
  bm.free(s->seq_id);
  s->num_computed = 0;
  remove_running(s);
  waiting.insert(std::upper_bound(waiting.begin(), waiting.end(), s, older), s);
  ++stats.preemptions;
}

void Engine::Impl::schedule() {
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
  // A swap pending for the started samples: only those (preempted ones) are admitted.
  while (budget > 0 && seqs_left > 0) {
    const auto next = pending_weights == nullptr
                          ? waiting.begin()
                          : std::find_if(waiting.begin(), waiting.end(),
                                         [](const Sample* w) { return w->admitted_once; });
    if (next == waiting.end()) break;
    Sample* s = *next;
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
    waiting.erase(next);
    insert_sorted(running, s);
    prefills.items.push_back({s, cached, chunk});
    budget -= chunk, --seqs_left;
    width += w;
  }
}

void Engine::Impl::add_call(const Request& r) {
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

void Engine::Impl::check_same_plan() {
  detail::Fnv h = calls;
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

}  // namespace tandem::rollout
