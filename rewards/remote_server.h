// Serving a RewardFunction over Thrift (rewards/reward.thrift): the server side of RemoteReward.
#pragma once

#include <memory>

#include "rewards/reward.h"

namespace tandem::rewards {

// A threaded server (one thread per connection) on its own thread. Requests are bounded (batch
// size, message size, connections, score calls in flight) and checked (token, extra_json); a bad
// one is answered with InvalidRequest or Unauthorized, never a crash. Every size read from the
// wire is checked before it is allocated (rpc/bounded_thrift.h): a frame over
// max_message_bytes, a string or list longer than what is left of its frame, a list over
// max(max_batch_size, 65536) or nesting deeper than 16 closes that connection and is counted
// (stats().refused, and a warning in the log). The function is called from
// one thread at a time; up to max_in_flight score calls wait for it, and one more is answered
// with Overloaded at once (clients retry after a pause) instead of joining an ever longer queue.
// A function that throws or returns the wrong number of results fails every sample of that
// request (ok = false, with the reason).
class RewardServer {
 public:
  struct Stats {
    int64_t scored = 0;      // score calls answered with scores
    int64_t overloaded = 0;  // score calls refused with Overloaded
    // connections closed because a request broke a limit (ThriftLimits: message, string or list
    // size, nesting) or was not framed binary Thrift; the server serves the others on
    int64_t refused = 0;
  };

  struct Options {
    std::string host = "127.0.0.1";
    int port = 0;         // 0: a free port (port() says which)
    std::string token{};  // when not empty, every score request must carry it
    int64_t max_batch_size = 4096;
    int64_t max_message_bytes = 64 << 20;  // a bigger request frame closes the connection
    int64_t max_connections = 64;          // further clients wait to be accepted
    int64_t max_in_flight = 16;            // score calls admitted at once (scoring or waiting)
    int64_t idle_timeout_ms = 600'000;     // a connection silent this long is closed
    std::string name = "tandem";           // info().name
  };

  // Listens when it returns; throws tandem::Error naming the address when it cannot bind.
  RewardServer(std::shared_ptr<RewardFunction> function, Options options);
  ~RewardServer();  // stop()
  RewardServer(const RewardServer&) = delete;
  RewardServer& operator=(const RewardServer&) = delete;

  int port() const { return port_; }
  Stats stats() const;
  // Stops accepting, closes the connections and waits for the calls in progress to return.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace tandem::rewards
