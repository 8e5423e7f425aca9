// Partial rollouts on a served worker (a `tandem serve` process of a tiny random model): new
// weights pushed over the wire while a long request generates are taken at a step boundary, the
// samples in flight go on under them, and each token comes back with the version that produced it
// (Sample.token_versions) and that version's logprob, bitwise the training forward's.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "model/decoder.h"
#include "model/loader.h"
#include "rollout/service/client.h"
#include "rollout/service/weight_push.h"
#include "tests/apps/serve_worker.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace tandem::rollout {
namespace {

// `tandem serve` of `model` on a free loopback port, sized for long samples (240 new tokens, 64 a
// request); its port.
int start_long_worker(std::unique_ptr<test::Subprocess>& worker, const test::TempDir& tmp,
                      const std::string& model) {
  return test::serve(worker, tmp.write("serve.toml", fmt::format(R"([model]
path = "{}"
[engine]
num_blocks = 2048
max_seqs = 64
max_context = 256
[server]
port = 0
[limits]
max_prompt_tokens = 16
max_new_tokens = 240
max_n = 64
)",
                                                                 model)));
}

// Each token's logprob under `w` where its version is `version`, against the sample's: how many
// are bitwise equal, of how many of that version.
std::pair<int64_t, int64_t> equal_under(const model::Weights& w, uint64_t version,
                                        const std::vector<int32_t>& prompt, const rpc::Sample& s,
                                        float temperature) {
  std::vector<std::vector<int32_t>> seq = {prompt};
  seq[0].insert(seq[0].end(), s.tokens.begin(), s.tokens.end());
  model::Decoder dec(w, {.max_tokens = 256});
  const model::PackedBatch batch = model::PackedBatch::from_sequences(seq);
  Tensor lp = Tensor::empty({batch.num_tokens()}, DType::f32);
  dec.forward(batch, lp, Tensor(), temperature);
  const auto n = static_cast<int64_t>(prompt.size());
  int64_t equal = 0, of = 0;
  for (size_t t = 0; t < s.tokens.size(); ++t) {
    if (s.token_versions[t] != static_cast<int64_t>(version)) continue;
    ++of;
    const auto want = lp.data_as<float>()[batch.row_of(0, n + static_cast<int64_t>(t))];
    const auto got = static_cast<float>(s.logprobs[t]);
    equal += std::memcmp(&want, &got, sizeof(float)) == 0 ? 1 : 0;
  }
  return {equal, of};
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A worker serving v0 (the tiny model of seed 17), v1 (seed 23) to push to it, and a request of
// 16 samples of 100 tokens, answered once already to time it (alone_s, its answer alone).
struct Served {
  test::TempDir tmp;
  std::unique_ptr<test::Subprocess> worker;
  ClientOptions client;
  std::unique_ptr<model::LoadedModel> v0, v1;
  rpc::GenerateRequest request;
  rpc::GenerateResponse alone;
  double alone_s = 0;

  explicit Served(const std::string& name) : tmp(name) {
    test::write_tiny_smollm2_hf(tmp.file("v0"), 17);
    test::write_tiny_smollm2_hf(tmp.file("v1"), 23);
    const int port = start_long_worker(worker, tmp, tmp.file("v0"));
    client = {.address = "127.0.0.1:" + std::to_string(port), .timeout_ms = 120000};
    v0 = std::make_unique<model::LoadedModel>(model::load_model(tmp.file("v0")));
    v1 = std::make_unique<model::LoadedModel>(model::load_model(tmp.file("v1")));
    request.request_id = "long";
    request.prompt_tokens = {1, 20, 300, 4000, 77};
    request.params.n = 16;
    request.params.seed = 9;
    request.params.max_tokens = 100;
    request.params.temperature = 0.8;
    request.params.stop_at_eos = false;
    RolloutClient c(client);
    const auto t0 = std::chrono::steady_clock::now();
    alone = c.generate(request);
    alone_s = seconds_since(t0);
    REQUIRE(alone.samples.size() == 16);
  }
};

}  // namespace

TEST_CASE(
    "a served worker takes weights pushed mid-request at a step boundary and its samples resume "
    "on them with per-token versions",
    "[multiproc]") {
  Served w("partial-rollout");
  RolloutClient generating(w.client), pushing(w.client);
  const rpc::GenerateRequest& r = w.request;
  rpc::GenerateResponse out;
  const auto t1 = std::chrono::steady_clock::now();
  double generate_s = 0;
  std::thread request([&] {
    out = generating.generate(r);
    generate_s = seconds_since(t1);
  });
  // The push lands a quarter into the request.
  std::this_thread::sleep_for(std::chrono::duration<double>(w.alone_s / 4));
  const WeightPushResult pushed = push_weights(pushing, *w.v1->weights, 1, 64 << 20);
  request.join();
  INFO(w.worker->output());
  INFO("the request took " << generate_s << " s, " << w.alone_s << " s alone");
  CHECK(pushed.sent);
  REQUIRE(out.samples.size() == 16);

  int64_t on_v0 = 0, on_v1 = 0, partial = 0;
  for (size_t i = 0; i < out.samples.size(); ++i) {
    const rpc::Sample& s = out.samples[i];
    INFO("sample " << i);
    REQUIRE(s.token_versions.size() == s.tokens.size());
    CHECK(std::is_sorted(s.token_versions.begin(), s.token_versions.end()));
    CHECK(s.token_versions.front() == s.first_weight_version);
    CHECK(s.token_versions.back() == s.weight_version);
    const auto n0 = std::count(s.token_versions.begin(), s.token_versions.end(), 0);
    const auto n1 = std::count(s.token_versions.begin(), s.token_versions.end(), 1);
    CHECK(n0 + n1 == static_cast<int64_t>(s.tokens.size()));
    on_v0 += n0;
    on_v1 += n1;
    if (n0 == 0 || n1 == 0) continue;
    // A partial sample: each of its tokens' logprobs is the forward's under its own version
    // (checked on the first few).
    if (++partial > 3) continue;
    const auto [eq0, of0] = equal_under(*w.v0->weights, 0, r.prompt_tokens, s, 0.8f);
    const auto [eq1, of1] = equal_under(*w.v1->weights, 1, r.prompt_tokens, s, 0.8f);
    CHECK(eq0 == of0);
    CHECK(eq1 == of1);
  }
  CHECK(on_v0 > 0);
  CHECK(on_v1 > 0);
  CHECK(partial > 0);
}

TEST_CASE(
    "a served worker committing weights without partial rollouts finishes started samples on the "
    "old weights and starts later requests on the new",
    "[multiproc]") {
  Served w("no-partial-rollout");
  RolloutClient generating(w.client), pushing(w.client), later(w.client);
  const rpc::GenerateRequest& r = w.request;
  rpc::GenerateResponse out;
  std::chrono::steady_clock::time_point answered;
  std::thread request([&] {
    out = generating.generate(r);
    answered = std::chrono::steady_clock::now();
  });
  std::this_thread::sleep_for(std::chrono::duration<double>(w.alone_s / 4));
  const WeightPushResult pushed = push_weights(pushing, *w.v1->weights, 1, 64 << 20, false);
  const auto committed = std::chrono::steady_clock::now();
  // The worker reports the committed version at once; a request for it waits for the swap.
  CHECK(pushing.weight_version() == 1);
  rpc::GenerateRequest next = r;
  next.request_id = "next";
  next.params.n = 2;
  next.params.max_tokens = 8;
  next.min_weight_version = 1;
  const rpc::GenerateResponse after = later.generate(next);
  request.join();
  INFO(w.worker->output());
  CHECK(pushed.sent);
  CHECK(committed < answered);  // the commit came while the request ran
  REQUIRE(out.samples.size() == 16);
  // Every sample of the running request is the old weights', token for token the request alone.
  for (size_t i = 0; i < out.samples.size(); ++i) {
    INFO("sample " << i);
    const rpc::Sample& s = out.samples[i];
    CHECK(s.weight_version == 0);
    CHECK(std::count(s.token_versions.begin(), s.token_versions.end(), 0) ==
          static_cast<int64_t>(s.tokens.size()));
    CHECK(s.tokens == w.alone.samples[i].tokens);
    CHECK(s.logprobs == w.alone.samples[i].logprobs);
  }
  for (const rpc::Sample& s : after.samples) {
    CHECK(s.first_weight_version == 1);
    CHECK(s.weight_version == 1);
  }
}

}  // namespace tandem::rollout
