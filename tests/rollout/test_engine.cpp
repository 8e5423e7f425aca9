// Tests of rollout/engine on tiny random models: the engine's logprobs equal the training
// forward's bitwise, shared-prompt groups equal separate requests, outputs do not depend on
// the batch or the arrival order, prefix caching, stop ids and stop strings across token
// boundaries, preemption, abort, refused requests and weight swaps.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "rollout/engine.h"
#include "rollout/engine_memory.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace tandem::rollout {
namespace {

model::ModelConfig tiny_config(bool qwen3 = false, int64_t vocab = 101) {
  model::ModelConfig c =
      test::tiny_model_config(qwen3 ? test::TinyKind::qwen3 : test::TinyKind::llama_tied);
  c.vocab_size = vocab;
  return c;
}

void fill_random(model::Weights& w, uint64_t seed) { test::fill_random_weights(w, seed); }

std::vector<int32_t> random_prompt(int n, int64_t V, uint64_t seed) {
  const Tensor ids = test::random_ints({n}, DType::i32, seed, 0, V);
  const int32_t* p = ids.data_as<int32_t>();
  return std::vector<int32_t>(p, p + n);
}

Request make_request(const std::string& id, std::vector<int32_t> prompt, int n, uint64_t seed,
                     int max_tokens) {
  Request r{id, std::move(prompt), {}};
  r.params.n = n;
  r.params.seed = seed;
  r.params.max_tokens = max_tokens;
  r.params.temperature = 0.9f;
  r.params.top_k = 40;
  r.params.top_p = 0.95f;
  return r;
}

// A mix of prompt lengths (some over the small budgets below), group sizes and filters.
std::vector<Request> mixed_requests(int64_t V) {
  std::vector<Request> rs;
  rs.push_back(make_request("a", random_prompt(5, V, 11), 1, 1, 7));
  rs.push_back(make_request("b", random_prompt(13, V, 12), 3, 20, 9));
  rs.push_back(make_request("c", random_prompt(3, V, 13), 2, 300, 6));
  rs.push_back(make_request("d", random_prompt(9, V, 14), 1, 4000, 11));
  rs[2].params.min_p = 0.05f;
  rs[3].params.temperature = 0.0f;  // greedy
  rs[3].params.top_k = 0;
  return rs;
}

void check_same_samples(const RequestOutput& a, const RequestOutput& b) {
  INFO("request " << a.id);
  REQUIRE(a.status == RequestStatus::done);
  REQUIRE(b.status == RequestStatus::done);
  REQUIRE(a.samples.size() == b.samples.size());
  for (size_t i = 0; i < a.samples.size(); ++i) {
    INFO("sample " << i);
    CHECK(a.samples[i].tokens == b.samples[i].tokens);
    CHECK(a.samples[i].finish_reason == b.samples[i].finish_reason);
    CHECK(a.samples[i].text == b.samples[i].text);
    REQUIRE(a.samples[i].logprobs.size() == b.samples[i].logprobs.size());
    for (size_t t = 0; t < a.samples[i].logprobs.size(); ++t)  // bitwise
      CHECK(std::memcmp(&a.samples[i].logprobs[t], &b.samples[i].logprobs[t], 4) == 0);
  }
}

std::map<std::string, RequestOutput> by_id(std::vector<RequestOutput> outs) {
  std::map<std::string, RequestOutput> m;
  for (RequestOutput& o : outs) m[o.id] = std::move(o);
  return m;
}

std::string byte_char(int b) { return tandem::test::gpt2_byte_char(b); }

// Ids 0..255 are the bytes, then multi-byte merges, then one control token.
model::Tokenizer tiny_tokenizer() {
  model::TokenizerData d;
  for (int b = 0; b < 256; ++b) d.tokens.push_back(byte_char(b));
  for (auto [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"a", "b"}, {"c", "d"}, {"ab", "cd"}, {"Ġ", "a"}}) {
    d.merges.emplace_back(a, b);
    d.tokens.push_back(a + b);
  }
  d.token_types.assign(d.tokens.size(), model::TokenType::normal);
  d.tokens.push_back("<|s|>");
  d.token_types.push_back(model::TokenType::control);
  d.eos_id = static_cast<int32_t>(d.tokens.size() - 1);
  return model::Tokenizer(std::move(d));
}

EngineOptions small_options() {
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 96;
  o.max_batch_tokens = 64;
  o.max_seqs = 16;
  o.max_context = 64;
  return o;
}

// Every sample's logprobs against the training forward of prompt + completion on w's device
// (the decoder at the same temperature): how many tokens, how many bitwise equal, the largest
// |difference|.
struct ForwardComparison {
  int64_t compared = 0, equal = 0;
  double max_abs = 0;
};

ForwardComparison compare_with_forward(const model::Weights& w, const std::vector<Request>& rs,
                                       const std::vector<RequestOutput>& outs, float temperature) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<std::pair<size_t, size_t>> who;
  for (size_t r = 0; r < outs.size(); ++r)
    for (size_t i = 0; i < outs[r].samples.size(); ++i) {
      std::vector<int32_t> seq = rs[r].prompt;
      seq.insert(seq.end(), outs[r].samples[i].tokens.begin(), outs[r].samples[i].tokens.end());
      seqs.push_back(seq);
      who.emplace_back(r, i);
    }
  model::Decoder dec(w, {.max_tokens = 256});
  const model::PackedBatch batch = model::PackedBatch::from_sequences(seqs);
  Tensor lpd = Tensor::empty({batch.num_tokens()}, DType::f32, w.device());
  dec.forward(batch, lpd, Tensor(), temperature);
  const Tensor lp = lpd.to(Device::cpu());
  ForwardComparison c;
  for (size_t b = 0; b < seqs.size(); ++b) {
    const auto [r, i] = who[b];
    const SampleOutput& s = outs[r].samples[i];
    const int64_t n = static_cast<int64_t>(rs[r].prompt.size());
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      const float want =
          lp.data_as<float>()[batch.row_of(static_cast<int64_t>(b), n + static_cast<int64_t>(t))];
      c.max_abs = std::max(c.max_abs, std::fabs(static_cast<double>(s.logprobs[t]) - want));
      c.equal += std::memcmp(&s.logprobs[t], &want, 4) == 0 ? 1 : 0;
      ++c.compared;
    }
  }
  return c;
}
}  // namespace

TEST_CASE("engine logprobs equal the training forward's logprobs bitwise for a ragged batch",
          "[unit]") {
  // Also with the bf16 matmul precision (AMX where the CPU has it, and its AVX512-BF16 path
  // where it has that too): decode's few rows and the packed forward's many get the same bits.
  const auto automatic = ops::MatmulKernel::automatic;
  const auto outer = ops::MatmulBackward::outer;
  std::vector<ops::MatmulSettings> settings = {{ops::MatmulPrecision::f32, automatic, outer},
                                               {ops::MatmulPrecision::bf16, automatic, outer}};
  if (ops::matmul_has_amx() && ops::matmul_has_avx512_bf16())
    settings.push_back({ops::MatmulPrecision::bf16, ops::MatmulKernel::avx512_bf16, outer});
  for (const ops::MatmulSettings& setting : settings)
    for (bool qwen3 : {false, true}) {
      const ops::ScopedMatmulSettings scope(setting);
      const DType dtype = qwen3 ? DType::bf16 : DType::f32;
      INFO((qwen3 ? "qwen3 bf16" : "llama f32")
           << " matmuls: " << name_of(ops::kMatmulPrecisionNames, setting.precision) << " "
           << ops::matmul_bf16_path_name(ops::matmul_bf16_path()));
      const model::ModelConfig c = tiny_config(qwen3);
      model::Weights w(c, dtype);
      fill_random(w, qwen3 ? 900 : 800);
      EngineOptions o = small_options();
      o.max_batch_tokens = 10;  // the 13-token prompt is prefilled in chunks
      Engine engine(w, o);
      std::vector<Request> rs = mixed_requests(c.vocab_size);
      for (Request& r : rs) r.params.temperature = 0.7f;  // the trainer's temperature below
      const std::vector<RequestOutput> outs = engine.generate(rs);
      for (size_t r = 0; r < outs.size(); ++r) {
        REQUIRE(outs[r].status == RequestStatus::done);
        REQUIRE(outs[r].samples.size() == static_cast<size_t>(rs[r].params.n));
        for (const SampleOutput& smp : outs[r].samples) {
          CHECK(smp.tokens.size() == static_cast<size_t>(rs[r].params.max_tokens));
          CHECK(smp.finish_reason == FinishReason::length);
        }
      }
      const ForwardComparison cmp = compare_with_forward(w, rs, outs, 0.7f);
      INFO("max |delta| " << cmp.max_abs);
      CHECK(cmp.equal == cmp.compared);  // bitwise
      CHECK(cmp.compared == 7 + 3 * 9 + 2 * 6 + 11);
      CHECK(engine.stats().forks == 2 + 1);
      CHECK(engine.blocks().num_free_blocks() == o.num_blocks);
    }
}

TEST_CASE("engine group of n samples equals n separate requests with the same seeds", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 801);
  const std::vector<int32_t> prompt = random_prompt(10, c.vocab_size, 5);
  Engine grouped(w, small_options());
  const RequestOutput g = grouped.generate({make_request("g", prompt, 4, 77, 12)})[0];
  CHECK(grouped.stats().forks == 3);
  CHECK(grouped.stats().prefill_tokens == 10);  // the prompt once
  Engine separate(w, small_options());
  std::vector<Request> rs;
  for (int i = 0; i < 4; ++i)
    rs.push_back(make_request(fmt::format("s{}", i), prompt, 1, sample_seed(77, i), 12));
  const std::vector<RequestOutput> s = separate.generate(rs);
  REQUIRE(g.samples.size() == 4);
  for (int i = 0; i < 4; ++i) {
    RequestOutput one = g;
    one.samples = {g.samples[static_cast<size_t>(i)]};
    one.samples[0].index = 0;
    check_same_samples(one, s[static_cast<size_t>(i)]);
  }
  // The samples differ from one another (their streams are distinct).
  CHECK(g.samples[0].tokens != g.samples[1].tokens);
}

TEST_CASE("engine seeded output is independent of batch composition and arrival order", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 802);
  const std::vector<Request> rs = mixed_requests(c.vocab_size);
  // Each request alone, with a roomy budget.
  std::map<std::string, RequestOutput> alone;
  for (const Request& r : rs) {
    Engine e(w, small_options());
    alone[r.id] = e.generate({r})[0];
  }
  // All together, in order and reversed, under budgets that chunk prompts and split batches.
  for (int64_t budget : {64, 5, 1}) {
    for (bool reversed : {false, true}) {
      INFO("budget " << budget << (reversed ? " reversed" : " in order"));
      std::vector<Request> order = rs;
      if (reversed) std::reverse(order.begin(), order.end());
      EngineOptions o = small_options();
      o.max_batch_tokens = budget;
      o.max_seqs = budget == 1 ? 3 : 16;
      Engine e(w, o);
      auto got = by_id(e.generate(order));
      for (const Request& r : rs) check_same_samples(got.at(r.id), alone.at(r.id));
    }
  }
  // Requests arriving while others are mid-generation.
  Engine e(w, small_options());
  e.submit(rs[1]);
  e.step();
  e.step();
  e.submit(rs[3]);
  e.step();
  e.submit(rs[0]);
  e.submit(rs[2]);
  while (e.has_work()) e.step();
  auto got = by_id(e.poll());
  for (const Request& r : rs) check_same_samples(got.at(r.id), alone.at(r.id));
}

TEST_CASE("engine prefix cache serves a shared prompt prefix with unchanged outputs", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 803);
  const std::vector<int32_t> system = random_prompt(11, c.vocab_size, 21);
  std::vector<int32_t> p1 = system, p2 = system;
  for (int32_t t : random_prompt(3, c.vocab_size, 22)) p1.push_back(t);
  for (int32_t t : random_prompt(5, c.vocab_size, 23)) p2.push_back(t);
  const Request r1 = make_request("one", p1, 2, 5, 6), r2 = make_request("two", p2, 3, 6, 6);
  Engine cached(w, small_options());
  const RequestOutput o1 = cached.generate({r1})[0];
  const RequestOutput o2 = cached.generate({r2})[0];
  CHECK(o1.num_cached_prompt_tokens == 0);
  CHECK(o2.num_cached_prompt_tokens == 8);  // two full blocks of 4 of the 11 shared tokens
  CHECK(cached.stats().prefill_tokens == 14 + 8);
  Engine fresh(w, small_options());
  check_same_samples(o2, fresh.generate({r2})[0]);
  // The same prompt again: every full block that leaves a token to compute is cached.
  const RequestOutput again = cached.generate({r2})[0];
  CHECK(again.num_cached_prompt_tokens == 12);  // all full blocks but the last token's
  check_same_samples(again, o2);
  CHECK(cached.blocks().num_free_blocks() == small_options().num_blocks);
}

TEST_CASE("engine without a prefix cache computes every prompt in full with unchanged outputs",
          "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 804);
  const Request r = make_request("r", random_prompt(13, c.vocab_size, 24), 2, 7, 6);
  EngineOptions o = small_options();
  o.prefix_cache = false;
  Engine uncached(w, o);
  const RequestOutput first = uncached.generate({r})[0];
  const RequestOutput again = uncached.generate({r})[0];
  CHECK(again.num_cached_prompt_tokens == 0);
  CHECK(uncached.stats().prefill_tokens == 2 * 13);
  CHECK(uncached.blocks().num_cached_blocks() == 0);
  check_same_samples(again, first);
  Engine cached(w, small_options());
  check_same_samples(first, cached.generate({r})[0]);
}

TEST_CASE("engine stop strings across token boundaries and stop ids cut the completion", "[unit]") {
  const model::Tokenizer tok = tiny_tokenizer();
  const model::ModelConfig c = tiny_config(false, tok.vocab_size());
  model::Weights w(c, DType::f32);
  fill_random(w, 809);
  Engine e(w, small_options(), &tok);
  Request r = make_request("free", random_prompt(6, c.vocab_size, 50), 1, 9, 40);
  r.params.top_k = 0;
  r.params.top_p = 1.0f;
  const SampleOutput full = e.generate({r})[0].samples[0];
  REQUIRE(full.tokens.size() == 40);
  CHECK(full.text == tok.decode(full.tokens));
  std::vector<size_t> ends;  // byte offset after each token
  for (int32_t t : full.tokens)
    ends.push_back((ends.empty() ? 0 : ends.back()) + tok.token_to_piece(t).size());
  for (size_t boundary : {3, 10, 25}) {
    // Three bytes around the end of token `boundary - 1`: the stop string spans tokens.
    const size_t b = ends[boundary - 1];
    const std::string stop = full.text.substr(b - 1, 3);
    const size_t pos = full.text.find(stop);
    size_t k = 0;
    while (ends[k] < pos + stop.size()) ++k;
    INFO("stop string at byte " << pos << " completed by token " << k);
    Request rs = r;
    rs.id = fmt::format("stop {}", boundary);
    rs.params.stop = {"never\x01\x02 seen", stop};
    const RequestOutput o = e.generate({rs})[0];
    REQUIRE(o.samples.size() == 1);
    const SampleOutput& s = o.samples[0];
    CHECK(s.finish_reason == FinishReason::stop);
    CHECK(s.stop_string == stop);
    CHECK(s.text == full.text.substr(0, pos));
    CHECK(s.tokens == std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + k + 1));
    CHECK(s.logprobs == std::vector<float>(full.logprobs.begin(), full.logprobs.begin() + k + 1));
  }
  // A stop id: the token is kept, its text is not.
  const int32_t stop_id = full.tokens[7];
  const size_t k = static_cast<size_t>(std::find(full.tokens.begin(), full.tokens.end(), stop_id) -
                                       full.tokens.begin());
  Request ri = r;
  ri.id = "stop id";
  ri.params.stop_token_ids = {stop_id};
  const SampleOutput s = e.generate({ri})[0].samples[0];
  CHECK(s.finish_reason == FinishReason::stop);
  CHECK(s.tokens == std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + k + 1));
  CHECK(s.text == tok.decode(std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + k)));
}

TEST_CASE("engine preemption under a tiny block budget gives the unconstrained outputs", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 804);
  std::vector<Request> rs;
  const int lengths[] = {6, 9, 3, 8};
  for (int r = 0; r < 4; ++r)
    rs.push_back(
        make_request(fmt::format("r{}", r),
                     random_prompt(lengths[r], c.vocab_size, 40 + static_cast<uint64_t>(r)),
                     r == 3 ? 1 : 2, 100 * static_cast<uint64_t>(r), 10));
  Engine roomy(w, small_options());
  auto want = by_id(roomy.generate(rs));
  CHECK(roomy.stats().preemptions == 0);
  for (int64_t budget : {64, 3}) {
    INFO("budget " << budget);
    EngineOptions o = small_options();
    o.num_blocks = 5;  // the longest sample (19 tokens) needs 5 blocks of 4
    o.max_batch_tokens = budget;
    Engine tight(w, o);
    auto got = by_id(tight.generate(rs));
    CHECK(tight.stats().preemptions > 0);
    for (const Request& r : rs) check_same_samples(got.at(r.id), want.at(r.id));
    CHECK(tight.blocks().num_free_blocks() == 5);
  }
}

TEST_CASE("engine abort frees every block and ends the request's samples", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 805);
  EngineOptions o = small_options();
  o.max_batch_tokens = 8;
  Engine e(w, o);
  std::vector<Request> rs = mixed_requests(c.vocab_size);
  rs[0].params.max_tokens = 2;
  for (const Request& r : rs) e.submit(r);
  for (int i = 0; i < 4; ++i) e.step();
  CHECK(e.blocks().num_free_blocks() < o.num_blocks);
  CHECK(e.abort("b"));  // running, forked
  CHECK_FALSE(e.abort("nope"));
  for (int i = 0; i < 2; ++i) e.step();
  auto first = by_id(e.poll());
  REQUIRE(first.count("b"));
  CHECK(first.at("b").status == RequestStatus::aborted);
  for (const SampleOutput& s : first.at("b").samples) CHECK(s.finish_reason == FinishReason::abort);
  CHECK(e.abort("c"));
  CHECK(e.abort("d"));
  CHECK_FALSE(e.abort("b"));  // already over
  while (e.has_work()) e.step();
  auto rest = by_id(e.poll());
  CHECK(rest.at("c").status == RequestStatus::aborted);
  CHECK(rest.at("d").status == RequestStatus::aborted);
  const RequestOutput& a = first.count("a") ? first.at("a") : rest.at("a");
  CHECK(a.status == RequestStatus::done);
  CHECK(a.samples[0].tokens.size() == 2);
  CHECK(e.blocks().num_free_blocks() == o.num_blocks);
  // A request aborted before it ever ran.
  e.submit(rs[1]);
  CHECK(e.abort("b"));
  CHECK_FALSE(e.has_work());
  const auto queued = e.poll();
  REQUIRE(queued.size() == 1);
  CHECK(queued[0].samples.size() == 3);
  CHECK(queued[0].samples[2].finish_reason == FinishReason::abort);
  CHECK(e.blocks().num_free_blocks() == o.num_blocks);
}

TEST_CASE("engine refuses bad requests with an error for that request only", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 806);
  const std::vector<Request> good = mixed_requests(c.vocab_size);
  std::vector<std::pair<Request, std::string>> bad;
  auto variant = [&](const std::string& what, auto edit) {
    Request r =
        make_request(fmt::format("bad {}", what), random_prompt(4, c.vocab_size, 3), 1, 0, 4);
    edit(r);
    bad.emplace_back(r, what);
  };
  variant("prompt is empty", [](Request& r) { r.prompt.clear(); });
  variant("outside the vocabulary", [](Request& r) { r.prompt[2] = 101; });
  variant("exceed the context", [](Request& r) { r.params.max_tokens = 61; });
  variant("n must be", [](Request& r) { r.params.n = 0; });
  variant("n must be", [](Request& r) { r.params.n = 17; });
  variant("top_p", [](Request& r) { r.params.top_p = 1.5f; });
  variant("top_p", [](Request& r) { r.params.top_p = 0.0f; });
  variant("temperature", [](Request& r) { r.params.temperature = -1.0f; });
  variant("stop_token_ids[1]", [](Request& r) { r.params.stop_token_ids = {3, 500}; });
  variant("need a tokenizer", [](Request& r) { r.params.stop = {"x"}; });
  variant("top_logprobs", [](Request& r) { r.params.top_logprobs = 21; });
  variant("max_tokens", [](Request& r) { r.params.max_tokens = 0; });
  std::vector<Request> all;
  for (size_t i = 0; i < good.size(); ++i) {
    all.push_back(good[i]);
    for (size_t j = i * 3; j < std::min(bad.size(), i * 3 + 3); ++j) all.push_back(bad[j].first);
  }
  all.push_back(good[0]);  // the same id as one in flight
  Engine e(w, small_options());
  const std::vector<RequestOutput> outs = e.generate(all);
  Engine ref(w, small_options());
  auto want = by_id(ref.generate(good));
  size_t next_bad = 0;
  for (size_t k = 0; k + 1 < outs.size(); ++k) {
    const RequestOutput& o = outs[k];
    if (want.count(o.id)) {
      check_same_samples(o, want.at(o.id));
      continue;
    }
    const std::string& what = bad[next_bad++].second;
    INFO(o.error);
    CHECK(o.status == RequestStatus::error);
    CHECK(o.refusal == Refusal::invalid);
    CHECK(o.samples.empty());
    CHECK(o.error.find(what) != std::string::npos);
    CHECK(o.error.find(o.id) != std::string::npos);
  }
  CHECK(next_bad == bad.size());
  CHECK(outs.back().status == RequestStatus::error);
  CHECK(outs.back().error.find("already in flight") != std::string::npos);
  CHECK(outs.back().refusal == Refusal::duplicate_id);
  CHECK(e.blocks().num_free_blocks() == small_options().num_blocks);
}

TEST_CASE("engine tells a full queue from a bad request by the kind of refusal", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 807);
  EngineOptions o = small_options();
  o.max_waiting = 2;
  Engine e(w, o);
  e.submit(make_request("q0", random_prompt(4, c.vocab_size, 1), 1, 0, 3));
  e.submit(make_request("q1", random_prompt(4, c.vocab_size, 2), 1, 0, 3));
  e.submit(make_request("q2", random_prompt(4, c.vocab_size, 3), 1, 0, 3));
  Request bad = make_request("q3", random_prompt(4, c.vocab_size, 4), 1, 0, 3);
  bad.params.top_p = 2.0f;
  e.submit(bad);
  std::vector<RequestOutput> refused = e.poll();
  REQUIRE(refused.size() == 2);
  CHECK(refused[0].id == "q2");
  CHECK(refused[0].refusal == Refusal::queue_full);
  CHECK(refused[1].refusal == Refusal::queue_full);  // a full queue is told before the request
  while (e.has_work()) e.step();
  for (const RequestOutput& r : e.poll()) CHECK(r.refusal == Refusal::none);
  e.submit(bad);
  refused = e.poll();
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].refusal == Refusal::invalid);
  CHECK(std::string(refusal_name(refused[0].refusal)) == "invalid");
}

TEST_CASE("engine weight swap flushes the prefix cache and stamps the new version", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w1(c, DType::f32), w2(c, DType::f32);
  fill_random(w1, 807);
  fill_random(w2, 808);
  const std::vector<Request> rs = mixed_requests(c.vocab_size);
  Engine e(w1, small_options());
  e.generate({rs[1]});  // its prompt is now in the prefix cache, computed by w1
  e.submit(rs[0]);
  e.step();
  e.step();
  e.set_weights(w2, 7);
  CHECK(e.weight_version() == 7);
  while (e.has_work()) e.step();
  const RequestOutput mid = e.poll().at(0);
  CHECK(mid.samples[0].first_weight_version == 0);
  CHECK(mid.samples[0].weight_version == 7);
  CHECK(mid.samples[0].token_versions.size() == mid.samples[0].tokens.size());
  const RequestOutput after = e.generate({rs[1]})[0];
  CHECK(after.num_cached_prompt_tokens == 0);
  CHECK(after.samples[0].weight_version == 7);
  CHECK(after.samples[0].first_weight_version == 7);
  Engine fresh(w2, small_options());
  check_same_samples(after, fresh.generate({rs[1]})[0]);
}

TEST_CASE(
    "engine samples running across a weight swap continue on the new weights with per-token "
    "versions and logprobs",
    "[unit]") {
  // A partial rollout: every sample of every request is paused at a step boundary, the weights
  // swapped, and resumed on the new ones. Each token carries the version that produced it, and its
  // logprob is the training forward's under that version's weights, bitwise: what the trainer's
  // per-token importance ratio needs as the behaviour logprob.
  const model::ModelConfig c = tiny_config();
  model::Weights w1(c, DType::f32), w2(c, DType::f32);
  fill_random(w1, 811);
  fill_random(w2, 812);
  std::vector<Request> rs = mixed_requests(c.vocab_size);
  for (Request& r : rs) r.params.temperature = 0.7f;
  Engine e(w1, small_options());
  for (const Request& r : rs) e.submit(r);
  for (int i = 0; i < 4; ++i) e.step();
  e.set_weights(w2, 3);
  while (e.has_work()) e.step();
  std::map<std::string, RequestOutput> got = by_id(e.poll());
  std::vector<RequestOutput> outs;
  for (const Request& r : rs) outs.push_back(got.at(r.id));

  int64_t old_tokens = 0, new_tokens = 0, partial = 0;
  for (const RequestOutput& o : outs)
    for (const SampleOutput& smp : o.samples) {
      INFO(o.id << " sample " << smp.index);
      REQUIRE(smp.token_versions.size() == smp.tokens.size());
      CHECK(std::is_sorted(smp.token_versions.begin(), smp.token_versions.end()));
      CHECK(smp.token_versions.front() == smp.first_weight_version);
      CHECK(smp.token_versions.back() == smp.weight_version);
      const auto n1 = std::count(smp.token_versions.begin(), smp.token_versions.end(), 0u);
      CHECK(n1 + std::count(smp.token_versions.begin(), smp.token_versions.end(), 3u) ==
            static_cast<int64_t>(smp.tokens.size()));
      old_tokens += n1;
      new_tokens += static_cast<int64_t>(smp.tokens.size()) - n1;
      partial += n1 > 0 && n1 < static_cast<int64_t>(smp.tokens.size()) ? 1 : 0;
    }
  CHECK(old_tokens > 0);
  CHECK(partial > 0);
  // Each token's logprob equals the forward under its own version's weights: every token counted
  // once by one of the two comparisons.
  const auto equal_under = [&](const model::Weights& w, uint64_t version) {
    int64_t equal = 0;
    for (size_t r = 0; r < outs.size(); ++r) {
      for (const SampleOutput& smp : outs[r].samples) {
        std::vector<std::vector<int32_t>> seq = {rs[r].prompt};
        seq[0].insert(seq[0].end(), smp.tokens.begin(), smp.tokens.end());
        model::Decoder dec(w, {.max_tokens = 256});
        const model::PackedBatch batch = model::PackedBatch::from_sequences(seq);
        Tensor lp = Tensor::empty({batch.num_tokens()}, DType::f32);
        dec.forward(batch, lp, Tensor(), 0.7f);
        const int64_t n = static_cast<int64_t>(rs[r].prompt.size());
        for (size_t t = 0; t < smp.tokens.size(); ++t)
          if (smp.token_versions[t] == version)
            equal += std::memcmp(&smp.logprobs[t],
                                 lp.data_as<float>() + batch.row_of(0, n + static_cast<int64_t>(t)),
                                 4) == 0
                         ? 1
                         : 0;
      }
    }
    return equal;
  };
  CHECK(equal_under(w1, 0) == old_tokens);
  CHECK(equal_under(w2, 3) == new_tokens);
}

TEST_CASE(
    "engine samples started before an after_started swap finish on the old weights and later ones "
    "start on the new",
    "[unit]") {
  // Without partial rollouts: what runs when the new weights arrive finishes under the old ones
  // (the engine admits nothing new meanwhile), then the swap; every sample is one version's, and
  // each is what an engine holding that version alone samples, bitwise.
  const model::ModelConfig c = tiny_config();
  model::Weights w1(c, DType::f32), w2(c, DType::f32);
  fill_random(w1, 821);
  fill_random(w2, 822);
  std::vector<Request> rs = mixed_requests(c.vocab_size);
  for (Request& r : rs) r.params.temperature = 0.7f;
  Request later = make_request("later", random_prompt(6, c.vocab_size, 15), 2, 20, 13);
  EngineOptions o = small_options();
  o.max_seqs = 4;  // b's 3 samples and a fill it: c and d wait, not started, at the swap
  Engine e(w1, o);
  for (const Request& r : rs) e.submit(r);
  for (int i = 0; i < 3; ++i) e.step();
  e.set_weights(w2, 3, Engine::Swap::after_started);
  CHECK(e.swap_pending());
  CHECK(e.weight_version() == 0);
  e.submit(later);
  rs.push_back(later);
  while (e.has_work()) e.step();
  CHECK_FALSE(e.swap_pending());
  CHECK(e.weight_version() == 3);
  std::map<std::string, RequestOutput> got = by_id(e.poll());
  Engine only1(w1, o), only2(w2, o);
  int on_old = 0, on_new = 0;
  for (const Request& r : rs) {
    const RequestOutput& out = got.at(r.id);
    INFO(r.id);
    REQUIRE(out.status == RequestStatus::done);
    const uint64_t v = out.samples[0].first_weight_version;
    for (const SampleOutput& smp : out.samples) {
      CHECK(smp.first_weight_version == v);
      CHECK(smp.weight_version == v);
      CHECK(std::count(smp.token_versions.begin(), smp.token_versions.end(), v) ==
            static_cast<int64_t>(smp.tokens.size()));
    }
    check_same_samples(out, (v == 0 ? only1 : only2).generate({r})[0]);
    (v == 0 ? on_old : on_new) += 1;
  }
  CHECK(got.at("b").samples[0].first_weight_version == 0);  // started before the swap
  CHECK(got.at("later").samples[0].first_weight_version == 3);
  CHECK(on_old >= 1);
  CHECK(on_new >= 2);  // later, and at least one request that waited
  // Nothing started: the swap happens at once.
  e.set_weights(w1, 4, Engine::Swap::after_started);
  CHECK_FALSE(e.swap_pending());
  CHECK(e.weight_version() == 4);
}

TEST_CASE("engine releases its memory between rollouts and then generates as a new engine",
          "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w1(c, DType::f32), w2(c, DType::f32);
  fill_random(w1, 811);
  fill_random(w2, 812);
  const std::vector<Request> rs = mixed_requests(c.vocab_size);
  Engine e(w1, small_options());
  e.generate({rs[0], rs[1]});
  e.submit(rs[2]);
  e.step();
  CHECK_THROWS_WITH(e.release_memory(), Catch::Contains("finish or abort"));
  while (e.has_work()) e.step();
  e.poll();
  e.release_memory();
  CHECK_FALSE(e.memory_reserved());
  CHECK(e.blocks().k_cache().empty());
  CHECK(e.blocks().num_cached_blocks() == 0);
  e.release_memory();  // twice is fine
  e.set_weights(w2, 3);
  CHECK_FALSE(e.memory_reserved());  // a weight swap does not take the memory back
  const std::vector<RequestOutput> again = e.generate(rs);  // step() reserves it
  CHECK(e.memory_reserved());
  CHECK(e.blocks().k_cache().size() == static_cast<size_t>(c.num_layers));
  Engine fresh(w2, small_options());
  const std::vector<RequestOutput> want = fresh.generate(rs);
  for (size_t i = 0; i < rs.size(); ++i) check_same_samples(again[i], want[i]);
  e.release_memory();
  e.reserve_memory();
  CHECK(e.blocks().num_free_blocks() == e.blocks().num_blocks());
  check_same_samples(e.generate({rs[3]})[0], want[3]);
}

TEST_CASE("engine top logprobs rank the most likely tokens with the trainer's logprobs", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 811);
  std::vector<Request> rs = mixed_requests(c.vocab_size);  // d is greedy
  for (Request& r : rs) r.params.top_logprobs = 4;
  Engine e(w, small_options());
  const std::vector<RequestOutput> outs = e.generate(rs);
  int64_t hits = 0;
  for (size_t r = 0; r < outs.size(); ++r)
    for (const SampleOutput& s : outs[r].samples) {
      REQUIRE(s.top_logprobs.size() == s.tokens.size());
      for (size_t t = 0; t < s.tokens.size(); ++t) {
        INFO("request " << outs[r].id << " token " << t);
        const auto& top = s.top_logprobs[t];
        REQUIRE(top.size() == 4);
        for (size_t i = 1; i < top.size(); ++i) CHECK(top[i - 1].logprob >= top[i].logprob);
        CHECK(top[0].logprob >= s.logprobs[t]);
        if (rs[r].params.temperature == 0.0f) CHECK(top[0].token == s.tokens[t]);
        for (const TokenLogprob& alt : top)
          if (alt.token == s.tokens[t]) {
            CHECK(std::memcmp(&alt.logprob, &s.logprobs[t], 4) == 0);
            ++hits;
          }
      }
    }
  CHECK(hits > 20);
}

TEST_CASE("engine rejects bad options and mismatched weights with one clear error", "[unit]") {
  const model::ModelConfig c = tiny_config();
  model::Weights w(c, DType::f32);
  fill_random(w, 810);
  auto error_of = [&](auto edit) -> std::string {
    EngineOptions o = small_options();
    edit(o);
    try {
      Engine e(w, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  CHECK_THAT(error_of([](EngineOptions& o) { o.block_size = 0; }), Catch::Contains("block_size"));
  CHECK_THAT(error_of([](EngineOptions& o) { o.num_blocks = -1; }), Catch::Contains("num_blocks"));
  CHECK_THAT(error_of([](EngineOptions& o) { o.max_batch_tokens = 0; }),
             Catch::Contains("max_batch_tokens"));
  CHECK_THAT(error_of([](EngineOptions& o) { o.max_context = 257; }),
             Catch::Contains("max_context"));
  Engine e(w, small_options());
  model::ModelConfig other = c;
  other.vocab_size = 102;
  model::Weights w2(other, DType::f32);
  CHECK_THROWS_AS(e.set_weights(w2, 1), Error);
  CHECK(e.weight_version() == 0);
}

TEST_CASE("engine on CUDA serves mixed groups with the CUDA training forward's logprobs", "[gpu]") {
  test::skip_without_gpu();
  for (bool qwen3 : {false, true}) {
    INFO((qwen3 ? "qwen3" : "llama"));
    const model::ModelConfig c = tiny_config(qwen3);
    model::Weights host(c, DType::f32);
    fill_random(host, qwen3 ? 910 : 810);
    model::Weights w(c, DType::f32, Device::cuda());
    w.copy_from(host);
    EngineOptions o = small_options();
    o.max_batch_tokens = 10;  // chunked prefill on the device too
    Engine engine(w, o);
    std::vector<Request> rs = mixed_requests(c.vocab_size);
    for (Request& r : rs) r.params.temperature = 0.7f;
    const std::vector<RequestOutput> outs = engine.generate(rs);
    for (const RequestOutput& o : outs) REQUIRE(o.status == RequestStatus::done);
    // The engine's logprobs should be the CUDA training forward's bits (one set of kernels); the
    // difference is measured and reported either way.
    const ForwardComparison cmp = compare_with_forward(w, rs, outs, 0.7f);
    WARN("CUDA engine vs CUDA training forward: " << cmp.equal << " of " << cmp.compared
                                                  << " logprobs bitwise equal, max |delta| "
                                                  << cmp.max_abs);
    CHECK(cmp.compared == 7 + 3 * 9 + 2 * 6 + 11);
    CHECK(cmp.max_abs < 1e-4);
    CHECK(engine.blocks().num_free_blocks() == o.num_blocks);
  }
}

}  // namespace tandem::rollout

namespace tandem::rollout {

TEST_CASE("engine memory check names the key of the larger of KV cache and batch", "[unit]") {
  const model::ModelConfig c = tiny_config();
  EngineOptions o;
  o.num_blocks = 100000;
  o.max_batch_tokens = 64;
  const EngineMemory m = engine_memory(c, o);
  CHECK(m.kv_cache_bytes ==
        static_cast<double>(BlockManager::bytes_per_block(c, o.block_size)) * 100000);
  CHECK(m.batch_bytes == static_cast<double>(model::Decoder::plan_bytes(c, 64, false)));
  REQUIRE(m.kv_cache_bytes > m.batch_bytes);
  const EngineMemoryKeys keys{"cache.blocks (a.toml:3:1)", "cache.tokens (a.toml:4:1)"};
  const double total = m.kv_cache_bytes + m.batch_bytes;
  CHECK_NOTHROW(check_engine_memory(c, o, total, keys));
  CHECK_NOTHROW(check_engine_memory(c, o, 0, keys));  // unknown: not checked
  CHECK_THROWS_WITH(check_engine_memory(c, o, total - 1, keys),
                    Catch::Contains(fmt::format("{:.0f} bytes", m.kv_cache_bytes)) &&
                        Catch::Contains(fmt::format("the {:.0f} bytes", total - 1)) &&
                        Catch::EndsWith("of memory available: lower cache.blocks (a.toml:3:1)"));
  o.num_blocks = 4;
  o.max_batch_tokens = 100000;
  const EngineMemory b = engine_memory(c, o);
  REQUIRE(b.batch_bytes > b.kv_cache_bytes);
  CHECK_THROWS_WITH(check_engine_memory(c, o, b.batch_bytes, keys),
                    Catch::EndsWith("lower cache.tokens (a.toml:4:1)"));
}

}  // namespace tandem::rollout
