// Thread count of the CPU pool.
#include "core/parallel.h"

#include <omp.h>
#include <sched.h>

#include <cstdlib>

#include "core/error.h"

namespace tandem {
namespace {
int initial_threads() {
  if (const char* env = std::getenv("TANDEM_NUM_THREADS"); env != nullptr && *env != '\0') {
    const int n = std::atoi(env);
    TANDEM_CHECK(n >= 1, "TANDEM_NUM_THREADS='{}' must be a positive integer", env);
    return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return omp_get_num_procs();
}
int g_threads = 0;
thread_local int t_threads = 0;  // ScopedThreadCount's, 0: none
}  // namespace

int num_threads() {
  if (t_threads != 0) return t_threads;
  if (g_threads == 0) g_threads = initial_threads();
  return g_threads;
}

ScopedThreadCount::ScopedThreadCount(int n) : saved_(t_threads) {
  TANDEM_CHECK(n >= 1, "thread count must be positive, got {}", n);
  t_threads = n;
}

ScopedThreadCount::~ScopedThreadCount() { t_threads = saved_; }

void set_num_threads(int n) {
  TANDEM_CHECK(n >= 1, "thread count must be positive, got {}", n);
  g_threads = n;
}

}  // namespace tandem
