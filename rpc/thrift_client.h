// ThriftClient: the connecting and retrying of every Thrift client of tandem (the remote reward,
// the rollout worker client): the peer's address, pooled bounded connections, and one call tried
// again after a transport error or a "busy" answer, with a pause that doubles.
#pragma once

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <thrift/TApplicationException.h>
#include <thrift/Thrift.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TSocket.h>
#include <thrift/transport/TTransportException.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "rpc/bounded_thrift.h"
#include "rpc/idle_connections.h"

namespace tandem {

// A peer's address, host:port.
struct Endpoint {
  std::string host;  // without the brackets of an IPv6 address ("[::1]:9090" -> "::1")
  int port = 0;
};

// Parses "host:port"; throws tandem::Error starting with `what` ("reward 'x' (remote)") that
// gives 127.0.0.1:example_port as an example when it is not host:port or the port is not 1..65535.
Endpoint parse_endpoint(const std::string& address, const std::string& what, int example_port);

// How one call is tried.
struct CallTries {
  std::string what;          // the peer and the call, for the retry log lines
  int64_t retries = 2;       // further tries after a transport error or a busy answer
  int64_t backoff_ms = 100;  // pause before the first retry; doubled each time, at most 5 s
  int64_t connect_timeout_ms = 2000;
  int64_t timeout_ms = 10000;  // each try's send and receive timeout, or with `deadline`...
  bool deadline = false;       // ... the bound of all tries together (each gets what is left)
  spdlog::level::level_enum retry_log_level = spdlog::level::debug;
};

// The last failure of a call whose every try failed.
struct CallExhausted {
  std::string why;    // "transport error: ...", "the deadline of N ms passed", or a busy answer
  bool busy = false;  // the last try was answered busy, not lost to the transport
};

// Client: a Thrift-generated client class (constructed from a std::shared_ptr<TProtocol>).
template <class Client>
class ThriftClient {
 public:
  ThriftClient(Endpoint peer, ThriftLimits limits) : peer_(std::move(peer)), limits_(limits) {}

  // Runs call(Client&) on an idle connection or a new one and returns its result.
  //
  // A transport error (refused, reset, timed out) drops every idle connection (a late answer
  // could still arrive on one) and is tried again; a pooled connection found dead (the peer
  // restarted) is retried at once, once, without counting. Any other Thrift exception is handed
  // to `judge`, called inside the catch block: it rethrows it (`throw;`) to tell the kinds apart,
  // and either throws the caller's final error or returns why the answer means "busy, try again"
  // (a declared exception of the service keeps its connection: its answer was read whole). When
  // no try is left, `give_up(CallExhausted)` makes the exception that is thrown.
  template <class Call, class Judge, class GiveUp>
  auto call(const CallTries& tries, Call&& call, Judge&& judge, GiveUp&& give_up) {
    namespace at = apache::thrift;
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(tries.timeout_ms);
    CallExhausted last;
    bool stale_retried = false;
    for (int64_t attempt = 0;;) {
      std::unique_ptr<Connection> c;
      bool reused = false;
      try {
        int64_t timeout_ms = tries.timeout_ms, connect_ms = tries.connect_timeout_ms;
        if (tries.deadline) {
          timeout_ms = ms_until(deadline);
          if (timeout_ms <= 0) {
            last = {fmt::format("the deadline of {} ms passed", tries.timeout_ms), false};
            break;
          }
          connect_ms = std::min(connect_ms, timeout_ms);
        }
        c = take(reused, connect_ms, timeout_ms);
        auto result = call(*c->client);
        idle_.give_back(std::move(c));
        return result;
      } catch (const at::transport::TTransportException& e) {
        last = {fmt::format("transport error: {}", e.what()), false};
        idle_.drop_all();
        if (reused && !stale_retried &&
            e.getType() != at::transport::TTransportException::TIMED_OUT) {
          stale_retried = true;
          continue;
        }
      } catch (const at::TException& e) {
        if (dynamic_cast<const at::protocol::TProtocolException*>(&e) == nullptr &&
            dynamic_cast<const at::TApplicationException*>(&e) == nullptr)
          idle_.give_back(std::move(c));
        last = {judge(), true};
      }
      if (attempt == tries.retries) break;
      int64_t pause = std::min<int64_t>(tries.backoff_ms << std::min<int64_t>(attempt, 16), 5000);
      if (tries.deadline) pause = std::min(pause, ms_until(deadline));
      if (pause < 0) break;
      spdlog::log(tries.retry_log_level, "{}: {}; retry {} of {} in {} ms", tries.what, last.why,
                  attempt + 1, tries.retries, pause);
      std::this_thread::sleep_for(std::chrono::milliseconds(pause));
      ++attempt;
    }
    throw give_up(last);
  }

  const Endpoint& peer() const { return peer_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Connection {
    std::shared_ptr<apache::thrift::transport::TSocket> socket;
    std::shared_ptr<apache::thrift::transport::TTransport> transport;
    std::unique_ptr<Client> client;
  };

  static int64_t ms_until(Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  }

  // An idle connection with its timeouts set to io_timeout_ms, or a new one.
  std::unique_ptr<Connection> take(bool& reused, int64_t connect_timeout_ms,
                                   int64_t io_timeout_ms) {
    const int io_ms = static_cast<int>(std::clamp<int64_t>(io_timeout_ms, 1, 1 << 30));
    auto c = idle_.take();
    reused = c != nullptr;
    if (reused) {
      c->socket->setRecvTimeout(io_ms);
      c->socket->setSendTimeout(io_ms);
      return c;
    }
    BoundedClientSocket link = open_bounded_client(
        peer_.host, peer_.port,
        static_cast<int>(std::clamp<int64_t>(connect_timeout_ms, 1, 1 << 30)), io_ms, limits_);
    c = std::make_unique<Connection>();
    c->socket = std::move(link.socket);
    c->transport = std::move(link.transport);
    c->client = std::make_unique<Client>(std::move(link.protocol));
    return c;
  }

  Endpoint peer_;
  ThriftLimits limits_;  // of the answers, as the servers bound the requests
  IdleConnections<Connection> idle_;
};

}  // namespace tandem
