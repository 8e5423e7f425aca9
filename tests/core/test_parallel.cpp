// The CPU thread pool's loops: every index once, whatever the thread count; a thread's own count.
#include <catch2/catch.hpp>

#include <atomic>
#include <thread>
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

TEST_CASE("a scoped thread count holds for its own thread only", "[unit]") {
  const int threads = num_threads();
  set_num_threads(2);
  {
    const ScopedThreadCount one(1);
    CHECK(num_threads() == 1);
    int other = 0;
    std::thread t([&] { other = num_threads(); });
    t.join();
    CHECK(other == 2);
    std::atomic<int> teams{0};
    parallel_for(100, [&](int64_t, int64_t) { ++teams; });
    CHECK(teams == 1);
    {
      const ScopedThreadCount three(3);
      CHECK(num_threads() == 3);
    }
    CHECK(num_threads() == 1);
  }
  CHECK(num_threads() == 2);
  CHECK_THROWS(ScopedThreadCount(0));
  set_num_threads(threads);
}
