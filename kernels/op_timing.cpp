// ops::set_op_timing and take_op_times: the per-op wall times benchmarks break a step into.
#include "kernels/op_timing.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/ops.h"

namespace tandem::ops {
namespace detail {

std::atomic<bool> g_op_timing{false};
thread_local bool OpTimer::inside_ = false;

namespace {

std::mutex g_mutex;
std::map<std::tuple<std::string, int64_t, int64_t, int64_t>, OpTime> g_times;

}  // namespace

void record_op_time(const char* op, int64_t m, int64_t n, int64_t k, double seconds) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  OpTime& t = g_times[{op, m, n, k}];
  if (t.calls == 0) t = OpTime{op, m, n, k, 0, 0.0};
  ++t.calls;
  t.seconds += seconds;
}

}  // namespace detail

void set_op_timing(bool on) { detail::g_op_timing.store(on, std::memory_order_relaxed); }

std::vector<OpTime> take_op_times() {
  const std::lock_guard<std::mutex> lock(detail::g_mutex);
  std::vector<OpTime> out;
  out.reserve(detail::g_times.size());
  for (auto& [key, t] : detail::g_times) out.push_back(std::move(t));
  detail::g_times.clear();
  return out;
}

}  // namespace tandem::ops
