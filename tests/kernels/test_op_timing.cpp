// ops::set_op_timing and take_op_times: what a step's breakdown (bench train) is made of.
#include <catch2/catch.hpp>

#include <vector>

#include "kernels/ops.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("op timing counts each op call under its name and shape only while on", "[unit]") {
  const Tensor x = random_tensor({5, 7}, DType::f32, 1);
  const Tensor w = random_tensor({3, 7}, DType::f32, 2);
  Tensor y = Tensor::empty({5, 3}, DType::f32);
  ops::take_op_times();
  ops::matmul(x, w, y);  // off: not counted
  CHECK(ops::take_op_times().empty());

  ops::set_op_timing(true);
  ops::matmul(x, w, y);
  ops::matmul(x, w, y, true);
  ops::matmul_backward_input(y, w, x);
  const std::vector<Tensor> tensors{x, w};
  ops::global_norm(tensors);  // its sum_squares calls count as global_norm's
  ops::set_op_timing(false);
  ops::matmul(x, w, y);

  const std::vector<ops::OpTime> times = ops::take_op_times();
  REQUIRE(times.size() == 3);
  int seen = 0;
  for (const ops::OpTime& t : times) {
    INFO(t.op);
    CHECK(t.seconds >= 0.0);
    if (t.op == "matmul") {
      CHECK((t.m == 5 && t.n == 3 && t.k == 7 && t.calls == 2));
      ++seen;
    } else if (t.op == "matmul_backward_input") {
      CHECK((t.m == 5 && t.n == 3 && t.k == 7 && t.calls == 1));
      ++seen;
    } else if (t.op == "global_norm") {
      CHECK((t.m == 0 && t.calls == 1));
      ++seen;
    }
  }
  CHECK(seen == 3);
  CHECK(ops::take_op_times().empty());
}
