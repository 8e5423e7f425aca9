// RolloutPool: a thread per call slot takes the next request and sends it to the least loaded
// serving worker; failures move the request to another worker; a thread per worker checks its
// health, sets aside one that stops answering and brings it back when it answers again.
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
  TANDEM_CHECK(options_.health_check_interval_ms >= 1,
               "rollout pool: health_check_interval_ms is {}, expected >= 1",
               options_.health_check_interval_ms);
  TANDEM_CHECK(options_.health_check_timeout_ms >= 1,
               "rollout pool: health_check_timeout_ms is {}, expected >= 1",
               options_.health_check_timeout_ms);
  for (const std::string& a : options_.addresses) {
    ClientOptions o = options_.client;
    o.address = a;
    clients_.push_back(std::make_shared<RolloutClient>(o));
    o.timeout_ms = options_.health_check_timeout_ms;
    o.connect_timeout_ms = options_.health_check_timeout_ms;
    o.retries = 0;
    checks_.push_back(std::make_unique<RolloutClient>(o));
    workers_.push_back(Worker{.address = a});
    down_until_.push_back(Clock::time_point{});
    consecutive_failures_.push_back(0);
  }
  for (size_t w = 0; w < workers_.size(); ++w)
    checkers_.emplace_back([this, w] { health_checks(w); });
}

RolloutPool::~RolloutPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  for (std::thread& t : checkers_) t.join();
}

std::vector<RolloutPool::Worker> RolloutPool::workers() const {
  std::lock_guard lock(mutex_);
  std::vector<Worker> w = workers_;
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < w.size(); ++i) w[i].down = now < down_until_[i];
  return w;
}

RolloutPool::Worker RolloutPool::worker(size_t w) const {
  std::lock_guard lock(mutex_);
  Worker out = workers_.at(w);
  out.down = Clock::now() < down_until_[w];
  return out;
}

void RolloutPool::set_aside(size_t w, const std::string& why) {
  std::lock_guard lock(mutex_);
  set_aside_locked(w, why);
}

void RolloutPool::set_aside_locked(size_t w, const std::string& why) {
  Worker& k = workers_.at(w);
  if (k.set_aside) return;
  k.set_aside = true;
  ++k.times_set_aside;
  k.why = why;
  spdlog::warn(
      "rollout worker {} set aside: {}; its requests go to the other workers, and it is asked "
      "for a health check every {} ms until it answers",
      k.address, why, options_.health_check_interval_ms);
}

void RolloutPool::health_checks(size_t w) {
  std::unique_lock lock(mutex_);
  for (;;) {
    stop_.wait_for(lock, std::chrono::milliseconds(options_.health_check_interval_ms),
                   [this] { return stopping_; });
    if (stopping_) return;
    lock.unlock();
    // The weight version is answered by the worker's RPC thread, not its engine: a busy worker
    // answers at once, a stopped or hung one not at all.
    std::string error;
    try {
      checks_[w]->weight_version();
    } catch (const CallError& e) {
      error = e.what();
    }
    bool back = false;
    if (error.empty()) {
      bool aside = false;
      {
        std::lock_guard l(mutex_);
        aside = workers_[w].set_aside && !stopping_;
      }
      back = aside && (!options_.rejoin || options_.rejoin(w));
    }
    lock.lock();
    if (!error.empty()) {
      set_aside_locked(w, fmt::format("it did not answer a health check within {} ms ({})",
                                      options_.health_check_timeout_ms, error));
    } else if (back) {
      Worker& k = workers_[w];
      k.set_aside = false;
      ++k.times_back;
      consecutive_failures_[w] = 0;
      down_until_[w] = Clock::time_point{};
      spdlog::info("rollout worker {} answers again and serves again (it was set aside: {})",
                   k.address, k.why);
    }
  }
}

int RolloutPool::pick_worker(const std::vector<bool>& tried) {
  const Clock::time_point now = Clock::now();
  auto live = [&](size_t i) { return !workers_[i].set_aside && now >= down_until_[i]; };
  // A worker this request failed on is taken again only when every live worker has failed it;
  // while an untried live worker is busy, the request waits for it.
  bool untried_live = false;
  for (size_t i = 0; i < workers_.size(); ++i) untried_live |= live(i) && !tried[i];
  int best = -1;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!live(i) || workers_[i].in_flight >= options_.max_in_flight_per_worker ||
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
      int64_t epoch = 0;
      {
        std::unique_lock lock(mutex_);
        // Wait for a free slot on a serving worker; when every worker is down, for the first to
        // come back (worker_down_ms); when every one is set aside, up to the request's deadline.
        const Clock::time_point since = Clock::now();
        const auto bound = std::chrono::milliseconds(options_.client.timeout_ms);
        while (!failed && (w = pick_worker(tried)) < 0) {
          bool all_aside = true;
          for (const Worker& k : workers_) all_aside &= k.set_aside;
          if (!all_aside || Clock::now() - since < bound) {
            freed.wait_for(lock, std::chrono::milliseconds(20));
            continue;
          }
          std::string why;
          for (const Worker& k : workers_) why += fmt::format("\n  {}: {}", k.address, k.why);
          throw CallError(CallFailure::transport,
                          fmt::format("rollout pool: request '{}': every worker has been set "
                                      "aside for {} ms (its deadline):{}",
                                      request.request_id, options_.client.timeout_ms, why));
        }
        if (w < 0) return;
        ++workers_[static_cast<size_t>(w)].in_flight;
        epoch = workers_[static_cast<size_t>(w)].times_set_aside;
      }
      const size_t k = static_cast<size_t>(w);
      CallFailure failure = CallFailure::transport;
      try {
        std::optional<rpc::GenerateResponse> answer = call_unless<rpc::GenerateResponse>(
            [client = clients_[k], request] { return client->generate(request); },
            [&] {
              std::lock_guard lock(mutex_);
              return failed || workers_[k].times_set_aside != epoch;
            });
        std::lock_guard lock(mutex_);
        --workers_[k].in_flight;
        freed.notify_all();
        if (answer) {
          answers[r] = std::move(*answer);
          ++workers_[k].answered;
          consecutive_failures_[k] = 0;
          return;
        }
        if (failed) return;
        ++workers_[k].failures;
        tried[k] = true;
        last = fmt::format("rollout worker {} was set aside while the request was in flight ({})",
                           workers_[k].address, workers_[k].why);
      } catch (const CallError& e) {
        failure = e.failure();
        last = e.what();
        std::lock_guard lock(mutex_);
        --workers_[k].in_flight;
        ++workers_[k].failures;
        tried[k] = true;
        const bool final = failure == CallFailure::invalid || failure == CallFailure::unauthorized;
        if (final) throw CallError(failure, last);
        if (failure == CallFailure::transport || failure == CallFailure::stale_weights) {
          // It missed the deadline, lost the connection, or lacks the latest weights: it serves
          // again once a health check finds it answering (and rejoin caught it up).
          set_aside_locked(k, last);
        } else {
          // Overloaded passes soon; a failing worker is left alone longer each time it fails
          // again (worker_down_ms, doubled per failure in a row, at most 64 times).
          const int64_t again = std::min<int64_t>(consecutive_failures_[k]++, 6);
          const int64_t pause = failure == CallFailure::overloaded
                                    ? std::min<int64_t>(options_.worker_down_ms, 100)
                                    : options_.worker_down_ms << again;
          down_until_[k] = Clock::now() + std::chrono::milliseconds(pause);
        }
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
