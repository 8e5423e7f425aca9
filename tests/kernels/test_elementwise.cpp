// cast, scale, add, random_uniform and sum_squares: against plain references, and their parity
// cases.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/parallel.h"
#include "core/philox.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("cast rounds to nearest even between every float dtype", "[unit]") {
  const Tensor src = random_tensor({37, 11}, DType::f32, 3, -300.0, 300.0);
  for (DType to : {DType::bf16, DType::f16, DType::f32}) {
    Tensor dst = Tensor::empty(src.shape(), to);
    ops::cast(src, dst);
    const float* s = src.data_as<float>();
    for (int64_t i = 0; i < src.numel(); ++i) {
      uint16_t want = 0;
      if (to == DType::bf16) want = f32_to_bf16_bits(s[i]);
      if (to == DType::f16) want = f32_to_f16_bits(s[i]);
      if (to == DType::f32) {
        REQUIRE(dst.data_as<float>()[i] == s[i]);
      } else {
        REQUIRE(static_cast<const uint16_t*>(dst.data())[i] == want);
      }
    }
    // And back to f32 exactly.
    Tensor back = Tensor::empty(src.shape(), DType::f32);
    ops::cast(dst, back);
    const std::vector<double> a = to_f64(back), b = to_f64(dst);
    CHECK(max_abs_diff(a, b) == 0.0);
  }
  CHECK_THROWS_AS(ops::cast(src, Tensor::empty({5}, DType::bf16)), Error);
  CHECK_THROWS_AS(ops::cast(src, Tensor::empty(src.shape(), DType::i32)), Error);
}

TEST_CASE("sum_squares and global_norm match an f64 sum in a fixed order", "[unit]") {
  const Tensor a = random_tensor({10007}, DType::f32, 5);
  const Tensor b = random_tensor({3, 129}, DType::f32, 6);
  double want = 0;
  for (double v : to_f64(a)) want += v * v;
  Tensor out = Tensor::zeros({1}, DType::f32);
  ops::sum_squares(a, out);
  CHECK(out.data_as<float>()[0] == Approx(want).epsilon(1e-6));
  for (double v : to_f64(b)) want += v * v;
  const Tensor both[] = {a, b};
  CHECK(ops::global_norm(both) == Approx(std::sqrt(want)).epsilon(1e-6));
  // The same number with any thread count.
  const float before = ops::global_norm(both);
  set_num_threads(1);
  const float single = ops::global_norm(both);
  set_num_threads(2);
  CHECK(before == single);
}

TEST_CASE("random_uniform fills the philox stream and scale multiplies in place", "[unit]") {
  Tensor u = Tensor::empty({4, 7}, DType::f32);
  ops::random_uniform(u, 11, 3);
  const float* p = u.data_as<float>();
  for (int64_t i = 0; i < u.numel(); ++i) {
    REQUIRE(p[i] == uniform_from_bits(philox_random(11, 3, static_cast<uint64_t>(i / 4)).v[i % 4]));
  }
  const std::vector<double> before = to_f64(u);
  ops::scale(u, -0.5f);
  for (int64_t i = 0; i < u.numel(); ++i)
    REQUIRE(p[i] == static_cast<float>(before[static_cast<size_t>(i)] * -0.5));
}

TEST_CASE("add adds x into out elementwise and refuses a size mismatch", "[unit]") {
  const Tensor x = random_tensor({100003}, DType::f32, 21, -3.0, 3.0);
  Tensor out = random_tensor({100003}, DType::f32, 22, -3.0, 3.0);
  const std::vector<double> before = to_f64(out);
  ops::add(x, out);
  const float* a = x.data_as<float>();
  const float* p = out.data_as<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    REQUIRE(p[i] == static_cast<float>(before[static_cast<size_t>(i)]) + a[i]);
  CHECK_THROWS_WITH(ops::add(x.narrow(0, 5), out), Catch::Contains("differ in size"));
}

TANDEM_PARITY_CASES(elementwise) {
  for (DType from : {DType::f32, DType::bf16, DType::f16}) {
    for (DType to : {DType::f32, DType::bf16, DType::f16}) {
      add_parity_case({
          .name = fmt::format("cast {} to {} (1000003)", dtype_name(from), dtype_name(to)),
          .inputs =
              [from](uint64_t seed) {
                return std::vector<Tensor>{random_tensor({1000003}, from, seed, -60000.0, 60000.0)};
              },
          .outputs =
              [to](const std::vector<Tensor>& in) {
                return std::vector<Tensor>{Tensor::zeros(in[0].shape(), to)};
              },
          .run = [](const std::vector<Tensor>& in,
                    const std::vector<Tensor>& out) { ops::cast(in[0], out[0]); },
          .max_nmse = 0.0,  // conversions are exact functions: bitwise the same
      });
    }
  }
  add_parity_case({
      .name = "scale (333, 77) by -1.7",
      .inputs =
          [](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({333, 77}, DType::f32, seed)};
          },
      .outputs =
          [](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{in[0].to(Device::cpu())};
          },
      .run = [](const std::vector<Tensor>&,
                const std::vector<Tensor>& out) { ops::scale(out[0], -1.7f); },
      .max_nmse = 0.0,
  });
  add_parity_case({
      .name = "add (1000003)",
      .inputs =
          [](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({1000003}, DType::f32, seed),
                                       random_tensor({1000003}, DType::f32, seed + 1)};
          },
      .outputs =
          [](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{in[1].to(Device::cpu())};
          },
      .run = [](const std::vector<Tensor>& in,
                const std::vector<Tensor>& out) { ops::add(in[0], out[0]); },
      .max_nmse = 0.0,  // one f32 addition per element: bitwise the same
  });
  add_parity_case({
      .name = "random_uniform (100001) seed 5",
      .inputs = [](uint64_t) { return std::vector<Tensor>{}; },
      .outputs =
          [](const std::vector<Tensor>&) {
            return std::vector<Tensor>{Tensor::zeros({100001}, DType::f32)};
          },
      .run = [](const std::vector<Tensor>&,
                const std::vector<Tensor>& out) { ops::random_uniform(out[0], 5, 9); },
      .max_nmse = 0.0,
  });
  add_parity_case({
      .name = "sum_squares (1234567) accumulate",
      .inputs =
          [](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({1234567}, DType::f32, seed)};
          },
      .outputs =
          [](const std::vector<Tensor>&) { return std::vector<Tensor>{tensor_from({2.5}, {1})}; },
      .run =
          [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
            ops::sum_squares(in[0], out[0], /*accumulate=*/true);
          },
      .max_nmse = 1e-12,
  });
}
