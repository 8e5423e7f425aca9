// The remote reward service: the Thrift client against the C++ server on loopback (batches split
// over connections, restarts, hangs, tokens, bad answers), the example servers in C++ and Python.
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/server/TThreadedServer.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TServerSocket.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "core/clock.h"
#include "core/error.h"
#include "rewards/builtins.h"
#include "rewards/factory.h"
#include "rewards/remote.h"
#include "rewards/remote_server.h"
#include "rewards/reward_set.h"
#include "rewards/rpc/RewardService.h"
#include "tests/testutil.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;
using tandem::seconds_since;
namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;

// A reward function whose behaviour the test sets; counts its calls and the samples it saw.
class Scripted : public RewardFunction {
 public:
  using Body = std::function<std::vector<RewardResult>(std::span<const RewardSample>)>;
  explicit Scripted(Body body) : body_(std::move(body)) {}
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override {
    ++calls;
    largest_batch = std::max(largest_batch.load(), samples.size());
    return body_(samples);
  }
  const std::string& name() const override { return name_; }
  std::atomic<int> calls{0};
  std::atomic<size_t> largest_batch{0};

 private:
  std::string name_ = "scripted";
  Body body_;
};

// Seeded arithmetic answers: about half right, some in other notations, one without a reference
// (the math reward cannot judge it) and one cut inside a UTF-8 character.
std::vector<RewardSample> math_samples(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<RewardSample> s(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t truth = static_cast<int64_t>(rng() % 20000) - 10000;
    const int64_t said = rng() % 2 == 0 ? truth : truth + 1 + static_cast<int64_t>(rng() % 7);
    s[i].prompt = "What is " + std::to_string(truth) + "?";
    s[i].completion = i % 3 == 0   ? "so \\boxed{" + std::to_string(said) + "}"
                      : i % 3 == 1 ? "I think\n#### " + std::to_string(said)
                                   : "it is " + std::to_string(said) + ".";
    s[i].answer = "#### " + std::to_string(truth);
    s[i].extra = {{"index", i}};
    s[i].completion_tokens = static_cast<int64_t>(rng() % 64);
    s[i].truncated = rng() % 5 == 0;
  }
  if (n > 1) s[1].answer = "";
  if (n > 2) s[2].completion += " \xE2\x82";  // the first two bytes of a three-byte character
  return s;
}

// What the server receives: the cut character of math_samples as U+FFFD (the local math reward
// finds no number in text that is not UTF-8).
std::vector<RewardSample> as_sent(std::vector<RewardSample> samples) {
  std::string& c = samples.at(2).completion;
  c.replace(c.size() - 2, 2, "\xEF\xBF\xBD");
  return samples;
}

nlohmann::json client_options(int port, nlohmann::json more = nlohmann::json::object()) {
  nlohmann::json o = {{"address", "127.0.0.1:" + std::to_string(port)},
                      {"timeout_ms", 2000},
                      {"retries", 2},
                      {"backoff_ms", 20}};
  o.update(more);
  return o;
}

// A port nothing listens on: bound once by a server that is gone again.
int closed_port() {
  auto fn = std::make_shared<Scripted>([](auto s) { return std::vector<RewardResult>(s.size()); });
  RewardServer server(fn, {});
  return server.port();
}

}  // namespace

TEST_CASE("a remote reward scores a batch split over parallel requests like the local one",
          "[unit]") {
  auto math = std::make_shared<MathAnswerReward>("math", MathAnswerReward::Options{});
  auto counted = std::make_shared<Scripted>([&](auto s) { return math->score(s); });
  RewardServer server(counted, {.name = "math-server"});
  REQUIRE(server.port() > 0);

  auto reward =
      make_reward("remote", "judge",
                  client_options(server.port(), {{"batch_size", 7}, {"max_concurrency", 3}}));
  CHECK(reward->name() == "judge");
  auto& remote = dynamic_cast<RemoteReward&>(*reward);
  const RemoteServerInfo info = remote.info();
  CHECK(info.name == "math-server");
  CHECK(info.protocol_version == 1);
  CHECK(remote.health());

  for (uint64_t seed : {1u, 2u, 3u}) {
    const auto samples = math_samples(40 + seed, seed);
    const auto expected = math->score(as_sent(samples));
    counted->calls = 0;
    const auto got = reward->score(samples);
    REQUIRE(got.size() == samples.size());
    int right = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("sample " << i << ": " << samples[i].completion);
      CHECK(got[i].ok == expected[i].ok);
      CHECK(got[i].value == expected[i].value);
      right += got[i].ok && got[i].value == 1.0;
    }
    CHECK(right > 5);        // the check above compares real answers, not zeros
    CHECK_FALSE(got[1].ok);  // no reference answer: the server's reason comes back
    CHECK_THAT(got[1].error, Contains("reference"));
    CHECK(counted->calls == static_cast<int>((samples.size() + 6) / 7));
    CHECK(counted->largest_batch <= 7);
  }
  CHECK(reward->score({}).empty());

  // The server's stated limit lowers the client's batch size.
  RewardServer small(counted, {.max_batch_size = 4});
  RemoteReward capped("capped",
                      {.address = "127.0.0.1:" + std::to_string(small.port()), .batch_size = 64});
  CHECK(capped.options().batch_size == 4);
  counted->largest_batch = 0;
  CHECK(capped.score(math_samples(9, 4)).size() == 9);
  CHECK(counted->largest_batch == 4);
}

TEST_CASE("remote reward options are checked and a dead address fails at the start", "[unit]") {
  CHECK_THROWS_WITH(make_reward("remote", "r", {{"timeout_ms", 10}}),
                    Contains("reward 'r' (remote): option 'address' is required"));
  CHECK_THROWS_WITH(make_reward("remote", "r", {{"address", "localhost"}}),
                    Contains("'localhost' is not host:port"));
  CHECK_THROWS_WITH(make_reward("remote", "r", {{"address", "127.0.0.1:70000"}}),
                    Contains("port 70000"));
  CHECK_THROWS_WITH(make_reward("remote", "r", {{"address", "127.0.0.1:1"}, {"retries", -1}}),
                    Contains("option 'retries' is -1"));
  CHECK_THROWS_WITH(make_reward("remote", "r", {{"address", "127.0.0.1:1"}, {"tokn", "x"}}),
                    Contains("unknown option 'tokn'"));
  const int port = closed_port();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(make_reward("remote", "judge", client_options(port, {{"retries", 1}})),
                    Contains("reward 'judge' (remote 127.0.0.1:" + std::to_string(port) + ")") &&
                        Contains("info() failed after 2 tries") && Contains("transport error"));
  CHECK(seconds_since(t0) < 5);
}

TEST_CASE("the remote client retries while its server restarts", "[unit]") {
  auto fn = std::make_shared<Scripted>([](auto s) {
    std::vector<RewardResult> r;
    for (const auto& x : s) r.push_back(RewardResult::success(x.completion_tokens * 0.5));
    return r;
  });
  auto server = std::make_unique<RewardServer>(fn, RewardServer::Options{});
  const int port = server->port();
  RemoteReward reward("restarting", {.address = "127.0.0.1:" + std::to_string(port),
                                     .timeout_ms = 2000,
                                     .retries = 4,
                                     .backoff_ms = 100,
                                     .max_concurrency = 2,
                                     .batch_size = 5});
  const auto samples = math_samples(12, 9);
  auto check = [&](const std::vector<RewardResult>& got) {
    REQUIRE(got.size() == samples.size());
    for (size_t i = 0; i < got.size(); ++i)
      CHECK(got[i].value == samples[i].completion_tokens * 0.5);
  };
  check(reward.score(samples));

  // Restarted between calls: the pooled connections are dead, fresh ones reach the new server.
  server.reset();
  server = std::make_unique<RewardServer>(fn, RewardServer::Options{.port = port});
  check(reward.score(samples));

  // Down when the call starts and back 250 ms later: the retries with backoff get through.
  server.reset();
  std::jthread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    server = std::make_unique<RewardServer>(fn, RewardServer::Options{.port = port});
  });
  const auto t0 = std::chrono::steady_clock::now();
  const auto got = reward.score(samples);
  CHECK(seconds_since(t0) >= 0.2);
  restart.join();
  check(got);
}

TEST_CASE("a hung remote server fails the call within its timeout and retries", "[unit]") {
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  auto hung = std::make_shared<Scripted>([&](auto s) {
    std::unique_lock lock(m);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; });
    return std::vector<RewardResult>(s.size());
  });
  RewardServer server(hung, {});
  RemoteReward reward("slow", {.address = "127.0.0.1:" + std::to_string(server.port()),
                               .timeout_ms = 150,
                               .retries = 1,
                               .backoff_ms = 10,
                               .check_on_start = false});
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(reward.score(math_samples(3, 5)),
                    Contains("reward 'slow' (remote 127.0.0.1:") &&
                        Contains("failed after 2 tries") && Contains("transport error"));
  const double took = seconds_since(t0);
  CHECK(took >= 0.3);  // two tries of 150 ms
  CHECK(took < 2.0);

  // Through a RewardSet the failure is a fallback for each sample, counted as thrown.
  RewardSet set({{std::shared_ptr<RewardFunction>(&reward, [](auto*) {}), 1.0, -1.0}},
                {.timeout_s = 10, .max_consecutive_failures = 3});
  const RewardBreakdown b = set.score(math_samples(4, 6));
  CHECK(b.total == std::vector<double>(4, -1.0));
  CHECK(set.stats()[0].thrown == 1);
  CHECK_THAT(b.call_errors[0], Contains("transport error"));
  {
    std::lock_guard lock(m);
    release = true;
  }
  cv.notify_all();
}

TEST_CASE("a remote server refuses a wrong token and an oversized batch with typed errors",
          "[unit]") {
  auto fn = std::make_shared<Scripted>(
      [](auto s) { return std::vector<RewardResult>(s.size(), RewardResult::success(2.5)); });
  RewardServer server(fn, {.token = "s3cret", .max_batch_size = 8});
  const std::string address = "127.0.0.1:" + std::to_string(server.port());

  // info() needs no token, so the start check passes; score does not.
  RemoteReward no_token("judge", {.address = address, .retries = 3, .backoff_ms = 200});
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(no_token.score(math_samples(3, 1)),
                    Contains("reward 'judge' (remote " + address + ")") &&
                        Contains("refused the token (this server requires a token)"));
  CHECK(seconds_since(t0) < 0.2);  // a refusal is not retried
  RemoteReward wrong("judge", {.address = address, .token = "s3cres"});
  CHECK_THROWS_WITH(wrong.score(math_samples(3, 1)), Contains("refused the token (wrong token)"));
  CHECK(fn->calls == 0);

  RemoteReward right("judge", {.address = address, .token = "s3cret"});
  const auto got = right.score(math_samples(20, 2));
  REQUIRE(got.size() == 20);
  for (const auto& r : got) CHECK((r.ok && r.value == 2.5));

  // A client that skipped the start check sends more than the server takes.
  RemoteReward big(
      "judge", {.address = address, .batch_size = 9, .token = "s3cret", .check_on_start = false});
  CHECK_THROWS_WITH(big.score(math_samples(9, 3)),
                    Contains("refused the request: 9 samples in one request, at most 8"));
}

TEST_CASE("a remote server past max_in_flight answers Overloaded and the client's retry gets in",
          "[unit]") {
  // The first call holds the function until the gate opens.
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  std::promise<void> entered;
  std::atomic<bool> first{true};
  auto slow = std::make_shared<Scripted>([&](auto s) {
    if (first.exchange(false)) entered.set_value();
    std::unique_lock lock(m);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return open; });
    std::vector<RewardResult> r;
    for (const auto& x : s) r.push_back(RewardResult::success(x.completion_tokens + 0.25));
    return r;
  });
  RewardServer server(slow, {.max_in_flight = 1});
  const std::string address = "127.0.0.1:" + std::to_string(server.port());
  const auto samples = math_samples(6, 12);
  auto check = [&](const std::vector<RewardResult>& got) {
    REQUIRE(got.size() == samples.size());
    for (size_t i = 0; i < got.size(); ++i)
      CHECK((got[i].ok && got[i].value == samples[i].completion_tokens + 0.25));
  };

  RemoteReward holder("holder", {.address = address});
  auto held = std::async(std::launch::async, [&] { return holder.score(samples); });
  REQUIRE(entered.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready);

  // A second call while the first is scored: refused at once with the typed exception.
  RemoteReward impatient("impatient", {.address = address, .retries = 0});
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(impatient.score(samples),
                    Contains("failed after 1 tries: server overloaded: busy: already 1 score "
                             "calls in flight (max_in_flight)"));
  CHECK(seconds_since(t0) < 1.0);  // not queued behind the held call
  CHECK(server.stats().overloaded == 1);
  CHECK(server.stats().scored == 0);

  // A client with retries is refused while the first call holds the function, then gets in.
  RemoteReward patient("patient", {.address = address, .retries = 6, .backoff_ms = 20});
  auto waited = std::async(std::launch::async, [&] { return patient.score(samples); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (server.stats().overloaded < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(server.stats().overloaded >= 2);
  {
    std::lock_guard lock(m);
    open = true;
  }
  cv.notify_all();
  check(held.get());
  check(waited.get());
  CHECK(server.stats().scored == 2);
  CHECK(slow->calls == 2);  // refused calls never reach the function

  CHECK_THROWS_WITH(RewardServer(slow, {.max_in_flight = 0}), Contains("max_in_flight 0"));
}

namespace {

// A RewardService that breaks the contract: one score too few, or an empty answer.
class ShortHandler : public rpc::RewardServiceIf {
 public:
  void score(rpc::ScoreResponse& out, const rpc::ScoreRequest& request) override {
    out.scores.resize(request.samples.empty() ? 0 : request.samples.size() - 1);
  }
  bool health() override { return true; }
  void info(rpc::ServerInfo& out) override { out.protocol_version = 1; }
};

class ReadySignal : public apache::thrift::server::TServerEventHandler {
 public:
  void preServe() override { ready.set_value(); }
  std::promise<void> ready;
};

}  // namespace

TEST_CASE("a remote server answering the wrong number of scores is an error", "[unit]") {
  namespace at = apache::thrift;
  auto socket = std::make_shared<at::transport::TServerSocket>("127.0.0.1", 0);
  at::server::TThreadedServer server(
      std::make_shared<rpc::RewardServiceProcessor>(std::make_shared<ShortHandler>()), socket,
      std::make_shared<at::transport::TFramedTransportFactory>(),
      std::make_shared<at::protocol::TBinaryProtocolFactory>());
  auto ready = std::make_shared<ReadySignal>();
  std::future<void> listening = ready->ready.get_future();
  server.setServerEventHandler(ready);
  std::jthread serving([&] { server.serve(); });
  REQUIRE(listening.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  REQUIRE(socket->getPort() > 0);

  RemoteReward reward(
      "short", {.address = "127.0.0.1:" + std::to_string(socket->getPort()), .batch_size = 4});
  CHECK_THROWS_WITH(reward.score(math_samples(10, 1)),
                    Contains("reward 'short' (remote 127.0.0.1:") &&
                        Contains("the server returned 3 scores for 4 samples"));
  server.stop();
}

TEST_CASE("the example C++ reward server serves a built-in until SIGTERM", "[e2e]") {
  tandem::test::Subprocess server({std::string(TANDEM_BIN_DIR) + "/tandem_reward_server", "--port",
                                   "0", "--kind", "math_answer", "--token", "t0k",
                                   "--max-in-flight", "4"});
  const std::string line = server.wait_for_line("listening on ", 10000);
  INFO(server.output());
  REQUIRE(!line.empty());
  const int port = std::stoi(line.substr(13));

  auto reward = make_reward("remote", "math", client_options(port, {{"token", "t0k"}}));
  const auto samples = math_samples(30, 11);
  const auto expected = MathAnswerReward("m", {}).score(as_sent(samples));
  const auto got = reward->score(samples);
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].ok == expected[i].ok);
    CHECK(got[i].value == expected[i].value);
  }
  CHECK(server.stop() == 0);
}

TEST_CASE("the example Python reward server scores through the remote client", "[interop]") {
  const std::string python = tandem::test::require_python_with_thrift();
  tandem::test::Subprocess server({python, (kRepo / "examples/python/reward_server.py").string(),
                                   "--port", "0", "--token", "py-t0k", "--max-batch-size", "16"});
  const std::string line = server.wait_for_line("listening on ", 30000);
  INFO(server.output());
  REQUIRE(!line.empty());
  const int port = std::stoi(line.substr(13));

  auto reward = make_reward("remote", "py",
                            client_options(port, {{"token", "py-t0k"}, {"max_concurrency", 4}}));
  auto& remote = dynamic_cast<RemoteReward&>(*reward);
  CHECK(remote.info().name == "python-math");
  CHECK(remote.options().batch_size == 16);  // lowered to the server's bound

  // The Python server reads "#### n" and last numbers, not \boxed: compare on those two forms.
  auto samples = math_samples(100, 21);
  std::vector<RewardSample> plain;
  for (size_t i = 0; i < samples.size(); ++i)
    if (i % 3 != 0) plain.push_back(samples[i]);
  const auto sent = as_sent(samples);
  std::vector<RewardSample> plain_sent;
  for (size_t i = 0; i < samples.size(); ++i)
    if (i % 3 != 0) plain_sent.push_back(sent[i]);
  const auto expected = MathAnswerReward("m", {}).score(plain_sent);
  const auto got = reward->score(plain);
  REQUIRE(got.size() == plain.size());
  int right = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("sample " << i << ": " << plain[i].completion << " / " << plain[i].answer);
    CHECK(got[i].ok == expected[i].ok);
    CHECK(got[i].value == expected[i].value);
    right += got[i].value == 1.0;
  }
  CHECK(right > 10);
  CHECK_FALSE(got[0].ok);  // samples[1]: no reference answer
  CHECK_THAT(got[0].error, Contains("no reference answer"));

  RemoteReward wrong("py", {.address = "127.0.0.1:" + std::to_string(port), .token = "nope"});
  CHECK_THROWS_WITH(wrong.score(plain), Contains("refused the token (wrong token)"));
  CHECK(server.stop() == 0);  // SIGTERM ends it cleanly
}
