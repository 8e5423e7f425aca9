// The CPU thread pool's loops: every index once, whatever the thread count.
#include <catch2/catch.hpp>

#include <atomic>
#include <vector>

#include "core/parallel.h"

using namespace tandem;

TEST_CASE("parallel loops visit every index exactly once with 1 and 2 threads", "[unit]") {
  const int threads = num_threads();
  for (const int t : {1, 2}) {
    set_num_threads(t);
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
      INFO("threads " << t << " n " << n);
      std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
      parallel_for(n, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)]++;
      });
      parallel_for_dynamic(n, [&](int64_t i) { seen[static_cast<size_t>(i)] += 10; });
      parallel_for_dynamic(
          n, [&](int64_t i) { seen[static_cast<size_t>(i)] += 100; }, 400);
      int64_t bad = 0;
      for (const auto& s : seen) bad += s.load() != 111;
      CHECK(bad == 0);
    }
  }
  set_num_threads(threads);
}
