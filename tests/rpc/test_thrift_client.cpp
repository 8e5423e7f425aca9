// The connecting and retrying every Thrift client of tandem shares (rpc/thrift_client.h): peer
// addresses, how many tries a busy answer or a lost connection gets, which failures end a call at
// once, and the deadline of all tries together. The peer is a bare listening socket (the kernel
// accepts the connections); the calls throw what a server's answer would.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <string>

#include "core/error.h"
#include "rewards/rpc/RewardService.h"
#include "rpc/thrift_client.h"
#include "tests/testutil.h"

namespace tandem {
namespace {

using Catch::Matchers::Contains;
using Client = rewards::rpc::RewardServiceClient;
namespace at = apache::thrift;

// A loopback socket that listens and never answers; its port.
struct SilentPeer {
  int fd = -1;
  int port = 0;
  SilentPeer() {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(listen(fd, 64) == 0);
    socklen_t n = sizeof a;
    REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0);
    port = ntohs(a.sin_port);
  }
  ~SilentPeer() { close(fd); }
};

// The judge of the tests: Overloaded is busy, anything else ends the call.
std::string judge() {
  try {
    throw;
  } catch (const rewards::rpc::Overloaded& e) {
    return "busy: " + e.message;
  } catch (const at::TException& e) {
    throw Error(std::string("final: ") + e.what());
  }
}

Error give_up(const CallExhausted& last) {
  return Error(std::string(last.busy ? "gave up busy: " : "gave up: ") + last.why);
}

}  // namespace

TEST_CASE("a Thrift peer address is host and port and is refused naming the caller otherwise",
          "[unit]") {
  const Endpoint e = parse_endpoint("127.0.0.1:9090", "test", 1);
  CHECK(e.host == "127.0.0.1");
  CHECK(e.port == 9090);
  CHECK(parse_endpoint("[::1]:80", "test", 1).host == "::1");
  CHECK(parse_endpoint("worker-3.local:1", "test", 1).host == "worker-3.local");
  CHECK_THROWS_WITH(parse_endpoint("localhost", "reward 'm' (remote)", 9090),
                    Contains("reward 'm' (remote): address 'localhost' is not host:port (e.g. "
                             "127.0.0.1:9090)"));
  CHECK_THROWS_WITH(parse_endpoint(":80", "c", 9100), Contains("is not host:port"));
  CHECK_THROWS_WITH(parse_endpoint("h:8a", "c", 9100), Contains("is not host:port"));
  CHECK_THROWS_WITH(parse_endpoint("h:99999", "c", 9100),
                    Contains("c: port 99999 of 'h:99999' is not 1..65535"));
  CHECK_THROWS_WITH(parse_endpoint("h:0", "c", 9100), Contains("port 0 of 'h:0'"));
}

TEST_CASE("a Thrift client tries a busy answer retries plus one times on one connection",
          "[unit]") {
  SilentPeer peer;
  ThriftClient<Client> link({"127.0.0.1", peer.port}, ThriftLimits{});
  int calls = 0;
  const CallTries tries{.what = "test", .retries = 3, .backoff_ms = 1};
  CHECK_THROWS_WITH(link.call(
                        tries,
                        [&](Client&) -> int {
                          ++calls;
                          rewards::rpc::Overloaded busy;
                          busy.message = "come back later";
                          throw busy;
                        },
                        judge, give_up),
                    Contains("gave up busy: busy: come back later"));
  CHECK(calls == 4);

  // A final answer ends the call at its first try; a result comes back as it is.
  calls = 0;
  CHECK_THROWS_WITH(link.call(
                        tries,
                        [&](Client&) -> int {
                          ++calls;
                          throw rewards::rpc::InvalidRequest();
                        },
                        judge, give_up),
                    Contains("final: "));
  CHECK(calls == 1);
  CHECK(link.call(
            tries, [](Client&) { return 7; }, judge, give_up) == 7);
}

TEST_CASE("a Thrift client retries lost connections and gives up with the transport error",
          "[unit]") {
  SilentPeer peer;
  ThriftClient<Client> link({"127.0.0.1", peer.port}, ThriftLimits{});
  int calls = 0;
  auto lost = [&](Client&) -> int {
    ++calls;
    throw at::transport::TTransportException(at::transport::TTransportException::END_OF_FILE,
                                             "the peer closed it");
  };
  CHECK_THROWS_WITH(
      link.call({.what = "test", .retries = 2, .backoff_ms = 1}, lost, judge, give_up),
      Contains("gave up: transport error: the peer closed it"));
  CHECK(calls == 3);  // every connection was new: none was retried at once

  // A pooled connection found dead gets one more try at once, without counting.
  CHECK(link.call(
            {.what = "test", .retries = 0}, [](Client&) { return 1; }, judge, give_up) == 1);
  calls = 0;
  CHECK_THROWS(link.call({.what = "test", .retries = 0}, lost, judge, give_up));
  CHECK(calls == 2);

  // Nobody listening: the connect fails, and is retried like any transport error.
  ThriftClient<Client> nobody({"127.0.0.1", test::free_port()}, ThriftLimits{});
  CHECK_THROWS_WITH(nobody.call(
                        {.what = "test", .retries = 1, .backoff_ms = 1}, [](Client&) { return 1; },
                        judge, give_up),
                    Contains("gave up: transport error"));
}

TEST_CASE("a Thrift client with a deadline stops retrying when it passes", "[unit]") {
  SilentPeer peer;
  ThriftClient<Client> link({"127.0.0.1", peer.port}, ThriftLimits{});
  int calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(
      link.call(
          {.what = "test", .retries = 100, .backoff_ms = 40, .timeout_ms = 300, .deadline = true},
          [&](Client&) -> int {
            ++calls;
            rewards::rpc::Overloaded busy;
            throw busy;
          },
          judge, give_up),
      Contains("gave up"));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 2.0);
  CHECK(calls >= 2);
  CHECK(calls < 100);
}

}  // namespace tandem
