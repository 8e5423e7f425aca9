// Tests of the rollout service (rollout/service/) on a tiny random SmolLM2-vocabulary model:
// concurrent clients get the outputs of sequential ones, typed refusals (token, parameters,
// bounds, stale weights, overload), malformed and random frames close one connection only, weight
// updates from a checkpoint, the serve config, `tandem serve` draining on SIGTERM under load, the
// example Python client, and a pool of two workers one of which is killed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <thrift/transport/TSocket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/utf8.h"
#include "model/loader.h"
#include "model/prompt.h"
#include "rollout/service/client.h"
#include "rollout/service/client_pool.h"
#include "rollout/service/serve_config.h"
#include "rollout/service/server.h"
#include "rpc/bounded_thrift.h"
#include "tests/model/tiny_model.h"
#include "tests/rpc/raw_frames.h"
#include "tests/testutil.h"

namespace tandem::rollout {
namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

const fs::path kRepo = TANDEM_SOURCE_DIR;

// The tiny model's directory, written once per test process.
std::string tiny_model_dir() {
  static test::TempDir dir("rollout-server-model");
  static const std::string path = [] {
    test::write_tiny_smollm2_hf(dir.file("model"));
    return dir.file("model");
  }();
  return path;
}

EngineOptions small_engine() {
  EngineOptions e;
  e.num_blocks = 256;
  e.max_context = 256;
  e.max_batch_tokens = 256;
  e.max_seqs = 32;
  return e;
}

ServerOptions small_server(std::string token = "") {
  ServerOptions o;
  o.token = std::move(token);
  o.max_in_flight = 8;
  o.max_prompt_tokens = 96;
  o.max_new_tokens = 32;
  o.max_n = 4;
  o.max_message_bytes = 64 << 10;
  return o;
}

std::unique_ptr<RolloutServer> start_server(ServerOptions o = small_server()) {
  model::LoadedModel m = model::load_model(tiny_model_dir());
  const model::PromptFormat format = model::prompt_format(m.tok(), "auto");
  return std::make_unique<RolloutServer>(std::move(m), format, small_engine(), std::move(o));
}

RolloutClient client_of(int port, const std::string& token = "", int64_t retries = 2) {
  return RolloutClient(ClientOptions{.address = "127.0.0.1:" + std::to_string(port),
                                     .timeout_ms = 30000,
                                     .retries = retries,
                                     .backoff_ms = 20,
                                     .token = token});
}

rpc::GenerateRequest token_request(const std::string& id, std::vector<int32_t> prompt, int n,
                                   int64_t seed, int max_tokens = 6) {
  rpc::GenerateRequest r;
  r.request_id = id;
  r.prompt_tokens = std::move(prompt);
  r.params.n = n;
  r.params.seed = seed;
  r.params.max_tokens = max_tokens;
  r.params.temperature = 0.9;
  r.params.stop_at_eos = false;
  return r;
}

// Seeded requests in the three prompt forms, with groups and filters.
std::vector<rpc::GenerateRequest> mixed_requests() {
  std::vector<rpc::GenerateRequest> rs;
  std::mt19937 rng(5);
  for (int i = 0; i < 12; ++i) {
    rpc::GenerateRequest r =
        token_request(fmt::format("r{}", i), {}, 1 + i % 3, 100 + i, 4 + i % 5);
    if (i % 3 == 0) {
      for (int t = 0; t < 5 + i; ++t)
        r.prompt_tokens.push_back(static_cast<int32_t>(rng() % 49152));
    } else if (i % 3 == 1) {
      r.prompt_text = fmt::format("Question {}: what is {} plus {}?", i, i * 7, i + 3);
    } else {
      rpc::Message m;
      m.role = "user";
      m.content = fmt::format("Add {} and {}.", i, 2 * i);
      r.messages.push_back(m);
    }
    if (i % 4 == 1) r.params.top_k = 20;
    if (i % 4 == 2) r.params.top_p = 0.8;
    rs.push_back(std::move(r));
  }
  return rs;
}

void check_same(const rpc::GenerateResponse& a, const rpc::GenerateResponse& b) {
  INFO("request " << a.request_id);
  CHECK(a.request_id == b.request_id);
  CHECK(a.prompt_tokens == b.prompt_tokens);
  REQUIRE(a.samples.size() == b.samples.size());
  for (size_t i = 0; i < a.samples.size(); ++i) {
    CHECK(a.samples[i].tokens == b.samples[i].tokens);
    CHECK(a.samples[i].logprobs == b.samples[i].logprobs);
    CHECK(a.samples[i].text == b.samples[i].text);
    CHECK(a.samples[i].finish_reason == b.samples[i].finish_reason);
  }
}

// A CallError of the given kind from `fn`.
template <typename Fn>
void check_failure(CallFailure kind, const std::string& text, Fn&& fn) {
  try {
    fn();
    FAIL("expected a " << call_failure_name(kind) << " failure");
  } catch (const CallError& e) {
    INFO(e.what());
    CHECK(std::string(call_failure_name(e.failure())) == call_failure_name(kind));
    CHECK_THAT(e.what(), Contains(text));
  }
}

// --- raw frames ---------------------------------------------------------------------------------

// generate() whose request's prompt_tokens list claims 0x7fffffff ints.
std::string list_bomb() {
  const std::string call = test::wire_i32(static_cast<int32_t>(0x80010001)) + test::wire_i32(8) +
                           "generate" + test::wire_i32(1) + std::string(1, 12) +
                           std::string("\0\1", 2);
  return test::framed(call + std::string(1, 15) + std::string("\0\2", 2) + std::string(1, 8) +
                      test::wire_i32(0x7fffffff));
}

// Sends bytes on a fresh connection; true when the server closed it (or answered) within 3 s.
bool send_and_see_close(int port, const std::string& bytes) {
  const int fd = test::connect_loopback(port);
  test::send_all(fd, bytes);
  shutdown(fd, SHUT_WR);  // a frame cut short ends here rather than waiting for its rest
  pollfd p{fd, POLLIN, 0};
  const bool closed = poll(&p, 1, 3000) == 1;
  close(fd);
  return closed;
}

}  // namespace

TEST_CASE("rollout server answers concurrent clients as it answers them one at a time", "[unit]") {
  auto server = start_server();
  const std::vector<rpc::GenerateRequest> requests = mixed_requests();
  RolloutClient one = client_of(server->port());
  std::vector<rpc::GenerateResponse> sequential;
  for (const auto& r : requests) sequential.push_back(one.generate(r));

  std::vector<rpc::GenerateResponse> concurrent(requests.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      RolloutClient c = client_of(server->port());
      for (size_t i = static_cast<size_t>(t); i < requests.size(); i += 4)
        concurrent[i] = c.generate(requests[i]);
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < requests.size(); ++i) check_same(concurrent[i], sequential[i]);

  // The same as the engine in this process on the rendered prompts.
  model::LoadedModel m = model::load_model(tiny_model_dir());
  Engine engine(*m.weights, small_engine(), m.tokenizer.get());
  std::vector<Request> direct;
  for (size_t i = 0; i < requests.size(); ++i) {
    const rpc::SamplingParams& p = requests[i].params;
    SamplingParams s;
    s.n = p.n;
    s.temperature = static_cast<float>(p.temperature);
    s.top_p = static_cast<float>(p.top_p);
    s.top_k = p.top_k;
    s.max_tokens = p.max_tokens;
    s.seed = static_cast<uint64_t>(p.seed);
    direct.push_back({requests[i].request_id, sequential[i].prompt_tokens, s});
  }
  const std::vector<RequestOutput> outs = engine.generate(direct);
  for (size_t i = 0; i < outs.size(); ++i) {
    REQUIRE(outs[i].samples.size() == sequential[i].samples.size());
    for (size_t k = 0; k < outs[i].samples.size(); ++k) {
      CHECK(outs[i].samples[k].tokens == sequential[i].samples[k].tokens);
      CHECK(to_valid_utf8(outs[i].samples[k].text) == sequential[i].samples[k].text);
    }
  }
  // The text prompt is tokenized as it is, the messages with the chat template.
  model::PromptFormat as_is;
  as_is.chat = false;
  CHECK(sequential[1].prompt_tokens ==
        model::render_prompt(m.tok(), requests[1].prompt_text, {}, as_is).tokens);
  CHECK_THAT(sequential[2].prompt_text, Contains("<|im_start|>user\nAdd 2 and 4.<|im_end|>"));
  CHECK(server->stats().generated == 2 * static_cast<int64_t>(requests.size()));
}

TEST_CASE("rollout server refuses bad calls with typed errors and serves on", "[unit]") {
  auto server = start_server(small_server("s3cret"));
  const int port = server->port();
  RolloutClient good = client_of(port, "s3cret", 0);
  const rpc::GenerateRequest ok = token_request("ok", {1, 2, 3, 4}, 2, 9);

  SECTION("a missing or wrong token") {
    for (const std::string token : {"", "s3creT", "s3cret-and-more"}) {
      RolloutClient c = client_of(port, token);
      check_failure(CallFailure::unauthorized, token.empty() ? "requires a token" : "wrong token",
                    [&] { c.generate(ok); });
      check_failure(CallFailure::unauthorized, "token", [&] { c.stats(); });
      check_failure(CallFailure::unauthorized, "token", [&] { c.info(); });
      check_failure(CallFailure::unauthorized, "token", [&] { c.abort(); });
      check_failure(CallFailure::unauthorized, "token", [&] { c.pause(); });
      check_failure(CallFailure::unauthorized, "token", [&] { c.commit_weight_update(1, "x"); });
    }
  }

  SECTION("invalid parameters and requests over a bound") {
    auto bad = [&](const std::string& text, auto edit) {
      rpc::GenerateRequest r = ok;
      edit(r);
      check_failure(CallFailure::invalid, text, [&] { good.generate(r); });
    };
    bad("n is 0, expected 1..4", [](auto& r) { r.params.n = 0; });
    bad("n is 5, expected 1..4", [](auto& r) { r.params.n = 5; });
    bad("max_tokens is 33", [](auto& r) { r.params.max_tokens = 33; });
    bad("max_tokens is 0", [](auto& r) { r.params.max_tokens = 0; });
    bad("exactly one of", [](auto& r) { r.prompt_text = "also text"; });
    bad("exactly one of", [](auto& r) { r.prompt_tokens.clear(); });
    bad("at most 96", [](auto& r) { r.prompt_tokens.assign(97, 5); });
    bad("outside the vocabulary", [](auto& r) { r.prompt_tokens[1] = 49152; });
    bad("outside the vocabulary", [](auto& r) { r.prompt_tokens[1] = -1; });
    bad("top_p must be in (0, 1]", [](auto& r) { r.params.top_p = 2.0; });
    bad("temperature must be finite", [](auto& r) { r.params.temperature = -0.5; });
    bad("stop strings", [](auto& r) { r.params.stop.assign(17, "x"); });
    bad("min_weight_version is -1", [](auto& r) { r.min_weight_version = -1; });
    bad("more than max_prompt_tokens", [](auto& r) {
      r.prompt_tokens.clear();
      r.prompt_text = std::string(96 * 64 + 1, 'a');
    });
    check_failure(CallFailure::invalid, "not newer",
                  [&] { good.commit_weight_update(0, tiny_model_dir()); });
    check_failure(CallFailure::invalid, "cannot load",
                  [&] { good.commit_weight_update(1, "/nonexistent/model"); });
  }

  SECTION("a request for newer weights than the worker's") {
    rpc::GenerateRequest r = ok;
    r.min_weight_version = 3;
    check_failure(CallFailure::stale_weights, "version 0, the request wants at least 3",
                  [&] { good.generate(r); });
  }

  SECTION("more calls than max_in_flight") {
    good.pause();
    CHECK(good.stats().paused);
    CHECK_FALSE(good.health());  // cannot generate while paused
    std::vector<std::thread> waiting;
    std::vector<rpc::GenerateResponse> answers(8);
    for (int i = 0; i < 8; ++i)
      waiting.emplace_back([&, i] {
        RolloutClient c = client_of(port, "s3cret", 0);
        answers[static_cast<size_t>(i)] =
            c.generate(token_request(fmt::format("w{}", i), {1, 2, 3}, 1, i, 3));
      });
    for (int tries = 0; tries < 500; ++tries) {
      const rpc::Stats st = good.stats();
      if (st.in_flight == 8 && st.queue_depth == 8) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(good.stats().in_flight == 8);
    CHECK(good.stats().queue_depth == 8);
    check_failure(CallFailure::overloaded, "max_in_flight", [&] { good.generate(ok); });
    CHECK(server->stats().overloaded == 1);
    good.resume();
    for (auto& t : waiting) t.join();
    for (const auto& a : answers) CHECK(a.samples.size() == 1);
    CHECK(good.stats().in_flight == 0);
  }

  SECTION("malformed frames and random bytes close their connection only") {
    CHECK(send_and_see_close(port, list_bomb()));
    CHECK(
        send_and_see_close(port, test::wire_i32(1 << 20) + "generate"));  // over max_message_bytes
    CHECK(send_and_see_close(port, test::framed(std::string(40, '\xff'))));
    const int64_t refused_before_fuzz = server->stats().refused;
    CHECK(refused_before_fuzz >= 2);
    // Random bytes, random framed payloads and valid-looking headers with garbage, for a bounded
    // time, on fresh connections.
    std::mt19937_64 rng(77);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    int sent = 0;
    while (std::chrono::steady_clock::now() < until) {
      std::string s(1 + rng() % 96, '\0');
      for (char& c : s) c = static_cast<char>(rng());
      if (sent % 3 == 1) s = test::framed(s);
      if (sent % 3 == 2)
        s = test::framed(test::wire_i32(static_cast<int32_t>(0x80010001)) + test::wire_i32(8) +
                         "generate" + s);
      send_and_see_close(port, s);
      ++sent;
    }
    CHECK(sent > 20);
    CHECK(server->stats().refused > refused_before_fuzz);
  }

  // Whatever came before, the server serves on.
  const rpc::GenerateResponse r = good.generate(ok);
  CHECK(r.request_id == "ok");
  REQUIRE(r.samples.size() == 2);
  CHECK(r.samples[0].tokens.size() == 6);
  CHECK(r.samples[0].logprobs.size() == 6);
  CHECK(good.health());
  const rpc::ServerInfo info = good.info();
  CHECK(info.protocol_version == 2);
  CHECK(info.vocab_size == 49152);
  CHECK(info.max_n == 4);
  CHECK(info.tp_size == 1);
}

TEST_CASE("rollout server takes new weights from a checkpoint and stamps their version", "[unit]") {
  test::TempDir tmp("rollout-server-weights");
  test::write_tiny_smollm2_hf(tmp.file("v1"), 23);
  auto server = start_server();
  RolloutClient c = client_of(server->port());
  const rpc::GenerateRequest r = token_request("x", {1, 20, 300, 4000}, 2, 4, 8);
  const rpc::GenerateResponse before = c.generate(r);
  CHECK(before.samples[0].weight_version == 0);

  c.begin_weight_update(1);
  CHECK(c.stats().paused);
  CHECK(c.commit_weight_update(1, tmp.file("v1")) == 1);
  CHECK_FALSE(c.stats().paused);
  CHECK(c.weight_version() == 1);
  rpc::GenerateRequest newer = r;
  newer.min_weight_version = 1;
  const rpc::GenerateResponse after = c.generate(newer);
  REQUIRE(after.samples.size() == 2);
  CHECK(after.samples[0].weight_version == 1);
  CHECK(after.samples[0].first_weight_version == 1);
  CHECK(after.samples[0].logprobs != before.samples[0].logprobs);  // other weights
  check_failure(CallFailure::invalid, "not newer",
                [&] { c.commit_weight_update(1, tmp.file("v1")); });
  // Back to the first weights as version 2: the first outputs again.
  CHECK(c.commit_weight_update(2, tiny_model_dir()) == 2);
  const rpc::GenerateResponse again = c.generate(r);
  CHECK(again.samples[0].tokens == before.samples[0].tokens);
  CHECK(again.samples[0].weight_version == 2);
}

// A worker that answered a request, then was paused by begin_weight_update(1). When the update
// goes nowhere, it must serve its previous weights again (health, generate, stats), not wait
// until every client's deadline.
struct BegunUpdate {
  std::unique_ptr<RolloutServer> server;
  rpc::GenerateRequest request = token_request("x", {1, 20, 300, 4000}, 2, 4, 8);
  rpc::GenerateResponse before;

  explicit BegunUpdate(ServerOptions o = small_server()) : server(start_server(std::move(o))) {
    RolloutClient c = client_of(server->port());
    before = c.generate(request);
    c.begin_weight_update(1);
    CHECK(c.stats().paused);
  }

  void check_serves_previous_weights(int64_t abandoned, const std::string& why) {
    // A short deadline: a worker left paused fails this in seconds, not in the default minute.
    RolloutClient c(ClientOptions{.address = "127.0.0.1:" + std::to_string(server->port()),
                                  .timeout_ms = 5000,
                                  .retries = 0});
    const rpc::Stats st = c.stats();
    CHECK_FALSE(st.paused);
    CHECK(st.weight_version == 0);
    CHECK(st.__isset.weight_updates_abandoned);
    CHECK(st.weight_updates_abandoned == abandoned);
    CHECK_THAT(st.last_weight_update_error, Contains(why));
    CHECK(c.health());
    const rpc::GenerateResponse again = c.generate(request);
    REQUIRE(again.samples.size() == before.samples.size());
    CHECK(again.samples[0].tokens == before.samples[0].tokens);
    CHECK(again.samples[0].weight_version == 0);
  }
};

TEST_CASE("a rollout worker whose weight commit fails serves its previous weights again",
          "[unit]") {
  BegunUpdate w;
  RolloutClient c = client_of(w.server->port());
  check_failure(CallFailure::invalid, "cannot load '/nonexistent/model'",
                [&] { c.commit_weight_update(1, "/nonexistent/model"); });
  w.check_serves_previous_weights(1, "cannot load '/nonexistent/model'");

  // A commit refused for its version ends the update all the same.
  c.begin_weight_update(1);
  check_failure(CallFailure::invalid, "not newer",
                [&] { c.commit_weight_update(0, tiny_model_dir()); });
  w.check_serves_previous_weights(2, "not newer");
}

TEST_CASE("a rollout worker ends a weight update that outlives its bound and serves on", "[unit]") {
  ServerOptions o = small_server();
  o.weight_update_timeout_s = 0.3;
  BegunUpdate w(o);  // and no commit: its client died
  RolloutClient c = client_of(w.server->port());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (c.stats().paused && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  w.check_serves_previous_weights(1, "limits.weight_update_timeout_s");
  // A later update still takes.
  c.begin_weight_update(1);
  CHECK(c.commit_weight_update(1, tiny_model_dir()) == 1);
  CHECK(c.stats().weight_updates_abandoned == 1);

  // The bound is the serve key limits.weight_update_timeout_s.
  const std::string base = "[model]\npath = \"m\"\n[limits]\n";
  CHECK(parse_serve_config(base, "serve.toml").server.weight_update_timeout_s == 300);
  CHECK(parse_serve_config(base + "weight_update_timeout_s = 2.5\n", "serve.toml")
            .server.weight_update_timeout_s == 2.5);
  CHECK_THROWS_WITH(parse_serve_config(base + "weight_update_timeout_s = 0\n", "serve.toml"),
                    Contains("limits.weight_update_timeout_s"));
}

TEST_CASE("resume ends a weight update begun and the worker serves its previous weights",
          "[unit]") {
  BegunUpdate w;
  client_of(w.server->port()).resume();
  w.check_serves_previous_weights(1, "resume()");
}

TEST_CASE("serve config refuses a public address without a token and names the key", "[unit]") {
  const std::string base = "[model]\npath = \"m\"\n";
  const ServeConfig c = parse_serve_config(base, "serve.toml");
  CHECK(c.server.host == "127.0.0.1");
  CHECK(c.server.port == 9100);
  CHECK(c.engine.num_blocks == EngineOptions{}.num_blocks);
  const std::vector<std::string> public_host = {"server.host=0.0.0.0"};
  CHECK_THROWS_WITH(parse_serve_config(base, "serve.toml", public_host),
                    Contains("server.host") && Contains("requires one"));
  const std::vector<std::string> missing_env = {"server.token_env=TANDEM_TEST_NO_SUCH_VARIABLE"};
  CHECK_THROWS_WITH(parse_serve_config(base, "serve.toml", missing_env),
                    Contains("TANDEM_TEST_NO_SUCH_VARIABLE is not set"));
  ::setenv("TANDEM_TEST_SERVE_TOKEN", "tok", 1);
  const std::vector<std::string> with_token = {"server.host=0.0.0.0",
                                               "server.token_env=TANDEM_TEST_SERVE_TOKEN"};
  CHECK(parse_serve_config(base, "serve.toml", with_token).server.token == "tok");
  CHECK_THROWS_WITH(parse_serve_config(base + "[limits]\nmax_n = 999\n", "serve.toml"),
                    Contains("serve.toml:4") && Contains("engine.max_seqs"));
  CHECK_THROWS_WITH(parse_serve_config(base + "[server]\nprot = 1\n", "serve.toml"),
                    Contains("server.port"));
  CHECK_NOTHROW(load_serve_config((kRepo / "configs/serve.toml").string()));
  for (const char* host : {"127.0.0.1", "127.1.2.3", "::1", "localhost"})
    CHECK(is_loopback_host(host));
  for (const char* host : {"0.0.0.0", "10.0.0.1", "127.0.0.1.example.com", "::", "128.0.0.1"})
    CHECK_FALSE(is_loopback_host(host));
}

TEST_CASE("docs serve.md documents every key of the serve schema", "[unit]") {
  const fs::path docs_path = kRepo / "docs/serve.md";
  const std::string generated = serve_config_markdown();
  auto read = [](const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  if (std::getenv("TANDEM_REGENERATE_DOCS")) {  // rewrites the generated part of docs/serve.md
    std::string doc = read(docs_path);
    const std::string begin = "<!-- BEGIN GENERATED: serve schema -->\n";
    const std::string end = "<!-- END GENERATED -->";
    auto b = doc.find(begin), e = doc.find(end);
    REQUIRE(b != std::string::npos);
    REQUIRE(e != std::string::npos);
    doc = doc.substr(0, b + begin.size()) + generated + doc.substr(e);
    std::ofstream(docs_path) << doc;
  }
  const std::string doc = read(docs_path);
  for (const auto& f : serve_schema()->fields()) CHECK_THAT(doc, Contains("`" + f.key + "`"));
  INFO(
      "docs/serve.md is out of date: run TANDEM_REGENERATE_DOCS=1 build/bin/tandem_tests "
      "\"docs serve.md documents every key of the serve schema\"");
  CHECK_THAT(doc, Contains(generated));
}

namespace {

// `tandem serve` on the tiny model with a token, on a free port; its port.
int start_tandem_serve(std::unique_ptr<test::Subprocess>& worker, const test::TempDir& tmp) {
  ::setenv("TANDEM_TEST_ROLLOUT_TOKEN", "w0rker", 1);
  const std::string config = tmp.write("serve.toml", fmt::format(R"([model]
path = "{}"
[engine]
num_blocks = 512
max_context = 256
max_seqs = 64
[server]
port = 0
token_env = "TANDEM_TEST_ROLLOUT_TOKEN"
[limits]
max_in_flight = 16
max_prompt_tokens = 128
max_new_tokens = 64
max_n = 8
)",
                                                                 tiny_model_dir()));
  worker = std::make_unique<test::Subprocess>(
      std::vector<std::string>{std::string(TANDEM_BIN_DIR) + "/tandem", "serve", config});
  const std::string line = worker->wait_for_line("listening on ", 30000);
  INFO(worker->output());
  REQUIRE(!line.empty());
  return std::stoi(line.substr(13));
}

}  // namespace

TEST_CASE("tandem serve drains every accepted request on SIGTERM under load", "[e2e]") {
  test::TempDir tmp("rollout-serve-sigterm");
  std::unique_ptr<test::Subprocess> worker;
  const int port = start_tandem_serve(worker, tmp);

  std::atomic<int64_t> answered{0}, complete{0};
  std::mutex failures_mutex;
  std::vector<std::string> failures;
  std::vector<std::thread> clients;
  for (int t = 0; t < 6; ++t)
    clients.emplace_back([&, t] {
      RolloutClient c = client_of(port, "w0rker", 0);
      for (int i = 0;; ++i) {
        try {
          const rpc::GenerateResponse r =
              c.generate(token_request(fmt::format("c{}-{}", t, i), {1, 2, 3, 4, 5}, 2, i, 24));
          ++answered;
          if (r.samples.size() == 2 && r.samples[1].tokens.size() == 24 && !r.aborted) ++complete;
        } catch (const CallError& e) {
          std::lock_guard lock(failures_mutex);
          failures.push_back(fmt::format("{}: {}", call_failure_name(e.failure()), e.what()));
          return;
        }
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  REQUIRE(::kill(worker->pid(), SIGTERM) == 0);
  const std::string served = worker->wait_for_line("served ", 30000);
  for (auto& t : clients) t.join();
  INFO(worker->output());
  REQUIRE(!served.empty());
  long long generated = -1, accepted = -1;
  REQUIRE(std::sscanf(served.c_str(), "served %lld of %lld accepted", &generated, &accepted) == 2);
  CHECK(worker->stop() == 0);
  // Every call the worker accepted was answered in full, and every answer reached its client;
  // the clients stopped at a refusal (shutting down) or a closed connection, never a lost call.
  CHECK(generated == accepted);
  CHECK(answered.load() == accepted);
  CHECK(complete.load() == answered.load());
  CHECK(answered.load() >= 6);
  REQUIRE(failures.size() == 6);
  for (const std::string& f : failures) {
    INFO(f);
    CHECK((f.rfind("overloaded: ", 0) == 0 || f.rfind("transport: ", 0) == 0));
  }
}

TEST_CASE("tandem serve refuses a KV cache or a batch beyond memory naming the key", "[e2e]") {
  test::TempDir tmp("rollout-serve-huge");
  // engine.num_blocks on line 4; the limits fit the tiny model's 256 positions.
  const std::string config = tmp.write(
      "serve.toml", fmt::format("[model]\npath = \"{}\"\n[engine]\nnum_blocks = 100000000\n"
                                "max_context = 256\n[server]\nport = 0\n[limits]\n"
                                "max_prompt_tokens = 128\nmax_new_tokens = 64\n",
                                tiny_model_dir()));
  test::CommandResult r = test::run_tandem("serve " + config, true, 60);
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("of memory available: lower engine.num_blocks (" + config + ":4:") !=
        std::string::npos);
  r = test::run_tandem("serve " + config + " engine.num_blocks=64 engine.max_batch_tokens=10000000",
                       true, 60);
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("lower engine.max_batch_tokens (override 'engine.max_batch_tokens=") !=
        std::string::npos);
}

TEST_CASE("the example Python rollout client generates through tandem serve", "[interop]") {
  const std::string python = test::require_python_with_thrift();
  test::TempDir tmp("rollout-serve-python");
  std::unique_ptr<test::Subprocess> worker;
  const int port = start_tandem_serve(worker, tmp);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  const std::string requests = tmp.write(
      "requests.jsonl",
      R"({"id": "t", "tokens": [1, 2, 3, 4], "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 3}
{"id": "m", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "n": 1, "max_tokens": 5, "seed": 4}
)");
  const test::CommandResult run = test::run_shell(
      fmt::format("{} {} --address {} --token w0rker --requests {}", python,
                  (kRepo / "examples/python/rollout_client.py").string(), address, requests));
  INFO(run.out);
  REQUIRE(run.status == 0);
  std::vector<nlohmann::json> answers;
  std::istringstream lines(run.out);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] == '{') answers.push_back(nlohmann::json::parse(line));
  REQUIRE(answers.size() == 2);

  // The C++ client gets the same samples for the same requests.
  RolloutClient c = client_of(port, "w0rker");
  rpc::GenerateRequest t = token_request("t", {1, 2, 3, 4}, 2, 3, 6);
  t.params.temperature = 0.8;
  t.params.stop_at_eos = true;
  const rpc::GenerateResponse want_t = c.generate(t);
  CHECK(answers[0]["request_id"] == "t");
  REQUIRE(answers[0]["samples"].size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(answers[0]["samples"][i]["tokens"].get<std::vector<int32_t>>() ==
          want_t.samples[i].tokens);
    CHECK(answers[0]["samples"][i]["text"] == want_t.samples[i].text);
    CHECK(answers[0]["samples"][i]["logprobs"].get<std::vector<double>>() ==
          want_t.samples[i].logprobs);
  }
  rpc::GenerateRequest m = token_request("m", {}, 1, 4, 5);
  m.params.temperature = 1.0;
  m.params.stop_at_eos = true;
  m.messages.resize(1);
  m.messages[0].role = "user";
  m.messages[0].content = "What is 2 + 3?";
  const rpc::GenerateResponse want_m = c.generate(m);
  CHECK(answers[1]["prompt_tokens"].get<std::vector<int32_t>>() == want_m.prompt_tokens);
  CHECK(answers[1]["samples"][0]["tokens"].get<std::vector<int32_t>>() == want_m.samples[0].tokens);

  // A wrong token: a typed refusal, exit status 2.
  const test::CommandResult refused =
      test::run_shell(fmt::format("{} {} --address {} --token nope --tokens 1,2 2>&1", python,
                                  (kRepo / "examples/python/rollout_client.py").string(), address));
  CHECK(refused.status == 2);
  CHECK_THAT(refused.out, Contains("Unauthorized"));
  CHECK(worker->stop() == 0);
}

}  // namespace tandem::rollout

namespace tandem::rollout {

TEST_CASE("a rollout pool finishes every request when one of two workers is killed",
          "[multiproc]") {
  test::TempDir tmp("rollout-pool-kill");
  std::unique_ptr<test::Subprocess> w0, w1;
  const int port0 = start_tandem_serve(w0, tmp);
  const int port1 = start_tandem_serve(w1, tmp);
  std::vector<rpc::GenerateRequest> requests;
  for (int i = 0; i < 24; ++i)
    requests.push_back(token_request(fmt::format("p{}", i),
                                     {1, static_cast<int32_t>(100 + i), 7, 8}, 2, 1000 + i, 16));
  // What one worker answers (the workers serve the same weights; concurrent calls get what
  // sequential ones get).
  std::vector<rpc::GenerateResponse> expected(requests.size());
  {
    std::vector<std::thread> threads;
    for (size_t t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        RolloutClient alone = client_of(port0, "w0rker");
        for (size_t i = t; i < requests.size(); i += 4) expected[i] = alone.generate(requests[i]);
      });
    for (auto& t : threads) t.join();
  }

  RolloutPool pool(
      {.addresses = {fmt::format("127.0.0.1:{}", port0), fmt::format("127.0.0.1:{}", port1)},
       .client = {.timeout_ms = 30000, .retries = 0, .token = "w0rker"},
       .max_in_flight_per_worker = 4});
  std::vector<rpc::GenerateResponse> got;
  std::string error;
  std::thread run([&] {
    try {
      got = pool.generate_all(requests);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  for (int tries = 0; tries < 3000 && pool.workers()[1].answered < 1; ++tries)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  REQUIRE(::kill(w1->pid(), SIGKILL) == 0);
  run.join();
  INFO(error);
  REQUIRE(error.empty());
  REQUIRE(got.size() == requests.size());
  for (size_t i = 0; i < got.size(); ++i) check_same(got[i], expected[i]);
  const std::vector<RolloutPool::Worker> workers = pool.workers();
  INFO("worker 0 answered " << workers[0].answered << ", worker 1 answered " << workers[1].answered
                            << " and failed " << workers[1].failures);
  CHECK(workers[1].failures >= 1);  // calls were in flight on the killed worker
  CHECK(workers[0].answered + workers[1].answered == static_cast<int64_t>(requests.size()));
  CHECK(workers[0].answered > workers[1].answered);
  CHECK(w1->stop() == 128 + SIGKILL);
  CHECK(w0->stop() == 0);
}

}  // namespace tandem::rollout

namespace tandem::rollout {

TEST_CASE("bounded framed connections carry a bigger message after a smaller one", "[unit]") {
  // Regression: the bounded framed transport shrank a connection's message size to each frame's
  // and never let it grow, so a request (or an answer) bigger than the previous one on the same
  // connection closed it silently. The raw client here has no retry to hide that.
  auto server = start_server();
  namespace at = apache::thrift;
  auto socket = std::make_shared<at::transport::TSocket>("127.0.0.1", server->port());
  socket->setRecvTimeout(30000);
  const ThriftLimits limits{};
  auto transport = bounded_framed_transport(socket, limits);
  rpc::RolloutServiceClient c(bounded_binary_protocol(transport, limits));
  transport->open();
  CHECK(c.weight_version("") == 0);
  rpc::ServerInfo info;
  c.info(info, "");  // a bigger answer than weight_version's
  CHECK(info.max_n == 4);
  for (int max_tokens : {1, 4, 16, 32}) {  // ever bigger requests and answers
    rpc::GenerateRequest r = token_request(
        "grow", std::vector<int32_t>(static_cast<size_t>(max_tokens), 7), 2, 1, max_tokens);
    rpc::GenerateResponse out;
    c.generate(out, r);
    REQUIRE(out.samples.size() == 2);
    CHECK(out.samples[1].tokens.size() == static_cast<size_t>(max_tokens));
  }
  rpc::Stats stats;
  c.stats(stats, "");
  CHECK(stats.generated == 4);
  transport->close();
}

}  // namespace tandem::rollout

namespace tandem::rollout {

TEST_CASE("rollout server aborts one request or all and answers their calls", "[unit]") {
  auto server = start_server();
  const int port = server->port();
  RolloutClient control = client_of(port);
  control.pause();  // the calls wait in the engine's queue until aborted
  std::vector<rpc::GenerateResponse> answers(3);
  std::vector<std::thread> calls;
  for (int i = 0; i < 3; ++i)
    calls.emplace_back([&, i] {
      RolloutClient c = client_of(port);
      answers[static_cast<size_t>(i)] =
          c.generate(token_request(i == 0 ? "one" : "other", {1, 2, 3}, 2, i, 8));
    });
  for (int tries = 0; tries < 500 && control.stats().queue_depth < 3; ++tries)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(control.stats().queue_depth == 3);
  CHECK(control.abort("nobody") == 0);
  CHECK(control.abort("one") == 1);
  calls[0].join();
  CHECK(answers[0].request_id == "one");
  CHECK(answers[0].aborted);
  REQUIRE(answers[0].samples.size() == 2);
  CHECK(answers[0].samples[0].finish_reason == rpc::FinishReason::ABORT);
  CHECK(answers[0].samples[0].tokens.empty());
  CHECK(control.abort() == 2);  // every request in flight, two of the same client id
  calls[1].join();
  calls[2].join();
  CHECK(answers[1].aborted);
  CHECK(answers[2].aborted);
  control.resume();
  CHECK(control.stats().in_flight == 0);
  CHECK(control.stats().free_kv_blocks == control.stats().total_kv_blocks);
  CHECK_FALSE(control.generate(token_request("after", {1, 2, 3}, 1, 0, 4)).aborted);
}

}  // namespace tandem::rollout
