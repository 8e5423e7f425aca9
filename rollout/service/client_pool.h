// RolloutPool: generate over several rollout workers at once: requests spread by load, a
// deadline and retries per request, a failed worker's requests sent to the others, and a worker
// that stops answering set aside until a health check finds it back.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
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
  // Health checks: every worker is asked its weight version (answered off its engine thread)
  // every health_check_interval_ms; one that misses health_check_timeout_ms is set aside.
  int64_t health_check_interval_ms = 5000;
  int64_t health_check_timeout_ms = 10000;
  // Called on the worker's health-check thread when a set-aside worker answers again; it serves
  // again once this returns true (e.g. after it took the latest weights). Empty: at once.
  std::function<bool(size_t worker)> rejoin{};
};

class RolloutPool {
 public:
  struct Worker {
    std::string address;
    int64_t in_flight = 0;
    int64_t answered = 0;
    int64_t failures = 0;    // calls that failed there (transport, overloaded, internal, stale)
    bool down = false;       // failed recently; skipped until worker_down_ms has passed
    bool set_aside = false;  // gets no calls until a health check finds it back (rejoin)
    int64_t times_set_aside = 0;  // so far
    int64_t times_back = 0;       // so far
    std::string why{};            // why it was set aside last
  };

  // Throws tandem::Error naming the option when one is out of range or no address is given.
  // Starts a health-check thread per worker.
  explicit RolloutPool(PoolOptions options);
  // Stops the health checks (waits for one in progress, within its deadline or rejoin's).
  ~RolloutPool();
  RolloutPool(const RolloutPool&) = delete;
  RolloutPool& operator=(const RolloutPool&) = delete;

  // Every request's answer, in order. Each request goes to the serving worker with the fewest
  // calls in flight; when the call fails for a reason another worker may not have, the request
  // goes to another (a worker that failed it only when every serving one has), up to `attempts`
  // tries. A worker whose call missed its deadline, lost its connection or answered StaleWeights
  // is set aside, and so is one that misses a health check: its calls in flight are given up at
  // once (their threads end on their own, within the deadline) and go to the others. Overloaded
  // and Internal mark the worker down for a while. A refusal of the request itself
  // (InvalidRequest, Unauthorized) is final. Throws CallError naming the request and the last
  // failure when a request cannot be served, or when every worker stays set aside for a
  // request's deadline.
  std::vector<rpc::GenerateResponse> generate_all(
      const std::vector<rpc::GenerateRequest>& requests);

  // Sets worker `w` aside (a warning naming it and `why`; nothing when it is already).
  void set_aside(size_t w, const std::string& why);

  std::vector<Worker> workers() const;
  Worker worker(size_t w) const;

 private:
  // The serving worker with the fewest calls in flight below the bound, or -1 (none free now).
  int pick_worker(const std::vector<bool>& tried);
  void set_aside_locked(size_t w, const std::string& why);
  void health_checks(size_t w);  // the loop of worker w's health-check thread

  PoolOptions options_;
  std::vector<std::shared_ptr<RolloutClient>> clients_;  // shared with calls given up
  std::vector<std::unique_ptr<RolloutClient>> checks_;   // health checks, their own deadline
  mutable std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::vector<Worker> workers_;
  std::vector<std::chrono::steady_clock::time_point> down_until_;
  std::vector<int64_t> consecutive_failures_;  // calls failed in a row, per worker
  std::vector<std::thread> checkers_;
};

// Runs `call` on a thread of its own and waits until it returns, or until `give_up()` (asked
// every 20 ms) is true: its result, or nullopt when given up; rethrows what it threw. A call
// given up goes on alone until it returns (bound it by a deadline) and its result is dropped, so
// `call` must own what it uses (shared_ptr, copies).
template <typename T>
std::optional<T> call_unless(std::function<T()> call, const std::function<bool()>& give_up) {
  std::promise<T> promise;
  std::future<T> result = promise.get_future();
  std::thread([call = std::move(call), promise = std::move(promise)]() mutable {
    try {
      promise.set_value(call());
    } catch (...) {
      promise.set_exception(std::current_exception());
    }
  }).detach();
  while (result.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready)
    if (give_up()) return std::nullopt;
  return result.get();
}

}  // namespace tandem::rollout
