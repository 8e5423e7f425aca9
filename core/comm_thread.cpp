// CommThread: the worker loop, tickets, the first failure and the busy and waited times.
#include "core/comm_thread.h"

#include <pthread.h>

#include <chrono>
#include <utility>

#include "core/error.h"

namespace tandem {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

CommThread::CommThread(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {
  ::pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
}

CommThread::~CommThread() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_.notify_one();
  thread_.join();
}

CommThread::Ticket CommThread::submit(std::function<void()> fn) {
  Ticket t;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(fn));
    t = ++submitted_;
  }
  work_.notify_one();
  return t;
}

void CommThread::wait(Ticket t) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  TANDEM_CHECK(t <= submitted_, "comm thread '{}': wait for ticket {}, but only {} were submitted",
               name_, t, submitted_);
  done_.wait(lock, [&] { return done_ticket_ >= t; });
  stats_.waited_s += seconds_since(start);
  if (failure_ != nullptr && failed_ticket_ <= t) std::rethrow_exception(failure_);
}

void CommThread::wait_all() {
  Ticket last;
  {
    std::lock_guard lock(mutex_);
    last = submitted_;
  }
  wait(last);
}

CommThread::Stats CommThread::take_stats() {
  std::lock_guard lock(mutex_);
  return std::exchange(stats_, Stats{});
}

void CommThread::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_.wait(lock, [&] { return !queue_.empty() || stopping_; });
    if (queue_.empty()) return;  // stopping, and everything ran
    std::function<void()> fn = std::move(queue_.front());
    const bool skip = failure_ != nullptr;
    if (!skip) {
      lock.unlock();
      const auto start = std::chrono::steady_clock::now();
      std::exception_ptr error;
      try {
        fn();
      } catch (...) {
        error = std::current_exception();
      }
      const double busy = seconds_since(start);
      fn = nullptr;  // what the closure captured goes before its ticket counts as done
      lock.lock();
      stats_.busy_s += busy;
      ++stats_.closures;
      if (error != nullptr) {
        failure_ = error;
        failed_ticket_ = done_ticket_ + 1;
      }
    }
    queue_.pop_front();
    ++done_ticket_;
    done_.notify_all();
  }
}

}  // namespace tandem
