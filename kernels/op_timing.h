// The timer every op dispatch starts (ops::set_op_timing): records the op's wall time when
// timing is on; only the outermost op of nested calls (global_norm's sum_squares) counts.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace tandem::ops::detail {

extern std::atomic<bool> g_op_timing;
void record_op_time(const char* op, int64_t m, int64_t n, int64_t k, double seconds);

class OpTimer {
 public:
  explicit OpTimer(const char* op, int64_t m = 0, int64_t n = 0, int64_t k = 0)
      : op_(op), m_(m), n_(n), k_(k) {
    if (!g_op_timing.load(std::memory_order_relaxed) || inside_) return;
    on_ = inside_ = true;
    t0_ = std::chrono::steady_clock::now();
  }
  ~OpTimer() {
    if (!on_) return;
    inside_ = false;
    record_op_time(op_, m_, n_, k_,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  static thread_local bool inside_;  // an outer op of this thread is being timed
  const char* op_;
  int64_t m_, n_, k_;
  bool on_ = false;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace tandem::ops::detail
