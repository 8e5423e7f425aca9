// The CPU thread pool (OpenMP): one pool for every op; a fixed split of work over threads, or
// items handed out as threads finish where the result cannot depend on who computes what.
#pragma once

#include <omp.h>

#include <cstdint>

namespace tandem {

// Threads the CPU ops use: the calling thread's ScopedThreadCount, else TANDEM_NUM_THREADS, else
// the cores this process may run on.
int num_threads();
void set_num_threads(int n);

// While it lives, the ops called from this thread use `n` threads (two threads of a process
// sharing the cores between them); the others keep num_threads().
class ScopedThreadCount {
 public:
  explicit ScopedThreadCount(int n);
  ~ScopedThreadCount();
  ScopedThreadCount(const ScopedThreadCount&) = delete;
  ScopedThreadCount& operator=(const ScopedThreadCount&) = delete;

 private:
  int saved_;
};

// Calls f(begin, end) on contiguous chunks of [0, n) in parallel. The split depends only on n
// and the thread count; callers whose results must not depend on the split (every op) keep
// each output element's arithmetic inside one call.
template <class F>
void parallel_for(int64_t n, F&& f, int64_t min_chunk = 1) {
  if (n <= 0) return;
  const int64_t max_threads = (n + min_chunk - 1) / min_chunk;
  const int threads = static_cast<int>(max_threads < num_threads() ? max_threads : num_threads());
  if (threads <= 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t chunk = (n + threads - 1) / threads;
    const int64_t begin = t * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    if (begin < end) f(begin, end);
  }
}

// Calls f(i) for every i in [0, n), handing items to threads as they finish: for items of
// unequal cost whose results do not depend on the thread that computes them. Runs on one
// thread when n < 2 * min_items.
template <class F>
void parallel_for_dynamic(int64_t n, F&& f, int64_t min_items = 1) {
  if (n <= 0) return;
  const int64_t max_threads = n / (min_items < 1 ? 1 : min_items);
  const int threads = static_cast<int>(max_threads < num_threads() ? max_threads : num_threads());
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) f(i);
}

}  // namespace tandem
