// RolloutPool: a thread per call slot takes the next request and sends it to the least loaded
// live worker; failures move the request to another worker.
#include "rollout/service/client_pool.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <thread>

namespace tandem::rollout {

using Clock = std::chrono::steady_clock;

RolloutPool::RolloutPool(PoolOptions options) : options_(std::move(options)) {
  TANDEM_CHECK(!options_.addresses.empty(), "rollout pool: no worker addresses");
  TANDEM_CHECK(options_.max_in_flight_per_worker >= 1 && options_.max_in_flight_per_worker <= 4096,
               "rollout pool: max_in_flight_per_worker is {}, expected 1..4096",
               options_.max_in_flight_per_worker);
  TANDEM_CHECK(options_.attempts >= 1 && options_.attempts <= 1000,
               "rollout pool: attempts is {}, expected 1..1000", options_.attempts);
  TANDEM_CHECK(options_.worker_down_ms >= 0, "rollout pool: worker_down_ms is {}, expected >= 0",
               options_.worker_down_ms);
  for (const std::string& a : options_.addresses) {
    ClientOptions o = options_.client;
    o.address = a;
    clients_.push_back(std::make_unique<RolloutClient>(o));
    workers_.push_back(Worker{.address = a});
    down_until_.push_back(Clock::time_point{});
    consecutive_failures_.push_back(0);
  }
}

RolloutPool::~RolloutPool() = default;

std::vector<RolloutPool::Worker> RolloutPool::workers() const {
  std::lock_guard lock(mutex_);
  std::vector<Worker> w = workers_;
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < w.size(); ++i) w[i].down = now < down_until_[i];
  return w;
}

int RolloutPool::pick_worker(const std::vector<bool>& tried) {
  const Clock::time_point now = Clock::now();
  // A worker this request failed on is taken again only when every live worker has failed it;
  // while an untried live worker is busy, the request waits for it.
  bool untried_live = false;
  for (size_t i = 0; i < workers_.size(); ++i) untried_live |= now >= down_until_[i] && !tried[i];
  int best = -1;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (now < down_until_[i] || workers_[i].in_flight >= options_.max_in_flight_per_worker ||
        (untried_live && tried[i]))
      continue;
    if (best < 0 || workers_[i].in_flight < workers_[static_cast<size_t>(best)].in_flight)
      best = static_cast<int>(i);
  }
  return best;
}

std::vector<rpc::GenerateResponse> RolloutPool::generate_all(
    const std::vector<rpc::GenerateRequest>& requests) {
  std::vector<rpc::GenerateResponse> answers(requests.size());
  if (requests.empty()) return answers;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::condition_variable freed;  // a call slot of some worker was given back

  auto serve_one = [&](size_t r) {
    const rpc::GenerateRequest& request = requests[r];
    std::vector<bool> tried(workers_.size(), false);
    std::string last;
    for (int64_t attempt = 0; attempt < options_.attempts && !failed; ++attempt) {
      int w = -1;
      {
        std::unique_lock lock(mutex_);
        // Wait for a free slot on a live worker; when every worker is down, for the first to
        // come back (worker_down_ms).
        while (!failed && (w = pick_worker(tried)) < 0)
          freed.wait_for(lock, std::chrono::milliseconds(20));
        if (w < 0) return;
        ++workers_[static_cast<size_t>(w)].in_flight;
      }
      const size_t k = static_cast<size_t>(w);
      CallFailure failure = CallFailure::transport;
      try {
        answers[r] = clients_[k]->generate(request);
        std::lock_guard lock(mutex_);
        --workers_[k].in_flight;
        ++workers_[k].answered;
        consecutive_failures_[k] = 0;
        freed.notify_all();
        return;
      } catch (const CallError& e) {
        failure = e.failure();
        last = e.what();
      }
      {
        std::lock_guard lock(mutex_);
        --workers_[k].in_flight;
        ++workers_[k].failures;
        tried[k] = true;
        const bool final = failure == CallFailure::invalid || failure == CallFailure::unauthorized;
        if (final) throw CallError(failure, last);
        // Overloaded passes soon; a dead or failing worker is left alone longer each time it fails
        // again (worker_down_ms, doubled per failure in a row, at most 64 times).
        const int64_t again = std::min<int64_t>(consecutive_failures_[k]++, 6);
        const int64_t pause = failure == CallFailure::overloaded
                                  ? std::min<int64_t>(options_.worker_down_ms, 100)
                                  : options_.worker_down_ms << again;
        down_until_[k] = Clock::now() + std::chrono::milliseconds(pause);
        freed.notify_all();
      }
      spdlog::warn("rollout pool: request '{}' failed on {} ({}); sending it to another worker",
                   request.request_id, workers_[k].address, last);
    }
    if (!failed)
      throw CallError(CallFailure::transport,
                      fmt::format("rollout pool: request '{}' failed on {} workers; the last: {}",
                                  request.request_id, options_.attempts, last));
  };

  std::mutex error_mutex;
  auto work = [&] {
    for (size_t r = next++; r < requests.size() && !failed; r = next++) {
      try {
        serve_one(r);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        failed = true;
        freed.notify_all();
      }
    }
  };
  const size_t slots = std::min(
      requests.size(), static_cast<size_t>(options_.max_in_flight_per_worker) * workers_.size());
  std::vector<std::jthread> threads;
  for (size_t t = 1; t < slots; ++t) threads.emplace_back(work);
  work();
  threads.clear();  // joins
  if (error) std::rethrow_exception(error);
  return answers;
}

}  // namespace tandem::rollout
