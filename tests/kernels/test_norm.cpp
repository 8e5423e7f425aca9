// rmsnorm, add_rmsnorm and rmsnorm_backward: against f64 references, finite differences, batch
// invariance, thread-count determinism, bad arguments, and their parity cases.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>

#include "core/parallel.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

constexpr float kEps = 1e-5f;

struct NormTruth {
  std::vector<double> out, rstd;
};

// Plain loops: in f64, or in f32 summing the row left to right (the same-precision yardstick).
template <class R>
NormTruth rmsnorm_reference(const Tensor& x, const Tensor& w) {
  const int64_t T = x.size(0), C = x.size(1);
  const std::vector<double> xv = to_f64(x), wv = to_f64(w);
  NormTruth r{std::vector<double>(xv.size()), std::vector<double>(static_cast<size_t>(T))};
  for (int64_t t = 0; t < T; ++t) {
    R ss = 0;
    for (int64_t c = 0; c < C; ++c) {
      const R v = static_cast<R>(xv[static_cast<size_t>(t * C + c)]);
      ss += v * v;
    }
    const R rs = R{1} / std::sqrt(ss / static_cast<R>(C) + static_cast<R>(kEps));
    r.rstd[static_cast<size_t>(t)] = rs;
    for (int64_t c = 0; c < C; ++c) {
      const size_t i = static_cast<size_t>(t * C + c);
      r.out[i] = static_cast<R>(xv[i]) * rs * static_cast<R>(wv[static_cast<size_t>(c)]);
    }
  }
  return r;
}

struct NormGrads {
  std::vector<double> dx, dweight;
};

template <class R>
NormGrads rmsnorm_backward_reference(const Tensor& dout, const Tensor& x, const Tensor& w) {
  const int64_t T = x.size(0), C = x.size(1);
  const std::vector<double> g = to_f64(dout), xv = to_f64(x), wv = to_f64(w);
  const NormTruth fwd = rmsnorm_reference<R>(x, w);
  NormGrads r{std::vector<double>(xv.size()), std::vector<double>(static_cast<size_t>(C))};
  std::vector<R> dw(static_cast<size_t>(C), R{0});
  for (int64_t t = 0; t < T; ++t) {
    const R rs = static_cast<R>(fwd.rstd[static_cast<size_t>(t)]);
    R dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      const size_t i = static_cast<size_t>(t * C + c);
      dot +=
          static_cast<R>(g[i]) * static_cast<R>(wv[static_cast<size_t>(c)]) * static_cast<R>(xv[i]);
    }
    for (int64_t c = 0; c < C; ++c) {
      const size_t i = static_cast<size_t>(t * C + c);
      const R gi = static_cast<R>(g[i]), xi = static_cast<R>(xv[i]);
      r.dx[i] = rs * gi * static_cast<R>(wv[static_cast<size_t>(c)]) -
                xi * rs * rs * rs * dot / static_cast<R>(C);
      dw[static_cast<size_t>(c)] += gi * xi * rs;
    }
  }
  for (int64_t c = 0; c < C; ++c) r.dweight[static_cast<size_t>(c)] = dw[static_cast<size_t>(c)];
  return r;
}

Tensor f32(const Shape& s) { return Tensor::empty(s, DType::f32); }

// What rmsnorm_backward reads: x (T, C), weight (C) of dtype wt, the gradient g (T, C) and the
// forward's rstd (T), from seeds `seed`, seed + 1, seed + 2.
struct BackwardInputs {
  Tensor x, w, g, rstd;
};
BackwardInputs backward_inputs(int64_t T, int64_t C, DType wt, uint64_t seed) {
  BackwardInputs in{random_tensor({T, C}, DType::f32, seed, -2.0, 2.0),
                    random_tensor({C}, wt, seed + 1, 0.5, 1.5),
                    random_tensor({T, C}, DType::f32, seed + 2), f32({T})};
  Tensor out = f32({T, C});
  ops::rmsnorm(in.x, in.w, out, in.rstd, kEps);
  return in;
}

// Runs run(start, n) on rows [start, start + n) for every n in 1..T and checks each output
// equals the same rows of the whole batch's output, bit for bit.
void check_batch_invariant(
    int64_t T, const std::function<std::vector<Tensor>(int64_t start, int64_t n)>& run) {
  const std::vector<Tensor> full = run(0, T);
  for (int64_t n = 1; n <= T; ++n) {
    const int64_t start = (n * 7) % (T - n + 1);
    const std::vector<Tensor> part = run(start, n);
    for (size_t i = 0; i < part.size(); ++i) {
      INFO("rows " << start << ".." << start + n << " output " << i);
      CHECK(bitwise_equal(part[i], full[i].narrow(start, n)));
    }
  }
}

}  // namespace

TEST_CASE("rmsnorm matches an f64 reference within the error of an f32 reference", "[unit]") {
  for (int64_t T : {7, 13}) {
    for (int64_t C : {37, 576}) {
      for (DType wt : {DType::f32, DType::bf16}) {
        const Tensor x = random_tensor({T, C}, DType::f32, 10 + T + C, -2.0, 2.0);
        const Tensor w = random_tensor({C}, wt, 20 + C, 0.5, 1.5);
        Tensor out = f32({T, C}), rstd = f32({T});
        ops::rmsnorm(x, w, out, rstd, kEps);
        const NormTruth truth = rmsnorm_reference<double>(x, w);
        const NormTruth same = rmsnorm_reference<float>(x, w);
        const std::string what = fmt::format("rmsnorm ({}, {}) weight {}", T, C, dtype_name(wt));
        check_within_reference_error(out, truth.out, same.out, what + " out");
        check_within_reference_error(rstd, truth.rstd, same.rstd, what + " rstd");
      }
    }
  }
}

TEST_CASE("rmsnorm and add_rmsnorm give each row the same bits in any batch", "[unit]") {
  for (int64_t C : {37, 576}) {
    const int64_t T = 64;
    const Tensor x = random_tensor({T, C}, DType::f32, 31, -3.0, 3.0);
    const Tensor d = random_tensor({T, C}, DType::f32, 32);
    const Tensor w = random_tensor({C}, DType::bf16, 33, 0.5, 1.5);
    check_batch_invariant(T, [&](int64_t start, int64_t n) {
      Tensor out = f32({n, C}), rstd = f32({n});
      ops::rmsnorm(x.narrow(start, n), w, out, rstd, kEps);
      return std::vector<Tensor>{out, rstd};
    });
    check_batch_invariant(T, [&](int64_t start, int64_t n) {
      Tensor sum = f32({n, C}), out = f32({n, C}), rstd = f32({n});
      ops::add_rmsnorm(x.narrow(start, n), d.narrow(start, n), w, sum, out, rstd, kEps);
      return std::vector<Tensor>{sum, out, rstd};
    });
  }
}

TEST_CASE("add_rmsnorm equals an add then rmsnorm bitwise also in place", "[unit]") {
  const int64_t T = 13, C = 576;
  const Tensor residual = random_tensor({T, C}, DType::f32, 41, -2.0, 2.0);
  const Tensor delta = random_tensor({T, C}, DType::f32, 42);
  for (DType wt : {DType::f32, DType::bf16}) {
    const Tensor w = random_tensor({C}, wt, 43, 0.5, 1.5);
    Tensor sum = f32({T, C});
    for (int64_t i = 0; i < sum.numel(); ++i)
      sum.data_as<float>()[i] = residual.data_as<float>()[i] + delta.data_as<float>()[i];
    Tensor want = f32({T, C}), want_rstd = f32({T});
    ops::rmsnorm(sum, w, want, want_rstd, kEps);

    Tensor res_out = f32({T, C}), out = f32({T, C}), rstd = f32({T});
    ops::add_rmsnorm(residual, delta, w, res_out, out, rstd, kEps);
    CHECK(bitwise_equal(res_out, sum));
    CHECK(bitwise_equal(out, want));
    CHECK(bitwise_equal(rstd, want_rstd));

    Tensor stream = residual.to(Device::cpu());  // a copy: updated in place below
    REQUIRE(stream.data() != residual.data());
    Tensor out2 = f32({T, C}), rstd2 = f32({T});
    ops::add_rmsnorm(stream, delta, w, stream, out2, rstd2, kEps);
    CHECK(bitwise_equal(stream, sum));
    CHECK(bitwise_equal(out2, want));
    CHECK(bitwise_equal(rstd2, want_rstd));
  }
}

TEST_CASE("rmsnorm_backward matches finite differences for x and weight", "[unit]") {
  const int64_t T = 7, C = 37;
  Tensor x = random_tensor({T, C}, DType::f32, 51, -5.0, 5.0);
  Tensor w = random_tensor({C}, DType::f32, 52, 0.5, 1.5);
  // Loss weights that follow x, so the term through rstd weighs as much as the direct one.
  Tensor wts = random_tensor({T, C}, DType::f32, 53);
  for (int64_t i = 0; i < wts.numel(); ++i) wts.data_as<float>()[i] += x.data_as<float>()[i];
  auto loss = [&] {
    Tensor out = f32({T, C}), rstd = f32({T});
    ops::rmsnorm(x, w, out, rstd, kEps);
    return weighted_sum(out, wts);
  };
  Tensor out = f32({T, C}), rstd = f32({T}), dx = f32({T, C}), dw = f32({C});
  ops::rmsnorm(x, w, out, rstd, kEps);
  ops::rmsnorm_backward(wts, x, w, rstd, dx, dw);
  check_gradient(x, loss, dx, "rmsnorm d/dx");
  check_gradient(w, loss, dw, "rmsnorm d/dweight");
}

TEST_CASE("rmsnorm_backward matches an f64 reference within the error of an f32 reference",
          "[unit]") {
  for (int64_t T : {13, 200}) {
    for (int64_t C : {37, 576}) {
      for (DType wt : {DType::f32, DType::bf16}) {
        const Tensor x = random_tensor({T, C}, DType::f32, 60 + T, -2.0, 2.0);
        const Tensor w = random_tensor({C}, wt, 61 + C, 0.5, 1.5);
        const Tensor g = random_tensor({T, C}, DType::f32, 62 + T + C);
        Tensor out = f32({T, C}), rstd = f32({T}), dx = f32({T, C}), dw = f32({C});
        ops::rmsnorm(x, w, out, rstd, kEps);
        ops::rmsnorm_backward(g, x, w, rstd, dx, dw);
        const NormGrads truth = rmsnorm_backward_reference<double>(g, x, w);
        const NormGrads same = rmsnorm_backward_reference<float>(g, x, w);
        const std::string what = fmt::format("rmsnorm_backward ({}, {}) {}", T, C, dtype_name(wt));
        check_within_reference_error(dx, truth.dx, same.dx, what + " dx");
        check_within_reference_error(dw, truth.dweight, same.dweight, what + " dweight");
      }
    }
  }
}

TEST_CASE("rmsnorm_backward adds into dx and dweight when asked", "[unit]") {
  const int64_t T = 13, C = 37;
  const auto [x, w, g, rstd] = backward_inputs(T, C, DType::bf16, 71);
  Tensor dx = f32({T, C}), dw = f32({C});
  ops::rmsnorm_backward(g, x, w, rstd, dx, dw);
  const Tensor dx0 = random_tensor({T, C}, DType::f32, 74);
  const Tensor dw0 = random_tensor({C}, DType::f32, 75);
  for (bool acc_dx : {false, true}) {
    for (bool acc_dw : {false, true}) {
      Tensor dx_acc = dx0.to(Device::cpu()), dw_acc = dw0.to(Device::cpu());
      ops::rmsnorm_backward(g, x, w, rstd, dx_acc, dw_acc, acc_dx, acc_dw);
      for (int64_t i = 0; i < dx.numel(); ++i) {
        const float want =
            acc_dx ? dx0.data_as<float>()[i] + dx.data_as<float>()[i] : dx.data_as<float>()[i];
        REQUIRE(dx_acc.data_as<float>()[i] == want);
      }
      for (int64_t i = 0; i < dw.numel(); ++i) {
        const float want =
            acc_dw ? dw0.data_as<float>()[i] + dw.data_as<float>()[i] : dw.data_as<float>()[i];
        REQUIRE(dw_acc.data_as<float>()[i] == want);
      }
    }
  }
}

TEST_CASE("rmsnorm_backward gives the same bits with one or two threads", "[unit]") {
  const int64_t T = 333, C = 576;
  const auto [x, w, g, rstd] = backward_inputs(T, C, DType::f32, 81);
  const int threads = num_threads();
  std::vector<Tensor> results;
  for (int n : {1, 2}) {
    set_num_threads(n);
    Tensor dx = f32({T, C}), dw = f32({C});
    ops::rmsnorm_backward(g, x, w, rstd, dx, dw);
    results.push_back(dx);
    results.push_back(dw);
  }
  set_num_threads(threads);
  CHECK(bitwise_equal(results[0], results[2]));
  CHECK(bitwise_equal(results[1], results[3]));
}

TEST_CASE("rmsnorm ops reject mismatched shapes and dtypes naming the op", "[unit]") {
  const int64_t T = 7, C = 37;
  const Tensor x = random_tensor({T, C}, DType::f32, 91);
  const Tensor w = random_tensor({C}, DType::f32, 92);
  Tensor out = f32({T, C}), rstd = f32({T});
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(ops::rmsnorm(x, random_tensor({C + 1}, DType::f32, 1), out, rstd, kEps),
                    Contains("rmsnorm") && Contains("weight"));
  CHECK_THROWS_WITH(ops::rmsnorm(x, random_tensor({C}, DType::f16, 1), out, rstd, kEps),
                    Contains("rmsnorm") && Contains("f16"));
  CHECK_THROWS_WITH(ops::rmsnorm(x, w, f32({T, C + 1}), rstd, kEps), Contains("rmsnorm"));
  CHECK_THROWS_WITH(ops::rmsnorm(x, w, out, f32({T + 1}), kEps), Contains("rstd"));
  CHECK_THROWS_WITH(ops::rmsnorm(random_tensor({T, C}, DType::bf16, 1), w, out, rstd, kEps),
                    Contains("rmsnorm") && Contains("x"));
  CHECK_THROWS_WITH(ops::add_rmsnorm(x, f32({T, C - 1}), w, out, f32({T, C}), rstd, kEps),
                    Contains("add_rmsnorm") && Contains("delta"));
  Tensor dx = f32({T, C}), dw = f32({C});
  CHECK_THROWS_WITH(ops::rmsnorm_backward(f32({T + 1, C}), x, w, rstd, dx, dw),
                    Contains("rmsnorm_backward") && Contains("dout"));
  CHECK_THROWS_WITH(ops::rmsnorm_backward(x, x, w, rstd, dx, Tensor::empty({C}, DType::bf16)),
                    Contains("rmsnorm_backward") && Contains("dweight"));
}

TANDEM_PARITY_CASES(norm) {
  struct Shape2 {
    int64_t T, C;
    DType weight;
  };
  for (Shape2 s :
       {Shape2{13, 576, DType::f32}, Shape2{7, 1536, DType::bf16}, Shape2{517, 37, DType::bf16}}) {
    add_parity_case({
        .name = fmt::format("rmsnorm ({}, {}) weight {}", s.T, s.C, dtype_name(s.weight)),
        .inputs =
            [s](uint64_t seed) {
              return std::vector<Tensor>{random_tensor({s.T, s.C}, DType::f32, seed, -3.0, 3.0),
                                         random_tensor({s.C}, s.weight, seed + 1, 0.5, 1.5)};
            },
        .outputs =
            [s](const std::vector<Tensor>&) {
              return std::vector<Tensor>{Tensor::zeros({s.T, s.C}, DType::f32),
                                         Tensor::zeros({s.T}, DType::f32)};
            },
        .run =
            [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::rmsnorm(in[0], in[1], out[0], out[1], kEps);
            },
        .max_nmse = 1e-10,
    });
  }
  for (Shape2 s : {Shape2{13, 576, DType::bf16}, Shape2{300, 37, DType::f32}}) {
    add_parity_case({
        .name = fmt::format("add_rmsnorm ({}, {}) weight {}", s.T, s.C, dtype_name(s.weight)),
        .inputs =
            [s](uint64_t seed) {
              return std::vector<Tensor>{random_tensor({s.T, s.C}, DType::f32, seed, -3.0, 3.0),
                                         random_tensor({s.T, s.C}, DType::f32, seed + 1),
                                         random_tensor({s.C}, s.weight, seed + 2, 0.5, 1.5)};
            },
        .outputs =
            [s](const std::vector<Tensor>&) {
              return std::vector<Tensor>{Tensor::zeros({s.T, s.C}, DType::f32),
                                         Tensor::zeros({s.T, s.C}, DType::f32),
                                         Tensor::zeros({s.T}, DType::f32)};
            },
        .run =
            [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::add_rmsnorm(in[0], in[1], in[2], out[0], out[1], out[2], kEps);
            },
        .max_nmse = 1e-10,
    });
  }
  // The residual stream updated in place: residual_out is the residual.
  add_parity_case({
      .name = "add_rmsnorm (33, 1536) weight bf16 in place",
      .inputs =
          [](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({33, 1536}, DType::f32, seed, -3.0, 3.0),
                                       random_tensor({33, 1536}, DType::f32, seed + 1),
                                       random_tensor({1536}, DType::bf16, seed + 2, 0.5, 1.5)};
          },
      .outputs =
          [](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{in[0].to(Device::cpu()),
                                       Tensor::zeros({33, 1536}, DType::f32),
                                       Tensor::zeros({33}, DType::f32)};
          },
      .run =
          [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
            ops::add_rmsnorm(out[0], in[1], in[2], out[0], out[1], out[2], kEps);
          },
      .max_nmse = 1e-10,
  });
  struct Backward {
    int64_t T, C;
    DType weight;
    bool accumulate;
  };
  for (Backward b : {Backward{300, 576, DType::f32, true}, Backward{13, 37, DType::bf16, false},
                     Backward{7, 1536, DType::bf16, true}}) {
    add_parity_case({
        .name = fmt::format("rmsnorm_backward ({}, {}) weight {}{}", b.T, b.C, dtype_name(b.weight),
                            b.accumulate ? " accumulate" : ""),
        .inputs =
            [b](uint64_t seed) {
              const Tensor x = random_tensor({b.T, b.C}, DType::f32, seed, -3.0, 3.0);
              const Tensor w = random_tensor({b.C}, b.weight, seed + 1, 0.5, 1.5);
              Tensor out = Tensor::empty({b.T, b.C}, DType::f32);
              Tensor rstd = Tensor::empty({b.T}, DType::f32);
              ops::rmsnorm(x, w, out, rstd, kEps);
              return std::vector<Tensor>{random_tensor({b.T, b.C}, DType::f32, seed + 2), x, w,
                                         rstd};
            },
        .outputs =
            [b](const std::vector<Tensor>&) {
              return std::vector<Tensor>{random_tensor({b.T, b.C}, DType::f32, 5),
                                         random_tensor({b.C}, DType::f32, 6)};
            },
        .run =
            [b](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::rmsnorm_backward(in[0], in[1], in[2], in[3], out[0], out[1], b.accumulate,
                                    b.accumulate);
            },
        .max_nmse = 1e-10,
    });
  }
}
