// Engine's step: the decoder calls of a scheduled batch, sampling with per-sample Philox
// streams, group forks, and appending the sampled tokens with stop handling.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/tp_sample.h"
#include "rollout/engine_internal.h"

namespace tandem::rollout {

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

}  // namespace

ops::SamplingTensors Engine::Impl::SamplingRows::on(Device d) {
  return {
      staged(temperature, DType::f32, d, staging[0]), staged(top_k, DType::i32, d, staging[1]),
      staged(top_p, DType::f32, d, staging[2]),       staged(min_p, DType::f32, d, staging[3]),
      staged(seed, DType::i64, d, staging[4]),        staged(offset, DType::i64, d, staging[5])};
}

void Engine::Impl::reserve_scratch() {
  const int64_t blocks_per_seq = bm.blocks_for(opt.max_context);
  decodes.reserve(opt, blocks_per_seq);
  prefills.reserve(opt, blocks_per_seq);
  rows.reserve(static_cast<size_t>(opt.max_seqs));
  sampling.reserve(static_cast<size_t>(opt.max_seqs));
}

void Engine::Impl::build_view(Call& call) {
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

void Engine::Impl::build_inputs(Call& call) {
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

void Engine::Impl::collect_rows(const Call& call, const Tensor& call_logits) {
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

Engine::Impl::Sample* Engine::Impl::fork_target(const Row& row) {
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

void Engine::Impl::step() {
  swap_when_drained();
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
    prefill_logits =
        grown_rows(prefills.logits, static_cast<int64_t>(prefills.items.size()), Vs, DType::f32, d);
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

void Engine::Impl::sample_shards(const Tensor& shard, Tensor tok, Tensor lp) {
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

std::vector<TokenLogprob> Engine::Impl::top_logprobs(const Tensor& row, int k,
                                                     float temperature) const {
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

void Engine::Impl::finish_sample(Sample* s, FinishReason reason) {
  s->finished = true;
  s->group->out.samples[static_cast<size_t>(s->index)].finish_reason = reason;
  bm.free(s->seq_id);
  remove_running(s);
  Group* g = s->group;
  if (--g->unfinished == 0) finish_group(g, RequestStatus::done);
}

void Engine::Impl::append_token(Sample* s, int32_t token, float logprob,
                                std::vector<TokenLogprob> top) {
  const SamplingParams& p = s->group->request.params;
  SampleOutput& out = s->group->out.samples[static_cast<size_t>(s->index)];
  if (out.tokens.empty()) out.first_weight_version = version;
  out.weight_version = version;
  s->tokens.push_back(token);
  out.tokens.push_back(token);
  out.token_versions.push_back(version);
  if (p.logprobs) out.logprobs.push_back(logprob);
  if (p.top_logprobs > 0) out.top_logprobs.push_back(std::move(top));
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end())
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

}  // namespace tandem::rollout
