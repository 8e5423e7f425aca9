// logprob_gather and its backward: f64 references, finite differences, batch and thread-count
// invariance, bad targets; and their parity cases.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/parallel.h"
#include "kernels/cpu/logprob.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct Reference {
  std::vector<double> logprob, lse, entropy;
};

// The plain formulas, one row after the other, in Real arithmetic (double: the truth; float: what
// a same-precision implementation gets).
template <class Real>
Reference reference(const Tensor& logits, const Tensor& targets, float temperature) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* x = logits.data_as<float>();
  const int32_t* tg = targets.data_as<int32_t>();
  Reference r;
  std::vector<Real> z(static_cast<size_t>(V));
  for (int64_t t = 0; t < T; ++t) {
    Real m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      z[v] = static_cast<Real>(x[t * V + v]) / static_cast<Real>(temperature);
      m = std::max(m, z[v]);
    }
    Real s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
    const Real lse = m + std::log(s);
    Real h = 0;
    for (int64_t v = 0; v < V; ++v) h -= std::exp(z[v] - lse) * (z[v] - lse);
    r.logprob.push_back(static_cast<double>(z[tg[t]] - lse));
    r.lse.push_back(static_cast<double>(lse));
    r.entropy.push_back(static_cast<double>(h));
  }
  return r;
}

struct Outputs {
  Tensor logprob, lse, entropy;
};

Outputs run_forward(const Tensor& logits, const Tensor& targets, float temperature,
                    bool with_entropy = true) {
  const int64_t T = logits.size(0);
  Outputs o{Tensor::zeros({T}, DType::f32), Tensor::zeros({T}, DType::f32),
            with_entropy ? Tensor::zeros({T}, DType::f32) : Tensor()};
  ops::logprob_gather(logits, targets, o.logprob, o.lse, o.entropy, temperature);
  return o;
}

}  // namespace

TEST_CASE("logprob_gather matches an f64 reference within the error of a plain f32 one", "[unit]") {
  struct Case {
    int64_t T, V;
    float temperature;
  };
  for (const Case c : {Case{7, 1000, 0.7f}, Case{3, 49157, 1.0f}, Case{5, 13, 1.3f}}) {
    INFO("T " << c.T << " V " << c.V << " temperature " << c.temperature);
    const Tensor logits = random_tensor({c.T, c.V}, DType::f32, 11 + c.V, -12.0, 12.0);
    const Tensor targets = random_ints({c.T}, DType::i32, 5 + c.V, 0, c.V);
    const Outputs o = run_forward(logits, targets, c.temperature);
    const Reference truth = reference<double>(logits, targets, c.temperature);
    const Reference f32 = reference<float>(logits, targets, c.temperature);
    check_within_reference_error(o.logprob, truth.logprob, f32.logprob, "logprob");
    check_within_reference_error(o.lse, truth.lse, f32.lse, "lse");
    check_within_reference_error(o.entropy, truth.entropy, f32.entropy, "entropy");
    // Skipping the entropy changes nothing else.
    const Outputs no_entropy = run_forward(logits, targets, c.temperature, false);
    CHECK(bitwise_equal(no_entropy.logprob, o.logprob));
    CHECK(bitwise_equal(no_entropy.lse, o.lse));
  }
}

TEST_CASE("softmax_exp is within 2 ulp of exp down to the normal range and 0 below", "[unit]") {
  double worst_ulps = 0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.0f * static_cast<float>(i) / 200000.0f;
    const double want = std::exp(static_cast<double>(x));
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst_ulps = std::max(worst_ulps, std::fabs(ops::softmax_exp(x) - want) / ulp);
  }
  INFO("worst error " << worst_ulps << " ulp");
  CHECK(worst_ulps <= 2.0);
  CHECK(ops::softmax_exp(0.0f) == 1.0f);
  CHECK(ops::softmax_exp(-INFINITY) == 0.0f);
  CHECK(ops::softmax_exp(-100.0f) == 0.0f);
  CHECK(ops::softmax_exp(-87.5f) > 0.0f);  // a subnormal, still counted
}

TEST_CASE("row_softmax gives the bits of its scalar definition on this CPU", "[unit]") {
  // The definition written plainly: lane v % 16, trees 8 4 2 1. Whatever vector build of the row
  // loops the CPU picks must give these bits.
  constexpr int L = ops::cpu::kSoftmaxLanes;
  const auto max_op = [](float a, float b) { return (a > b || a != a) ? a : b; };
  for (const int64_t V : {int64_t{1000}, int64_t{49157}, int64_t{7}}) {
    for (const float temperature : {1.0f, 0.7f}) {
      INFO("V " << V << " temperature " << temperature);
      const Tensor row = random_tensor({V}, DType::f32, 61 + V, -20.0, 20.0);
      const float* x = row.data_as<float>();
      float mx[L], s[L] = {}, ey[L] = {};
      for (float& m : mx) m = -INFINITY;
      for (int64_t v = 0; v < V; ++v) mx[v % L] = max_op(x[v], mx[v % L]);
      for (int w = L / 2; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) mx[j] = max_op(mx[j], mx[j + w]);
      const float m = ops::scaled_logit(mx[0], temperature);
      for (int64_t v = 0; v < V; ++v) {
        const float y = ops::scaled_logit(x[v], temperature) - m;
        const float e = ops::softmax_exp(y);
        s[v % L] += e;
        ey[v % L] += e * (e > 0.0f ? y : 0.0f);
      }
      for (int w = L / 2; w > 0; w /= 2) {
        for (int j = 0; j < w; ++j) {
          s[j] += s[j + w];
          ey[j] += ey[j + w];
        }
      }
      const float lse = m + std::log(s[0]);
      const float entropy = std::log(s[0]) - ey[0] / s[0];
      const ops::RowSoftmax got = ops::cpu::row_softmax(x, V, temperature, true);
      CHECK(float_bits(got.lse) == float_bits(lse));
      CHECK(float_bits(got.entropy) == float_bits(entropy));
      CHECK(float_bits(ops::cpu::row_softmax(x, V, temperature, false).lse) == float_bits(lse));
    }
  }
}

TEST_CASE("logprob_gather gives -inf logits zero mass and keeps the entropy finite", "[unit]") {
  Tensor logits = random_tensor({3, 40}, DType::f32, 4, -3.0, 3.0);
  float* x = logits.data_as<float>();
  for (int64_t i = 0; i < logits.numel(); i += 3) x[i] = -INFINITY;
  const Tensor targets = tensor_from({1, 3, 5}, {3}, DType::i32);  // none of them masked
  const Outputs o = run_forward(logits, targets, 0.9f);
  CHECK(all_finite(o.logprob));
  CHECK(all_finite(o.entropy));
  const Reference truth = reference<double>(logits, targets, 0.9f);
  const Reference f32 = reference<float>(logits, targets, 0.9f);
  check_within_reference_error(o.logprob, truth.logprob, f32.logprob, "masked logprob");
  check_within_reference_error(o.entropy, truth.entropy, f32.entropy, "masked entropy");
}

TEST_CASE("logprob_gather_backward matches finite differences of logprob and entropy", "[unit]") {
  const int64_t T = 4, V = 37;
  const float temperature = 0.8f;
  const Tensor logits = random_tensor({T, V}, DType::f32, 21, -3.0, 3.0);
  const Tensor targets = random_ints({T}, DType::i32, 22, 0, V);
  const Tensor a = random_tensor({T}, DType::f32, 23, -1.0, 1.0);
  const Tensor b = random_tensor({T}, DType::f32, 24, -1.0, 1.0);
  const Outputs o = run_forward(logits, targets, temperature);
  for (bool with_entropy : {true, false}) {
    INFO("with entropy " << with_entropy);
    Tensor dlogits = Tensor::zeros({T, V}, DType::f32);
    ops::logprob_gather_backward(a, with_entropy ? b : Tensor(), logits, targets, o.lse, dlogits,
                                 temperature);
    const auto loss = [&] {
      const Reference r = reference<double>(logits, targets, temperature);
      double sum = 0;
      for (int64_t t = 0; t < T; ++t) {
        sum += to_f64(a)[t] * r.logprob[t];
        if (with_entropy) sum += to_f64(b)[t] * r.entropy[t];
      }
      return sum;
    };
    check_gradient(logits, loss, dlogits, "dlogits", {.probes = 40, .eps = 1e-2, .rtol = 1e-2});

    // accumulate adds exactly the same gradient.
    const Tensor init = random_tensor({T, V}, DType::f32, 25);
    Tensor acc = Tensor::empty({T, V}, DType::f32);
    acc.copy_from(init);
    ops::logprob_gather_backward(a, with_entropy ? b : Tensor(), logits, targets, o.lse, acc,
                                 temperature, /*accumulate=*/true);
    const float* g = dlogits.data_as<float>();
    const float* i0 = init.data_as<float>();
    const float* got = acc.data_as<float>();
    int64_t differ = 0;
    for (int64_t i = 0; i < T * V; ++i) differ += got[i] != i0[i] + g[i];
    CHECK(differ == 0);
  }
}

TEST_CASE("logprob_gather is batch invariant bitwise", "[unit]") {
  const int64_t V = 4099;
  const Tensor all = random_tensor({64, V}, DType::f32, 31, -9.0, 9.0);
  const Tensor targets = random_ints({64}, DType::i32, 32, 0, V);
  const Outputs whole = run_forward(all, targets, 0.6f);
  for (int64_t B : {1, 5, 17, 64}) {
    for (int64_t start : {int64_t{0}, 64 - B}) {
      INFO("rows " << start << " to " << start + B);
      const Tensor rows = all.narrow(start, B).to(Device::cpu());
      const Outputs part = run_forward(rows, targets.narrow(start, B).to(Device::cpu()), 0.6f);
      CHECK(bitwise_equal(part.logprob, whole.logprob.narrow(start, B)));
      CHECK(bitwise_equal(part.lse, whole.lse.narrow(start, B)));
      CHECK(bitwise_equal(part.entropy, whole.entropy.narrow(start, B)));
    }
  }
}

TEST_CASE("logprob_gather and its backward give the same bits with any thread count", "[unit]") {
  const int64_t T = 37, V = 1001;
  const Tensor logits = random_tensor({T, V}, DType::f32, 41, -6.0, 6.0);
  const Tensor targets = random_ints({T}, DType::i32, 42, 0, V);
  const Tensor a = random_tensor({T}, DType::f32, 43);
  const Tensor b = random_tensor({T}, DType::f32, 44);
  const int before = num_threads();
  std::vector<Tensor> results;
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    const Outputs o = run_forward(logits, targets, 1.1f);
    Tensor d = Tensor::zeros({T, V}, DType::f32);
    ops::logprob_gather_backward(a, b, logits, targets, o.lse, d, 1.1f);
    results.insert(results.end(), {o.logprob, o.lse, o.entropy, d});
  }
  set_num_threads(before);
  for (size_t i = 4; i < results.size(); ++i) CHECK(bitwise_equal(results[i], results[i % 4]));
}

TEST_CASE("logprob_gather rejects targets outside the vocabulary naming the row", "[unit]") {
  const Tensor logits = random_tensor({4, 50}, DType::f32, 51);
  Tensor targets = tensor_from({3, 49, 50, 0}, {4}, DType::i32);
  Tensor lp = Tensor::zeros({4}, DType::f32), lse = Tensor::zeros({4}, DType::f32);
  CHECK_THROWS_WITH(ops::logprob_gather(logits, targets, lp, lse, Tensor()),
                    Catch::Contains("row 2") && Catch::Contains("id 50"));
  targets.data_as<int32_t>()[2] = -1;
  Tensor d = Tensor::zeros({4, 50}, DType::f32);
  CHECK_THROWS_WITH(ops::logprob_gather_backward(lp, Tensor(), logits, targets, lse, d),
                    Catch::Contains("row 2") && Catch::Contains("id -1"));
  targets.data_as<int32_t>()[2] = 7;
  CHECK_THROWS_WITH(ops::logprob_gather(logits, targets, lp, lse, Tensor(), 0.0f),
                    Catch::Contains("temperature"));
  CHECK_THROWS_AS(
      ops::logprob_gather(logits, targets, Tensor::zeros({3}, DType::f32), lse, Tensor()), Error);
  CHECK_THROWS_AS(ops::logprob_gather(logits, Tensor::zeros({4}, DType::i64), lp, lse, Tensor()),
                  Error);
  CHECK_THROWS_AS(ops::logprob_gather_backward(lp, Tensor(), logits, targets, lse,
                                               Tensor::zeros({4, 49}, DType::f32)),
                  Error);
}

TANDEM_PARITY_CASES(logprob) {
  struct Shape2 {
    int64_t T, V;
    float temperature;
  };
  for (const Shape2 s : {Shape2{37, 1000, 0.7f}, Shape2{5, 49157, 1.0f}}) {
    add_parity_case({
        .name = fmt::format("logprob_gather ({}, {}) temperature {} with entropy", s.T, s.V,
                            s.temperature),
        .inputs =
            [s](uint64_t seed) {
              return std::vector<Tensor>{random_tensor({s.T, s.V}, DType::f32, seed, -10.0, 10.0),
                                         random_ints({s.T}, DType::i32, seed + 1, 0, s.V)};
            },
        .outputs =
            [s](const std::vector<Tensor>&) {
              return std::vector<Tensor>{Tensor::zeros({s.T}, DType::f32),
                                         Tensor::zeros({s.T}, DType::f32),
                                         Tensor::zeros({s.T}, DType::f32)};
            },
        .run =
            [s](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::logprob_gather(in[0], in[1], out[0], out[1], out[2], s.temperature);
            },
        .max_nmse = 1e-8,
    });
  }
  for (const Shape2 s : {Shape2{37, 1000, 0.7f}, Shape2{9, 4099, 1.0f}}) {
    const bool with_entropy = s.V == 1000;
    add_parity_case({
        .name = fmt::format("logprob_gather_backward ({}, {}) temperature {} accumulate{}", s.T,
                            s.V, s.temperature, with_entropy ? " with dentropy" : ""),
        .inputs =
            [s](uint64_t seed) {
              const Tensor logits = random_tensor({s.T, s.V}, DType::f32, seed, -10.0, 10.0);
              const Tensor targets = random_ints({s.T}, DType::i32, seed + 1, 0, s.V);
              const Outputs o = run_forward(logits, targets, s.temperature, false);
              return std::vector<Tensor>{random_tensor({s.T}, DType::f32, seed + 2),
                                         random_tensor({s.T}, DType::f32, seed + 3), logits,
                                         targets, o.lse};
            },
        .outputs =
            [s](const std::vector<Tensor>&) {
              return std::vector<Tensor>{random_tensor({s.T, s.V}, DType::f32, 77, -1e-3, 1e-3)};
            },
        .run =
            [s, with_entropy](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::logprob_gather_backward(in[0], with_entropy ? in[1] : Tensor(), in[2], in[3],
                                           in[4], out[0], s.temperature, /*accumulate=*/true);
            },
        .max_nmse = 1e-8,
    });
  }
}
