// CommThread: one worker thread that runs submitted closures (collectives, each on a communicator
// split off for this thread) in FIFO order, so communication overlaps the caller's compute.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace tandem {

// The caller submits closures and later waits for their tickets; the closures run one at a time,
// in submission order, on the thread. A closure uses its own communicator (Communicator::split),
// never the caller's: a communicator is used by one thread at a time.
//
// Waits are not timed themselves: a wait ends when the closures before it end, and each collective
// is bounded by its communicator's timeout (distributed.timeout_s), so a dead or stuck peer ends a
// wait with that collective's error. The first exception a closure throws is kept: every later
// closure is skipped, and every wait for its ticket or a later one rethrows it.
//
// One caller thread submits and waits (submit and wait are safe to call from it while the worker
// runs).
class CommThread {
 public:
  explicit CommThread(std::string name);  // name: the thread's name (first 15 characters)
  // Runs what is still queued (skipped after a failure), then joins.
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  using Ticket = uint64_t;                  // 1, 2, 3, ... in submission order
  Ticket submit(std::function<void()> fn);  // returns at once
  // Blocks until ticket t and every earlier one ran (or were skipped); rethrows the first failure
  // if it was at t or before.
  void wait(Ticket t);
  void wait_all();  // wait(the last ticket submitted)

  struct Stats {
    double busy_s = 0;     // time closures ran
    double waited_s = 0;   // time the caller spent blocked in wait and wait_all: the exposed part
    int64_t closures = 0;  // closures that ran (skipped ones not counted)
  };
  Stats take_stats();  // since the last call

  const std::string& name() const { return name_; }

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable work_;             // the worker waits for closures or the end
  std::condition_variable done_;             // callers wait for tickets
  std::deque<std::function<void()>> queue_;  // tickets done_ticket_ + 1 ... in order (one running)
  Ticket submitted_ = 0;                     // the last ticket handed out
  Ticket done_ticket_ = 0;                   // every ticket up to this one ran or was skipped
  Ticket failed_ticket_ = 0;                 // the first failing ticket, 0 while none failed
  std::exception_ptr failure_;
  bool stopping_ = false;
  Stats stats_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace tandem
