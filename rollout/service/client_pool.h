// RolloutPool: generate over several rollout workers at once: requests spread by load, a
// deadline and retries per request, and a failed worker's requests sent to the others.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rollout/service/client.h"

namespace tandem::rollout {

struct PoolOptions {
  std::vector<std::string> addresses;  // host:port of every worker
  // Per call: timeout_ms is a request's deadline on one worker; retries are the client's own
  // (0 sends a failed request to another worker at once); token goes in every call.
  ClientOptions client{.timeout_ms = 120000, .retries = 0};
  int64_t max_in_flight_per_worker = 8;  // generate calls sent to one worker at once
  int64_t attempts = 4;                  // workers a request is tried on before the pool gives up
  int64_t worker_down_ms = 2000;  // a worker that failed is left alone this long, then tried again
};

class RolloutPool {
 public:
  struct Worker {
    std::string address;
    int64_t in_flight = 0;
    int64_t answered = 0;
    int64_t failures = 0;  // calls that failed there (transport, overloaded, internal, stale)
    bool down = false;     // failed recently; skipped until worker_down_ms has passed
  };

  // Throws tandem::Error naming the option when one is out of range or no address is given.
  explicit RolloutPool(PoolOptions options);
  ~RolloutPool();
  RolloutPool(const RolloutPool&) = delete;
  RolloutPool& operator=(const RolloutPool&) = delete;

  // Every request's answer, in order. Each request goes to the live worker with the fewest calls
  // in flight; when the call fails for a reason another worker may not have (transport: the
  // worker died or the deadline passed; Overloaded; Internal; StaleWeights) the worker is marked
  // down for a while and the request goes to another (a worker that failed it only when every
  // live one has), up to `attempts` tries. A refusal of the
  // request itself (InvalidRequest, Unauthorized) is final. Throws CallError naming the request
  // and the last failure when a request cannot be served.
  std::vector<rpc::GenerateResponse> generate_all(
      const std::vector<rpc::GenerateRequest>& requests);

  std::vector<Worker> workers() const;

 private:
  // The live worker with the fewest calls in flight below the bound, or -1 (none free now).
  int pick_worker(const std::vector<bool>& tried);

  PoolOptions options_;
  std::vector<std::unique_ptr<RolloutClient>> clients_;
  mutable std::mutex mutex_;
  std::vector<Worker> workers_;
  std::vector<std::chrono::steady_clock::time_point> down_until_;
  std::vector<int64_t> consecutive_failures_;  // calls failed in a row, per worker
};

}  // namespace tandem::rollout
