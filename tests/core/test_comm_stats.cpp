// Communicator::set_call_stats: each collective counted once under its name with its payload
// bytes and a positive time, nothing counted before or after, and a split group not counted.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"

namespace tandem {
namespace {

TEST_CASE("call stats count every collective with its payload bytes while set", "[unit]") {
  test::TempDir dir("comm_stats");
  std::vector<CallStats> stats(2);
  test::on_ranks(2, dir.path.string(), [&](int r, Communicator& comm) {
    const int64_t n = 1000;  // f32: 4000 bytes
    Tensor t = test::random_tensor({n}, DType::f32, 1 + r, -1, 1);
    Tensor twice = test::random_tensor({2 * n}, DType::f32, 3 + r, -1, 1);
    comm.all_reduce(t);  // before counting
    std::unique_ptr<Communicator> pair = comm.split("pair", {0, 1});
    comm.set_call_stats(&stats[static_cast<size_t>(r)]);
    comm.all_reduce(t);
    comm.all_reduce(t, ReduceOp::max);
    comm.reduce_scatter(twice, t);
    comm.all_gather(t, twice);
    const std::vector<int64_t> counts{300, 700};
    Tensor piece = Tensor::empty({counts[static_cast<size_t>(r)]}, DType::f32);
    comm.all_gather_v(piece, Tensor::empty({1000}, DType::f32), counts);
    comm.broadcast(t, 1);
    Tensor small = Tensor::empty({n / 2}, DType::f32);
    std::vector<P2POp> ops{send_to(1 - r, r == 0 ? t : small),
                           recv_from(1 - r, r == 0 ? small : t)};
    comm.send_recv(ops);
    comm.barrier();
    pair->all_reduce(t);  // another group: not counted
    comm.set_call_stats(nullptr);
    comm.all_reduce(t);  // after counting
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const auto& by = stats[r].by_call;
    REQUIRE(by.size() == 6);
    CHECK(by.at("all_reduce").calls == 2);
    CHECK(by.at("all_reduce").bytes == 8000);
    CHECK(by.at("reduce_scatter").calls == 1);
    CHECK(by.at("reduce_scatter").bytes == 8000);
    CHECK(by.at("all_gather").calls == 2);
    CHECK(by.at("all_gather").bytes == 8000 + 4000);
    CHECK(by.at("broadcast").bytes == 4000);
    CHECK(by.at("send_recv").bytes == 4000 + 2000);
    CHECK(by.at("barrier").calls == 1);
    CHECK(by.at("barrier").bytes == 0);
    for (const auto& [call, tally] : by) {
      INFO(call);
      CHECK(tally.seconds > 0);
    }
    const CallStats::Tally all = stats[r].total();
    CHECK(all.calls == 8);
    CHECK(all.bytes == 8000 + 8000 + 12000 + 4000 + 6000);
  }
}

}  // namespace
}  // namespace tandem
