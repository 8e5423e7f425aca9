// The bounded-staleness look-ahead of rollout.max_staleness = k (docs/train.md, "Asynchronous
// rollouts"): a producer thread makes the batches of the coming steps while the trainer updates on
// the current one, and starts a step's batch only once the trainer has finished every step more
// than k before it, so that no sample of it lags the weights it is trained on by more than k
// versions. Also the clock that says how long the rollout was busy.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "core/clock.h"
#include "core/error.h"

namespace tandem::trainer {

// Whether the batch of step `step` may start generating when the trainer has finished `done`
// steps (updated and published the weights of every step before `done`) under the bound k.
// Step s trains on the weights of s's update's input; a batch started after step s - k - 1 was
// published samples from a version at most k updates older (one update per step at most).
// k = 0: only once step - 1 is finished, the sequential job.
inline bool may_start(int64_t step, int64_t done, int64_t max_staleness) {
  return done >= step - max_staleness;
}

// The producer side of an asynchronous job: produce(step) runs on the queue's own thread for the
// steps [first, last) in order, each started when may_start allows. The trainer takes each step's
// batch in order (take) and says when it has finished the step (finished). At most k batches are
// made or in the making beyond the one the trainer waits for or trains on.
template <class Batch>
class RolloutQueue {
 public:
  RolloutQueue(int64_t first, int64_t last, int64_t max_staleness,
               std::function<Batch(int64_t step)> produce)
      : last_(last), k_(max_staleness), done_(first), produce_(std::move(produce)) {
    TANDEM_CHECK(max_staleness >= 0, "rollout queue: max_staleness must be >= 0, got {}",
                 max_staleness);
    thread_ = std::thread([this, first] { run(first); });
  }
  // Stops the producer after the batch it is making (it waits for it to end).
  ~RolloutQueue() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  RolloutQueue(const RolloutQueue&) = delete;
  RolloutQueue& operator=(const RolloutQueue&) = delete;

  // The batch of `step` (the next one not taken), waiting for it; seconds waited in `wait_s`.
  // Rethrows the producer's error once the batches made before it are taken.
  Batch take(int64_t step, double* wait_s = nullptr) {
    const auto t0 = Clock::now();
    std::unique_lock lock(mutex_);
    TANDEM_CHECK(step < last_, "rollout queue: step {} is past the last step {}", step, last_ - 1);
    changed_.wait(lock, [&] { return !ready_.empty() || error_; });
    if (wait_s != nullptr) *wait_s = seconds_since(t0);
    if (ready_.empty()) std::rethrow_exception(error_);
    TANDEM_CHECK(ready_.front().first == step,
                 "rollout queue: step {} was asked for, and the next batch is step {}'s", step,
                 ready_.front().first);
    Batch b = std::move(ready_.front().second);
    ready_.pop_front();
    return b;
  }
  // The trainer has updated on `step`'s batch and published the weights: later batches may start.
  void finished(int64_t step) {
    {
      std::lock_guard lock(mutex_);
      done_ = std::max(done_, step + 1);
    }
    changed_.notify_all();
  }
  // Batches made and not yet taken.
  size_t ready() const {
    std::lock_guard lock(mutex_);
    return ready_.size();
  }

 private:
  void run(int64_t first) {
    for (int64_t s = first; s < last_; ++s) {
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || may_start(s, done_, k_); });
        if (stop_) return;
      }
      try {
        Batch b = produce_(s);
        std::lock_guard lock(mutex_);
        ready_.emplace_back(s, std::move(b));
      } catch (...) {
        std::lock_guard lock(mutex_);
        error_ = std::current_exception();
        changed_.notify_all();
        return;
      }
      changed_.notify_all();
    }
  }

  const int64_t last_, k_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  int64_t done_;  // steps finished by the trainer (every step before it)
  bool stop_ = false;
  std::deque<std::pair<int64_t, Batch>> ready_;  // (step, batch), in step order
  std::exception_ptr error_;                     // the producer's, after which it stopped
  std::function<Batch(int64_t)> produce_;
  std::thread thread_;  // last: it starts once the members above are made
};

// Seconds something was busy, read from any thread while it runs: begin and end bracket each
// busy span (they do not nest).
class BusyClock {
 public:
  void begin() {
    std::lock_guard lock(mutex_);
    since_ = Clock::now();
    busy_ = true;
  }
  void end() {
    std::lock_guard lock(mutex_);
    if (busy_) total_s_ += seconds_since(since_);
    busy_ = false;
  }
  // Busy seconds from the clock's start until now, the span in progress included.
  double busy_s() const {
    std::lock_guard lock(mutex_);
    return total_s_ + (busy_ ? seconds_since(since_) : 0.0);
  }

 private:
  mutable std::mutex mutex_;
  Clock::time_point since_{};
  bool busy_ = false;
  double total_s_ = 0;
};

}  // namespace tandem::trainer
