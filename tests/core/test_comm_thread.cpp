// CommThread: FIFO order on its own thread, the first failure rethrown and what follows skipped,
// draining at destruction, and the busy and waited times.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/comm_thread.h"
#include "core/error.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

TEST_CASE("CommThread runs closures in submission order on its own thread", "[unit]") {
  CommThread thread("test comm");
  std::vector<int> order;
  std::atomic<int> on_caller{0}, count{0};
  const auto caller = std::this_thread::get_id();
  std::vector<CommThread::Ticket> tickets;
  for (int i = 0; i < 200; ++i)
    tickets.push_back(thread.submit([&, i] {
      if (i % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (std::this_thread::get_id() == caller) ++on_caller;
      order.push_back(i);
      ++count;
    }));
  for (size_t i = 1; i < tickets.size(); ++i) CHECK(tickets[i] == tickets[i - 1] + 1);
  thread.wait(tickets[99]);
  CHECK(count >= 100);
  thread.wait_all();
  REQUIRE(order.size() == 200);
  for (int i = 0; i < 200; ++i) CHECK(order[static_cast<size_t>(i)] == i);
  CHECK(on_caller == 0);
  CHECK(thread.take_stats().closures == 200);
}

TEST_CASE("CommThread submit returns before the closure ran", "[unit]") {
  CommThread thread("test comm");
  std::atomic<bool> release{false}, ran{false};
  const auto t = thread.submit([&] {
    for (int i = 0; i < 5000 && !release; ++i) std::this_thread::sleep_for(milliseconds(1));
    ran = true;
  });
  CHECK_FALSE(ran);
  release = true;
  thread.wait(t);
  CHECK(ran);
}

TEST_CASE("CommThread rethrows the first failure and skips every later closure", "[unit]") {
  CommThread thread("test comm");
  std::vector<int> ran;
  const auto t1 = thread.submit([&] { ran.push_back(1); });
  const auto t2 = thread.submit([&] {
    ran.push_back(2);
    TANDEM_FAIL("all_gather on group 'world/comm#0' failed");
  });
  const auto t3 = thread.submit([&] {
    ran.push_back(3);
    throw std::runtime_error("second failure");
  });
  const auto t4 = thread.submit([&] { ran.push_back(4); });
  thread.wait(t1);  // ran before the failure: no error
  CHECK_THROWS_WITH(thread.wait(t2), Catch::Contains("all_gather on group 'world/comm#0' failed"));
  CHECK_THROWS_AS(thread.wait(t4), Error);
  CHECK_THROWS_WITH(thread.wait(t3), Catch::Contains("all_gather on group 'world/comm#0'"));
  const auto t5 = thread.submit([&] { ran.push_back(5); });
  CHECK_THROWS_WITH(thread.wait(t5), Catch::Contains("all_gather on group 'world/comm#0'"));
  CHECK_THROWS_WITH(thread.wait_all(), Catch::Contains("all_gather on group 'world/comm#0'"));
  thread.wait(t1);  // still no error for a ticket before the failure
  CHECK(ran == std::vector<int>{1, 2});
  CHECK(thread.take_stats().closures == 2);
}

TEST_CASE("CommThread refuses a wait for a ticket never submitted", "[unit]") {
  CommThread thread("test comm");
  thread.wait_all();  // nothing submitted: returns
  const auto t = thread.submit([] {});
  CHECK_THROWS_WITH(thread.wait(t + 1),
                    Catch::Contains("comm thread 'test comm': wait for ticket 2, but only 1"));
  thread.wait(t);
}

TEST_CASE("CommThread runs what is queued before its destructor returns", "[unit]") {
  std::atomic<int> count{0};
  {
    CommThread thread("test comm");
    for (int i = 0; i < 20; ++i)
      thread.submit([&] {
        std::this_thread::sleep_for(milliseconds(1));
        ++count;
      });
  }
  CHECK(count == 20);
}

TEST_CASE("CommThread stats count a wait at once as exposed and a later wait as hidden", "[unit]") {
  CommThread thread("test comm");
  // Waited on at once: the caller is blocked for the whole closure.
  thread.wait(thread.submit([] { std::this_thread::sleep_for(milliseconds(50)); }));
  const CommThread::Stats exposed = thread.take_stats();
  CHECK(exposed.closures == 1);
  CHECK(exposed.busy_s >= 0.050);
  CHECK(exposed.waited_s >= 0.9 * exposed.busy_s);
  CHECK(exposed.waited_s <= exposed.busy_s + 0.05);

  // Waited on after 100 ms of the caller's own work: the closure ended meanwhile.
  const auto t = thread.submit([] { std::this_thread::sleep_for(milliseconds(50)); });
  std::this_thread::sleep_for(milliseconds(100));
  thread.wait(t);
  const CommThread::Stats hidden = thread.take_stats();
  CHECK(hidden.closures == 1);
  CHECK(hidden.busy_s >= 0.050);
  CHECK(hidden.waited_s < 0.005);

  const CommThread::Stats none = thread.take_stats();  // reset by the last call
  CHECK(none.closures == 0);
  CHECK(none.busy_s == 0);
  CHECK(none.waited_s == 0);
}

}  // namespace
}  // namespace tandem
