// adamw: several steps against torch.optim.AdamW's formula in f64, the rollout copy, bad input;
// and its parity cases.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/half.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct State {
  std::vector<double> p, m, v;
};

// torch.optim.AdamW (single-tensor path) for one step, in Real arithmetic.
template <class Real>
void reference_step(State& s, const std::vector<double>& grad, const ops::AdamWParams& hp) {
  const Real lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  const Real bc1 = Real(1) - std::pow(b1, static_cast<Real>(hp.step));
  const Real bc2 = Real(1) - std::pow(b2, static_cast<Real>(hp.step));
  for (size_t i = 0; i < s.p.size(); ++i) {
    const Real g = static_cast<Real>(static_cast<Real>(grad[i]) * static_cast<Real>(hp.grad_scale));
    Real p = static_cast<Real>(s.p[i]), m = static_cast<Real>(s.m[i]),
         v = static_cast<Real>(s.v[i]);
    p = p * (Real(1) - lr * wd);
    m = b1 * m + (Real(1) - b1) * g;
    v = b2 * v + (Real(1) - b2) * g * g;
    const Real denom = std::sqrt(v) / std::sqrt(bc2) + eps;
    p = p - (lr / bc1) * (m / denom);
    s.p[i] = p;
    s.m[i] = m;
    s.v[i] = v;
  }
}

}  // namespace

TEST_CASE("adamw follows torch AdamW over several steps within f32 reference error", "[unit]") {
  const int64_t n = 10007;
  Tensor p = random_tensor({n}, DType::f32, 1, -1.0, 1.0);
  Tensor m = Tensor::zeros({n}, DType::f32);
  Tensor v = Tensor::zeros({n}, DType::f32);
  Tensor copy = Tensor::zeros({n}, DType::bf16);
  State truth{to_f64(p), to_f64(m), to_f64(v)};
  State f32 = truth;
  ops::AdamWParams hp{.lr = 1e-2f,
                      .beta1 = 0.9f,
                      .beta2 = 0.95f,
                      .eps = 1e-8f,
                      .weight_decay = 0.1f,
                      .step = 1,
                      .grad_scale = 0.5f};
  for (int64_t step = 1; step <= 6; ++step) {
    INFO("step " << step);
    hp.step = step;
    const Tensor grad = random_tensor({n}, DType::f32, 100 + step, -2.0, 2.0);
    ops::adamw(p, grad, m, v, hp, copy);
    reference_step<double>(truth, to_f64(grad), hp);
    reference_step<float>(f32, to_f64(grad), hp);
    check_within_reference_error(p, truth.p, f32.p, "param");
    check_within_reference_error(m, truth.m, f32.m, "m");
    check_within_reference_error(v, truth.v, f32.v, "v");
    CHECK(nmse(to_f64(p), truth.p) < 1e-12);
    // The rollout copy is the f32 result rounded to nearest even.
    const float* pf = p.data_as<float>();
    const uint16_t* cb = static_cast<const uint16_t*>(copy.data());
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += cb[i] != f32_to_bf16_bits(pf[i]);
    CHECK(differ == 0);
  }
}

TEST_CASE("adamw grad_scale equals a pre-scaled gradient and an f32 copy equals the params",
          "[unit]") {
  const int64_t n = 4099;
  const Tensor p0 = random_tensor({n}, DType::f32, 7);
  const Tensor m0 = random_tensor({n}, DType::f32, 8, -0.1, 0.1);
  const Tensor v0 = random_tensor({n}, DType::f32, 9, 0.0, 0.01);
  const Tensor grad = random_tensor({n}, DType::f32, 10);
  const auto run = [&](const Tensor& g, float scale, const Tensor& copy) {
    std::vector<Tensor> s;
    for (const Tensor* t : {&p0, &m0, &v0}) {
      s.push_back(Tensor::empty({n}, DType::f32));
      s.back().copy_from(*t);
    }
    ops::adamw(s[0], g, s[1], s[2], {.lr = 3e-3f, .step = 4, .grad_scale = scale}, copy);
    return s;
  };
  Tensor scaled = Tensor::empty({n}, DType::f32);
  for (int64_t i = 0; i < n; ++i) scaled.data_as<float>()[i] = grad.data_as<float>()[i] * 0.25f;
  Tensor copy = Tensor::zeros({n}, DType::f32);
  const std::vector<Tensor> a = run(grad, 0.25f, copy);
  const std::vector<Tensor> b = run(scaled, 1.0f, Tensor());
  for (size_t i = 0; i < 3; ++i) CHECK(bitwise_equal(a[i], b[i]));
  CHECK(bitwise_equal(copy, a[0]));
  CHECK_FALSE(bitwise_equal(a[0], p0));
}

TEST_CASE("adamw rejects mismatched shapes and a step below 1", "[unit]") {
  const Tensor p = random_tensor({100}, DType::f32, 1);
  const Tensor g = random_tensor({100}, DType::f32, 2);
  Tensor m = Tensor::zeros({100}, DType::f32), v = Tensor::zeros({100}, DType::f32);
  CHECK_THROWS_AS(ops::adamw(p, random_tensor({99}, DType::f32, 3), m, v, {}), Error);
  CHECK_THROWS_AS(ops::adamw(p, g, m, Tensor::zeros({100}, DType::bf16), {}), Error);
  CHECK_THROWS_AS(ops::adamw(p, g, m, v, {}, Tensor::zeros({100}, DType::f16)), Error);
  CHECK_THROWS_WITH(ops::adamw(p, g, m, v, {.step = 0}), Catch::Contains("step"));
}

TANDEM_PARITY_CASES(adamw) {
  for (DType copy_type : {DType::bf16, DType::f32}) {
    add_parity_case({
        .name = fmt::format("adamw (1000003) step 7 with a {} copy", dtype_name(copy_type)),
        .inputs =
            [](uint64_t seed) {
              return std::vector<Tensor>{random_tensor({1000003}, DType::f32, seed, -3.0, 3.0)};
            },
        .outputs =
            [copy_type](const std::vector<Tensor>&) {
              return std::vector<Tensor>{random_tensor({1000003}, DType::f32, 5),
                                         random_tensor({1000003}, DType::f32, 6, -0.1, 0.1),
                                         random_tensor({1000003}, DType::f32, 7, 0.0, 0.05),
                                         Tensor::zeros({1000003}, copy_type)};
            },
        .run =
            [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::adamw(out[0], in[0], out[1], out[2],
                         {.lr = 1e-3f, .weight_decay = 0.05f, .step = 7, .grad_scale = 0.8f},
                         out[3]);
            },
        .max_nmse = 1e-12,
    });
  }
}
