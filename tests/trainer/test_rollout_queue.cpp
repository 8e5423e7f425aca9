// The rollout queue of rollout.max_staleness = k: a batch starts only once the trainer has
// finished the steps more than k before it, so that a sample lags the weights it is trained on by
// at most k versions, and with a fast rollout it does run k steps ahead; the producer's error
// reaches the trainer after the batches made before it; a queue destroyed mid-run stops.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/error.h"
#include "trainer/rollout_queue.h"

namespace {

using tandem::trainer::may_start;
using tandem::trainer::RolloutQueue;

// A batch: its step and the weight version published when it started.
struct Batch {
  int64_t step = 0;
  int64_t version_at_start = 0;
};

}  // namespace

TEST_CASE("may_start allows a batch once the steps more than k before it are finished", "[unit]") {
  CHECK(may_start(5, 5, 0));
  CHECK_FALSE(may_start(5, 4, 0));
  CHECK(may_start(5, 4, 1));
  CHECK_FALSE(may_start(5, 3, 1));
  CHECK(may_start(5, 3, 2));
  CHECK(may_start(0, 0, 0));
}

TEST_CASE("the rollout queue keeps every batch within max_staleness versions and reaches it",
          "[unit]") {
  for (const int64_t k : {0, 1, 2, 3}) {
    for (const int64_t first : {0, 7}) {
      INFO("k = " << k << ", first step " << first);
      const int64_t steps = 10;
      // The trainer publishes one version per finished step: version = steps finished.
      std::atomic<int64_t> published{first};
      RolloutQueue<Batch> queue(first, first + steps, k, [&](int64_t step) {
        return Batch{step, published.load()};  // a rollout much faster than the trainer
      });
      int64_t max_lag = 0;
      for (int64_t s = first; s < first + steps; ++s) {
        const Batch b = queue.take(s);
        REQUIRE(b.step == s);
        const int64_t version = published.load();  // the weights step s trains on
        CHECK(version == s);
        const int64_t lag = version - b.version_at_start;
        CHECK(lag >= 0);
        CHECK(lag <= k);
        max_lag = std::max(max_lag, lag);
        // Made or in the making beyond this one: at most k.
        CHECK(queue.ready() <= static_cast<size_t>(k));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the update
        published += 1;
        queue.finished(s);
      }
      CHECK(max_lag == k);  // the rollout ran k steps ahead (k = 0: never)
    }
  }
}

TEST_CASE("the rollout queue hands on the producer's error after the batches made before it",
          "[unit]") {
  RolloutQueue<int64_t> queue(0, 5, 2, [](int64_t step) -> int64_t {
    if (step == 2) throw std::runtime_error("worker gone");
    return step * 10;
  });
  CHECK(queue.take(0) == 0);
  queue.finished(0);
  CHECK(queue.take(1) == 10);
  queue.finished(1);
  CHECK_THROWS_WITH(queue.take(2), "worker gone");
  CHECK_THROWS_AS(queue.take(9), tandem::Error);  // past the last step
}

TEST_CASE("a rollout queue destroyed while its producer waits or works stops", "[unit]") {
  std::atomic<int> made{0};
  {
    RolloutQueue<int> queue(0, 1000, 1, [&](int64_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      return ++made;
    });
    CHECK(queue.take(0) == 1);
  }  // the producer waits at the gate for step 0 to finish (or makes step 1): it stops
  CHECK(made.load() <= 2);
}

TEST_CASE("the busy clock counts the spans between begin and end", "[unit]") {
  tandem::trainer::BusyClock clock;
  CHECK(clock.busy_s() == 0);
  clock.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double during = clock.busy_s();
  CHECK(during >= 0.019);
  clock.end();
  const double after = clock.busy_s();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(clock.busy_s() == after);  // idle: no more
  CHECK(after >= during);
}
