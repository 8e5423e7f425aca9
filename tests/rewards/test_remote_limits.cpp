// The bounds of the remote reward service's Thrift endpoints: hand-made frames that claim huge
// lists and strings, random and mutated bytes, against the server in-process and as a process
// (its memory, its next valid call, its exit on SIGTERM), and the client against a lying server.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "rewards/builtins.h"
#include "rewards/factory.h"
#include "rewards/remote.h"
#include "rewards/remote_server.h"
#include "rewards/rpc/RewardService.h"
#include "rpc/bounded_thrift.h"
#include "tests/rpc/raw_frames.h"
#include "tests/testutil.h"

using namespace tandem::rewards;
using Catch::Matchers::Contains;

namespace {

using tandem::test::connect_loopback;
using tandem::test::framed;
using tandem::test::send_all;
using tandem::test::wire_i16;
using tandem::test::wire_i32;

std::string field(int8_t type, int16_t id) {
  return std::string(1, static_cast<char>(type)) + wire_i16(id);
}
// The start of a strict binary call of score(): the message header and the ScoreRequest field.
std::string score_call_start() {
  return wire_i32(static_cast<int32_t>(0x80010001)) + wire_i32(5) + "score" + wire_i32(1) +
         field(12, 1);
}
// score() whose samples list claims 0x7fffffff structs: 32 bytes on the wire.
std::string list_bomb() {
  return framed(score_call_start() + field(15, 2) + std::string(1, 12) + wire_i32(0x7fffffff));
}
// score() whose request_id claims 0x7ffffff0 bytes.
std::string string_bomb() {
  return framed(score_call_start() + field(11, 1) + wire_i32(0x7ffffff0));
}

// A valid framed score() call, serialised by Thrift itself.
std::string valid_score_call(const std::string& token, int samples) {
  namespace at = apache::thrift;
  auto buffer = std::make_shared<at::transport::TMemoryBuffer>();
  at::protocol::TBinaryProtocol protocol(buffer);
  rpc::RewardService_score_pargs args;
  rpc::ScoreRequest request;
  request.request_id = "fuzz";
  request.token = token;
  request.samples.resize(static_cast<size_t>(samples));
  for (int i = 0; i < samples; ++i) {
    request.samples[i].completion = "#### " + std::to_string(i);
    request.samples[i].answer = "#### " + std::to_string(i % 3);
  }
  args.request = &request;
  protocol.writeMessageBegin("score", at::protocol::T_CALL, 1);
  args.write(&protocol);
  protocol.writeMessageEnd();
  return framed(buffer->getBufferAsString());
}

// What the server did after `bytes` on a fresh connection, within timeout_ms.
enum class Reply { closed, answered, silent };
Reply send_and_watch(int port, const std::string& bytes, int timeout_ms = 3000) {
  const int fd = connect_loopback(port);
  send_all(fd, bytes);
  pollfd p{fd, POLLIN, 0};
  Reply r = Reply::silent;
  if (poll(&p, 1, timeout_ms) == 1) {
    char c;
    r = recv(fd, &c, 1, 0) > 0 ? Reply::answered : Reply::closed;
  }
  close(fd);
  return r;
}

// The resident memory of a process in MB (/proc/PID/status VmRSS).
double rss_mb(int pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return -1;
}

// Seeded fuzz inputs: random bytes (with and without a plausible frame header) and valid calls
// with bytes overwritten.
std::vector<std::string> fuzz_inputs(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  const std::string valid = valid_score_call("t0k", 3);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    std::string s;
    if (i % 3 == 0) {
      s.resize(1 + rng() % 64);
      for (char& c : s) c = static_cast<char>(rng());
    } else if (i % 3 == 1) {
      std::string payload(rng() % 200, '\0');
      for (char& c : payload) c = static_cast<char>(rng());
      s = framed(payload);
    } else {
      s = valid;
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k)
        s[4 + rng() % (s.size() - 4)] = static_cast<char>(rng());
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<RewardSample> samples_with_answers(int n) {
  std::vector<RewardSample> s(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    s[i].completion = "#### " + std::to_string(i);
    s[i].answer = "#### " + std::to_string(i % 2);
  }
  return s;
}

}  // namespace

TEST_CASE("a reward server closes connections whose frames claim huge lists or strings", "[unit]") {
  auto math = std::make_shared<MathAnswerReward>("math", MathAnswerReward::Options{});
  RewardServer server(math, {.token = "t0k", .max_batch_size = 64, .max_message_bytes = 4096});
  const int port = server.port();
  CHECK(list_bomb().size() == 32);

  CHECK(send_and_watch(port, list_bomb()) == Reply::closed);
  CHECK(send_and_watch(port, string_bomb()) == Reply::closed);
  // A list within the element limit that cannot fit in what is left of its frame.
  CHECK(send_and_watch(port, framed(score_call_start() + field(15, 2) + std::string(1, 12) +
                                    wire_i32(60))) == Reply::closed);
  // A frame over max_message_bytes, refused from its header.
  CHECK(send_and_watch(port, wire_i32(5000) + score_call_start()) == Reply::closed);
  // Nesting deeper than the limit (lists of lists), and an unversioned message.
  std::string deep = score_call_start() + field(15, 9);
  for (int level = 0; level < 40; ++level) deep += std::string(1, 15) + wire_i32(1);
  CHECK(send_and_watch(port, framed(deep)) == Reply::closed);
  CHECK(send_and_watch(port, framed(wire_i32(5) + "score" + std::string(1, 1) + wire_i32(1))) ==
        Reply::closed);
  CHECK(server.stats().refused == 6);

  // The server serves on: a valid call by hand, then through the client.
  CHECK(send_and_watch(port, valid_score_call("t0k", 3)) == Reply::answered);
  RemoteReward reward("math", {.address = "127.0.0.1:" + std::to_string(port), .token = "t0k"});
  const auto got = reward.score(samples_with_answers(6));
  REQUIRE(got.size() == 6);
  for (size_t i = 0; i < got.size(); ++i) CHECK((got[i].ok && got[i].value == (i < 2 ? 1 : 0)));
  CHECK(server.stats().refused == 6);
}

TEST_CASE("bounded Thrift connections carry more than max_message_bytes over many messages",
          "[unit]") {
  CHECK_NOTHROW(tandem::check_thrift_limits({}, "defaults"));
  CHECK_THROWS_WITH(tandem::check_thrift_limits({.max_depth = 2}, "the service"),
                    Contains("the service: a Thrift limit is out of range") &&
                        Contains("max_depth 2 in 4..1024"));
  CHECK_THROWS_WITH(tandem::check_thrift_limits({.max_message_bytes = 100}, "s"),
                    Contains("max_message_bytes 100 >= 1024"));

  auto len = std::make_shared<LengthPenaltyReward>(
      "len", LengthPenaltyReward::Options{.target_tokens = 4});
  RewardServer server(len, {.max_message_bytes = 4096});
  RemoteReward reward("len", {.address = "127.0.0.1:" + std::to_string(server.port()),
                              .retries = 0,
                              .max_concurrency = 1,
                              .batch_size = 8});
  std::vector<RewardSample> samples(8);
  for (size_t i = 0; i < samples.size(); ++i) samples[i].completion = std::string(300, 'a');
  for (int call = 0; call < 20; ++call) {  // 20 messages of ~2.5 KB on one pooled connection
    const auto got = reward.score(samples);
    REQUIRE(got.size() == samples.size());
    CHECK(got[0].ok);
  }
  CHECK(server.stats().refused == 0);
  CHECK(server.stats().scored == 20);

  // One message over the limit is refused, and the client says so.
  samples[0].completion = std::string(5000, 'a');
  CHECK_THROWS_WITH(reward.score(samples),
                    Contains("reward 'len' (remote 127.0.0.1:") && Contains("transport error"));
  CHECK(server.stats().refused >= 1);  // and once more when the pooled connection was retried
}

TEST_CASE("the example reward server survives list and string bombs and random bytes", "[e2e]") {
  tandem::test::Subprocess server({std::string(TANDEM_BIN_DIR) + "/tandem_reward_server", "--port",
                                   "0", "--kind", "math_answer", "--token", "t0k"});
  const std::string line = server.wait_for_line("listening on ", 10000);
  REQUIRE(!line.empty());
  const int port = std::stoi(line.substr(13));
  const double rss_before = rss_mb(server.pid());
  REQUIRE(rss_before > 0);

  // Ten connections at once, each sending bombs in turn, then seeded fuzz.
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::vector<std::jthread> attackers;
    for (int a = 0; a < 10; ++a)
      attackers.emplace_back([port] {
        for (int round = 0; round < 3; ++round) {
          CHECK(send_and_watch(port, list_bomb()) == Reply::closed);
          CHECK(send_and_watch(port, string_bomb()) == Reply::closed);
        }
      });
  }
  for (const std::string& bytes : fuzz_inputs(17, 60)) send_and_watch(port, bytes, 200);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));

  REQUIRE(kill(server.pid(), 0) == 0);  // still running
  const double growth = rss_mb(server.pid()) - rss_before;
  INFO("RSS growth " << growth << " MB");
  CHECK(growth < 300);

  auto reward = make_reward("remote", "math",
                            {{"address", "127.0.0.1:" + std::to_string(port)}, {"token", "t0k"}});
  const auto got = reward->score(samples_with_answers(4));
  REQUIRE(got.size() == 4);
  CHECK((got[0].ok && got[0].value == 1.0 && got[3].value == 0.0));
  CHECK(server.stop() == 0);
}

TEST_CASE("the example reward server exits soon after SIGTERM while clients hold connections",
          "[e2e]") {
  // A function that never returns in time: the plugin hangs on a completion saying "hang".
  const std::string plugin = std::string(TANDEM_LIB_DIR) + "/libfailing_reward.so";
  tandem::test::Subprocess server({std::string(TANDEM_BIN_DIR) + "/tandem_reward_server", "--port",
                                   "0", "--kind", "plugin", "--options",
                                   nlohmann::json{{"path", plugin}, {"config", "hang"}}.dump(),
                                   "--stop-timeout-ms", "1000"});
  const std::string line = server.wait_for_line("listening on ", 10000);
  REQUIRE(!line.empty());
  const int port = std::stoi(line.substr(13));

  std::vector<int> held;
  held.push_back(connect_loopback(port));  // idle
  held.push_back(connect_loopback(port));  // a frame header claiming 60 MB, then a few bytes
  send_all(held.back(), wire_i32(60 << 20) + score_call_start());
  held.push_back(connect_loopback(port));  // half a string bomb
  send_all(held.back(), string_bomb().substr(0, 20));
  std::jthread hung([port] {
    RemoteReward r("hang", {.address = "127.0.0.1:" + std::to_string(port),
                            .timeout_ms = 30000,
                            .retries = 0,
                            .check_on_start = false});
    std::vector<RewardSample> s(1);
    s[0].completion = "hang";
    CHECK_THROWS(r.score(s));  // the server goes away under it
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the hung call reaches the plugin

  const auto t0 = std::chrono::steady_clock::now();
  const int status = server.stop(SIGTERM, 10000);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 3.0);
  CHECK(status == 1);  // ended by the stop timeout, not by SIGKILL (137)
  for (int fd : held) close(fd);
}
