// swiglu and swiglu_backward: against f64 references, finite differences, batch invariance, bad
// arguments, and their parity cases.
#include <catch2/catch.hpp>

#include <cmath>

#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

Tensor f32(const Shape& s) { return Tensor::empty(s, DType::f32); }

// silu(gate) * up in R (double: truth; float: the same-precision yardstick).
template <class R>
std::vector<double> swiglu_reference(const Tensor& gate_up) {
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  const std::vector<double> v = to_f64(gate_up);
  std::vector<double> out(static_cast<size_t>(T * F));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < F; ++f) {
      const R g = static_cast<R>(v[static_cast<size_t>(t * 2 * F + f)]);
      const R u = static_cast<R>(v[static_cast<size_t>(t * 2 * F + F + f)]);
      out[static_cast<size_t>(t * F + f)] = g / (R{1} + std::exp(-g)) * u;
    }
  }
  return out;
}

template <class R>
std::vector<double> swiglu_backward_reference(const Tensor& dout, const Tensor& gate_up) {
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  const std::vector<double> v = to_f64(gate_up), dy = to_f64(dout);
  std::vector<double> out(v.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < F; ++f) {
      const size_t gi = static_cast<size_t>(t * 2 * F + f), ui = gi + static_cast<size_t>(F);
      const R g = static_cast<R>(v[gi]), u = static_cast<R>(v[ui]);
      const R d = static_cast<R>(dy[static_cast<size_t>(t * F + f)]);
      const R sig = R{1} / (R{1} + std::exp(-g));
      out[gi] = d * u * (sig + g * sig * (R{1} - sig));
      out[ui] = d * g * sig;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("swiglu matches an f64 reference within the error of an f32 reference", "[unit]") {
  for (int64_t T : {7, 13}) {
    for (int64_t F : {45, 1536}) {
      const Tensor gate_up = random_tensor({T, 2 * F}, DType::f32, T + F, -8.0, 8.0);
      Tensor out = f32({T, F});
      ops::swiglu(gate_up, out);
      check_within_reference_error(out, swiglu_reference<double>(gate_up),
                                   swiglu_reference<float>(gate_up),
                                   fmt::format("swiglu ({}, {})", T, F));
      const Tensor dout = random_tensor({T, F}, DType::f32, 2 * T + F);
      Tensor dgate_up = f32({T, 2 * F});
      ops::swiglu_backward(dout, gate_up, dgate_up);
      check_within_reference_error(dgate_up, swiglu_backward_reference<double>(dout, gate_up),
                                   swiglu_backward_reference<float>(dout, gate_up),
                                   fmt::format("swiglu_backward ({}, {})", T, F));
    }
  }
}

TEST_CASE("swiglu_backward matches finite differences", "[unit]") {
  const int64_t T = 7, F = 45;
  Tensor gate_up = random_tensor({T, 2 * F}, DType::f32, 21, -4.0, 4.0);
  const Tensor w = random_tensor({T, F}, DType::f32, 22);
  auto loss = [&] {
    Tensor out = f32({T, F});
    ops::swiglu(gate_up, out);
    return weighted_sum(out, w);
  };
  Tensor dgate_up = f32({T, 2 * F});
  ops::swiglu_backward(w, gate_up, dgate_up);
  FdOptions opt;
  opt.probes = 48;
  check_gradient(gate_up, loss, dgate_up, "swiglu d/dgate_up", opt);
}

TEST_CASE("swiglu and swiglu_backward give each row the same bits in any batch", "[unit]") {
  const int64_t T = 64, F = 45;
  const Tensor gate_up = random_tensor({T, 2 * F}, DType::f32, 31, -6.0, 6.0);
  const Tensor dout = random_tensor({T, F}, DType::f32, 32);
  Tensor full = f32({T, F}), dfull = f32({T, 2 * F});
  ops::swiglu(gate_up, full);
  ops::swiglu_backward(dout, gate_up, dfull);
  for (int64_t n = 1; n <= T; ++n) {
    const int64_t start = (n * 7) % (T - n + 1);
    Tensor part = f32({n, F}), dpart = f32({n, 2 * F});
    ops::swiglu(gate_up.narrow(start, n), part);
    ops::swiglu_backward(dout.narrow(start, n), gate_up.narrow(start, n), dpart);
    INFO("rows " << start << ".." << start + n);
    CHECK(bitwise_equal(part, full.narrow(start, n)));
    CHECK(bitwise_equal(dpart, dfull.narrow(start, n)));
  }
}

TEST_CASE("swiglu rejects odd widths mismatched shapes and dtypes", "[unit]") {
  const int64_t T = 7, F = 45;
  const Tensor gate_up = random_tensor({T, 2 * F}, DType::f32, 41);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(ops::swiglu(random_tensor({T, 2 * F + 1}, DType::f32, 1), f32({T, F})),
                    Contains("swiglu") && Contains("odd"));
  CHECK_THROWS_WITH(ops::swiglu(gate_up, f32({T, F + 1})), Contains("swiglu") && Contains("out"));
  CHECK_THROWS_WITH(ops::swiglu(random_tensor({T, 2 * F}, DType::bf16, 1), f32({T, F})),
                    Contains("gate_up"));
  CHECK_THROWS_WITH(ops::swiglu_backward(f32({T + 1, F}), gate_up, f32({T, 2 * F})),
                    Contains("swiglu_backward") && Contains("dout"));
  CHECK_THROWS_WITH(ops::swiglu_backward(f32({T, F}), gate_up, f32({T, F})),
                    Contains("swiglu_backward") && Contains("dgate_up"));
}

TANDEM_PARITY_CASES(swiglu) {
  struct Case {
    int64_t T, F;
  };
  for (Case c : {Case{13, 45}, Case{517, 1536}}) {
    add_parity_case({
        .name = fmt::format("swiglu ({}, {})", c.T, c.F),
        .inputs =
            [c](uint64_t seed) {
              return std::vector<Tensor>{random_tensor({c.T, 2 * c.F}, DType::f32, seed, -8, 8)};
            },
        .outputs =
            [c](const std::vector<Tensor>&) {
              return std::vector<Tensor>{Tensor::zeros({c.T, c.F}, DType::f32)};
            },
        .run = [](const std::vector<Tensor>& in,
                  const std::vector<Tensor>& out) { ops::swiglu(in[0], out[0]); },
        .max_nmse = 1e-8,  // expf differs by an ulp or two between libm and CUDA
    });
  }
  for (Case c : {Case{13, 45}, Case{300, 896}}) {
    add_parity_case({
        .name = fmt::format("swiglu_backward ({}, {})", c.T, c.F),
        .inputs =
            [c](uint64_t seed) {
              return std::vector<Tensor>{
                  random_tensor({c.T, c.F}, DType::f32, seed),
                  random_tensor({c.T, 2 * c.F}, DType::f32, seed + 1, -8, 8)};
            },
        .outputs =
            [c](const std::vector<Tensor>&) {
              return std::vector<Tensor>{random_tensor({c.T, 2 * c.F}, DType::f32, 3)};
            },
        .run = [](const std::vector<Tensor>& in,
                  const std::vector<Tensor>& out) { ops::swiglu_backward(in[0], in[1], out[0]); },
        .max_nmse = 1e-8,
    });
  }
}
